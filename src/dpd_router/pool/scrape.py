"""Load scraping: each engine's `GET /metrics`, read for the few numbers routing weighs.

One round (`scrape_all`) asks every endpoint at once with the shared HTTP client; `run` repeats
it every `interval` seconds. A scrape that fails keeps the endpoint's previous numbers, which stop
counting once they are `STALE_AFTER_INTERVALS` intervals old.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import httpx

from dpd_router.pool.endpoint import Endpoint, EngineLoad
from dpd_router.pool.pool import Pool
from dpd_router.record.metrics import RouterMetrics

log = logging.getLogger("dpd_router.scrape")

# A scraped load older than this many scrape intervals is ignored by load scoring.
STALE_AFTER_INTERVALS = 3
# Pages larger than this are parsed in a worker thread rather than on the event loop.
PARSE_INLINE_MAX_CHARS = 512 * 1024

# vLLM v1 names first, then the names older engines used for the same signal.
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")

_WANTED = (*RUNNING, *WAITING, *KV_CACHE_USAGE, *PREFIX_HITS, *PREFIX_QUERIES)
# A sample line: the name, optional labels (to the last `}` on the line), then the value.
_SAMPLE = re.compile(
    r"^(" + "|".join(re.escape(name) for name in _WANTED) + r")(?:\{[^\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)


@dataclass(frozen=True)
class EngineMetrics:
    """The load signals read from one `/metrics` page; None where the page did not have them."""

    running: float
    waiting: float
    kv_cache_usage: float | None
    prefix_cache_hits: float | None
    prefix_cache_queries: float | None


class UnreadableMetrics(ValueError):
    """The page has no `vllm:num_requests_running` / `vllm:num_requests_waiting` samples."""


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Read the load signals from Prometheus text; sum over label sets (one per data-parallel rank)."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for match in _SAMPLE.finditer(text):
        name, raw = match.group(1), match.group(2)
        try:
            value = float(raw)
        except ValueError:
            continue
        totals[name] = totals.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    running = _first(totals, RUNNING)
    waiting = _first(totals, WAITING)
    if running is None or waiting is None:
        raise UnreadableMetrics("no vllm:num_requests_running / vllm:num_requests_waiting samples")
    usage_name = next((name for name in KV_CACHE_USAGE if name in totals), None)
    usage = totals[usage_name] / counts[usage_name] if usage_name is not None else None
    return EngineMetrics(
        running=running,
        waiting=waiting,
        kv_cache_usage=usage,
        prefix_cache_hits=_first(totals, PREFIX_HITS),
        prefix_cache_queries=_first(totals, PREFIX_QUERIES),
    )


def _first(totals: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in totals:
            return totals[name]
    return None


class LoadScraper:
    """Scrapes every endpoint's `/metrics` and records the load on the Endpoint."""

    def __init__(
        self,
        pool: Pool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        *,
        interval: float,
        timeout: float,
    ) -> None:
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self.interval = interval
        self._timeout = min(timeout, interval)
        # The previous scrape's prefix-cache counters per endpoint URL: one entry per endpoint.
        self._counters: dict[str, tuple[float, float]] = {}

    async def run(self) -> None:
        """Scrape forever, one round every `interval` seconds; the owner cancels the task."""
        while True:
            try:
                await self.scrape_all()
            except Exception:
                log.exception("load scrape round failed")
            await asyncio.sleep(self.interval)

    async def scrape_all(self) -> None:
        endpoints = self._pool.endpoints()
        if len(self._counters) > len(endpoints):
            # Endpoints left the pool (discovery): drop their counters.
            members = {endpoint.url for endpoint in endpoints}
            self._counters = {url: counters for url, counters in self._counters.items() if url in members}
        await asyncio.gather(*(self.scrape(endpoint) for endpoint in endpoints))

    async def scrape(self, endpoint: Endpoint) -> bool:
        """One scrape of one endpoint; True when it yielded fresh load numbers."""
        outcome = "ok"
        try:
            response = await self._client.get(f"{endpoint.url}/metrics", timeout=self._timeout)
            if response.status_code != 200:
                outcome = f"status_{response.status_code // 100}xx"
            else:
                text = response.text
                if len(text) > PARSE_INLINE_MAX_CHARS:
                    parsed = await asyncio.to_thread(parse_engine_metrics, text)
                else:
                    parsed = parse_engine_metrics(text)
                self._record(endpoint, parsed, time.monotonic())
        except httpx.TimeoutException:
            outcome = "timeout"
        except httpx.HTTPError:
            outcome = "error"
        except UnreadableMetrics:
            outcome = "unreadable"
        self._metrics.load_scrapes.labels(endpoint.url, endpoint.role, outcome).inc()
        if outcome != "ok":
            log.debug("load scrape of %s failed: %s", endpoint.url, outcome)
        return outcome == "ok"

    def _record(self, endpoint: Endpoint, parsed: EngineMetrics, now: float) -> None:
        load = EngineLoad(
            running=parsed.running,
            waiting=parsed.waiting,
            kv_cache_usage=parsed.kv_cache_usage,
            prefix_cache_hit_rate=self._hit_rate(endpoint, parsed),
            scraped_at=now,
        )
        endpoint.record_load(load, fresh_for=STALE_AFTER_INTERVALS * self.interval)

    def _hit_rate(self, endpoint: Endpoint, parsed: EngineMetrics) -> float | None:
        """Δhits/Δqueries since the last scrape; the previous rate when no query came in between."""
        previous_rate = endpoint.load.prefix_cache_hit_rate if endpoint.load is not None else None
        hits, queries = parsed.prefix_cache_hits, parsed.prefix_cache_queries
        if hits is None or queries is None:
            return None
        before = self._counters.get(endpoint.url)
        self._counters[endpoint.url] = (hits, queries)
        if before is None:
            return previous_rate
        delta_hits, delta_queries = hits - before[0], queries - before[1]
        if delta_queries <= 0 or delta_hits < 0:
            # No traffic in between, or the engine restarted and its counters began again.
            return previous_rate
        return min(1.0, delta_hits / delta_queries)
