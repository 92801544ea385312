"""Components: everything one router process holds, built once at startup, frozen, closed at shutdown.

Nothing holds the whole: each handler, and LiveConfig, is given the few parts it uses. Live changes
reach the parts that declared themselves reconfigurable (`live.Reconfigurable`), listed here once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from dpd_router import __version__
from dpd_router.change_log import ChangeLog
from dpd_router.config import Settings
from dpd_router.live import LiveConfig, Reconfigurable
from dpd_router.metrics import RouterMetrics
from dpd_router.pool.served_model import ServedModel
from dpd_router.startup.connectors import build_connector, warn_about_connector
from dpd_router.startup.families import (
    Access,
    Engines,
    Routing,
    Serving,
    build_access,
    build_client,
    build_engines,
    build_routing,
    build_serving,
    build_transport,
    build_upkeep,
    engine_headers,
)
from dpd_router.startup.live_parts import LogLevel, ThresholdGauge
from dpd_router.startup.tokenizers import load_tokenizers
from dpd_router.startup.upkeep import Upkeep
from dpd_router.tokenizer import TokenCounter
from dpd_router.transfer.base import Connector
from dpd_router.transport import EngineCalls

log = logging.getLogger("dpd_router.app")


@dataclass(frozen=True)
class Components:
    """The router's parts, by family. `settings` are those it started with; `live.settings` those in force."""

    settings: Settings
    client: httpx.AsyncClient
    connector: Connector
    metrics: RouterMetrics
    model: ServedModel
    # One a pool (None: the shared pool's); the same local tokenizer for all when one is configured.
    tokenizers: Mapping[str | None, TokenCounter]
    engines: Engines
    routing: Routing
    access: Access
    serving: Serving
    upkeep: Upkeep
    live: LiveConfig

    @classmethod
    async def start(cls, settings: Settings) -> Components:
        transport = build_transport(settings)
        client = build_client(settings, transport)
        # First, before anything else runs: a notification address that cannot be bound stops the
        # router here, with nothing else to close.
        engine_calls = EngineCalls(transport, engine_headers(settings))
        connector = build_connector(settings, engine_calls)
        try:
            await connector.start()
        except BaseException:
            await client.aclose()
            raise
        try:
            return await cls._build(settings, client, engine_calls, connector)
        except BaseException:
            await connector.close()
            await client.aclose()
            raise

    @classmethod
    async def _build(
        cls, settings: Settings, client: httpx.AsyncClient, engine_calls: EngineCalls, connector: Connector
    ) -> Components:
        warn_about_connector(settings)
        metrics = RouterMetrics(multiprocess=settings.workers > 1)
        engines = await build_engines(settings, metrics)
        ThresholdGauge(metrics).reconfigure(settings)
        model = ServedModel(settings.model)
        tokenizers = await load_tokenizers(settings, client, engines.by_tenant, model, metrics)
        routing = build_routing(settings, engines, metrics, client, connector)
        access = build_access(settings, engines, metrics)
        serving = build_serving(
            settings,
            engine_calls=engine_calls,
            connector=connector,
            metrics=metrics,
            model=model,
            tokenizers=tokenizers,
            routing=routing,
        )
        upkeep = build_upkeep(settings, engines, client=client, metrics=metrics, model=model, lmcache=routing.lmcache)
        # A worker of several follows the workers' change log, which the supervisor names (change_log.py).
        change_log = ChangeLog.from_environment() if settings.workers > 1 else None
        live = LiveConfig(settings, live_parts(metrics, routing, serving, access), metrics, change_log)
        components = cls(
            settings, client, connector, metrics, model, tokenizers, engines, routing, access, serving, upkeep, live
        )
        await live.replay_changes()
        live.start()
        await upkeep.start()
        serving.shadow.start()
        if routing.kv_events is not None:
            routing.kv_events.start()
        components.log_started()
        return components

    def log_started(self) -> None:
        settings, shared = self.settings, self.engines.shared
        log.info(
            "dpd-router %s serving %s with %d prefillers and %d decoders (%d tenant pools), threshold %d tokens, "
            "strategy %s, api keys %s",
            __version__,
            self.model.name or "(model not yet known)",
            len(shared.prefillers),
            len(shared.decoders),
            len(self.engines.tenants),
            settings.routing_threshold,
            settings.prefill_strategy,
            "on" if self.access.gatekeeper.keys.enabled else "off",
        )

    async def close(self) -> None:
        if self.engines.discovery is not None:
            await self.engines.discovery.close()
        await self.live.close()
        await self.upkeep.close()
        await self.serving.shadow.close()
        if self.routing.kv_events is not None:
            await self.routing.kv_events.close()
        await self.serving.gateway.close()
        await self.serving.responses.aclose()
        await self.connector.close()
        if self.access.limits_store is not None:
            await self.access.limits_store.aclose()
        for tokenizer in {id(tokenizer): tokenizer for tokenizer in self.tokenizers.values()}.values():
            await tokenizer.aclose()
        await self.client.aclose()


def live_parts(metrics: RouterMetrics, routing: Routing, serving: Serving, access: Access) -> list[Reconfigurable]:
    """What a live change reaches, in this order: the planners (and the adaptive model they share), the
    experiment arms, the gateway's timeouts and retries, the shadow, admission, the threshold gauge, the log level."""
    return [
        *routing.planners.values(),
        *([routing.experiments] if routing.experiments is not None else []),
        serving.gateway,
        serving.shadow,
        access.admission,
        ThresholdGauge(metrics),
        LogLevel(),
    ]
