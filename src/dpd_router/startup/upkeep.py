"""What runs beside the requests: health rounds (probes, model and adapter discovery, LMCache instances), load
scraping, the console's history and giving freed memory back to the system."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx

from dpd_router.api.console import ConsoleHistory
from dpd_router.pool.adapters import learn_adapters
from dpd_router.pool.health import HealthChecker
from dpd_router.pool.pool import Pool
from dpd_router.pool.scrape import LoadScraper
from dpd_router.pool.served_model import ServedModel
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.kv_sources.lmcache_controller import LMCacheController
from dpd_router.startup.allocator import MemoryReturn
from dpd_router.startup.tasks import cancel_and_wait

log = logging.getLogger("dpd_router.app")

# Seconds at least between asking every engine for its LoRA adapters (on a health round): an adapter loaded at
# runtime is served within this, and a short health interval does not turn into a model listing per probe.
ADAPTERS_EVERY = 5.0


class Upkeep:
    """Runs a health round every `interval` seconds, the load scraper, the heaps' trimming where the
    allocator is glibc's (`memory`) and, in a worker process, the metrics publisher, from `start` to `close`."""

    def __init__(
        self,
        pool: Pool,
        client: httpx.AsyncClient,
        *,
        metrics: RouterMetrics,
        health: HealthChecker,
        scraper: LoadScraper,
        models: Sequence[tuple[ServedModel, Pool]],
        lmcache: Sequence[tuple[LMCacheController, Pool]],
        interval: float,
        probe_timeout: float,
        memory: MemoryReturn | None = None,
        history: ConsoleHistory | None = None,
    ) -> None:
        self.pool = pool
        self.health = health
        self.scraper = scraper
        self._client = client
        self._metrics = metrics
        # Each model, learnt from its own decoders; each LMCache controller, told its own engines.
        self._models = tuple(models)
        self._lmcache = tuple(lmcache)
        self._interval = interval
        self._probe_timeout = probe_timeout
        self._memory = memory
        # The console's charts over the last minutes, for a page opened now.
        self.history = history
        self._tasks: list[asyncio.Task[None]] = []
        self._adapters_due = 0.0  # loop time of the next adapter listing

    async def start(self) -> None:
        """One health round now (the router starts knowing its engines), then both loops."""
        await self.maintain_once()
        self._tasks = [
            asyncio.create_task(self._maintain(), name="router-maintenance"),
            asyncio.create_task(self.scraper.run(), name="load-scraper"),
        ]
        if self.history is not None:
            self.history.sample()
            self._tasks.append(asyncio.create_task(self.history.run(), name="console-history"))
        if self._memory is not None:
            self._tasks.append(asyncio.create_task(self._memory.run(), name="memory-return"))
        if self._metrics.multiprocess:  # a worker's scrape-time gauges, copied to the shared files
            self._tasks.append(asyncio.create_task(self._metrics.publish_every(), name="metrics-publisher"))

    async def maintain_once(self) -> None:
        await self.health.probe_all()
        now = asyncio.get_running_loop().time()
        if now >= self._adapters_due:
            self._adapters_due = now + ADAPTERS_EVERY
            await learn_adapters(self._client, self.pool, probe_timeout=self._probe_timeout)
        for model, pool in self._models:
            if model.listing is None:
                await model.discover(self._client, pool, probe_timeout=self._probe_timeout)
        for controller, pool in self._lmcache:
            await controller.learn_instances(pool.endpoints())

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.maintain_once()
            except Exception:
                log.exception("health round failed")

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
