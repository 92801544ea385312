"""Components: everything one router process holds, built once at startup, frozen, closed at shutdown.

Nothing holds the whole: each handler, and LiveConfig, is given the few parts it uses. Live changes
reach the parts that declared themselves reconfigurable (`live.Reconfigurable`), listed here once.
Each served model has parts of its own (model_stack.py); the rest serves them all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from dpd_router import __version__
from dpd_router.change_log import ChangeLog
from dpd_router.config import Settings
from dpd_router.gateway.models import Models
from dpd_router.live import LiveConfig, Reconfigurable
from dpd_router.pool.discovery import EngineOwners
from dpd_router.pool.pool import Pool
from dpd_router.pool.transport import EngineCalls
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Observer
from dpd_router.record.outcome import Outcome
from dpd_router.shadow import LiveShadow
from dpd_router.startup.families import (
    Access,
    Serving,
    build_access,
    build_client,
    build_observer,
    build_responses,
    build_transport,
    build_upkeep,
    engine_headers,
)
from dpd_router.startup.live_parts import LogLevel, ThresholdGauge
from dpd_router.startup.model_stack import ModelParts, ModelServices, ModelStack, build_model_stack, watch_adaptive
from dpd_router.startup.upkeep import Upkeep

log = logging.getLogger("dpd_router.app")


@dataclass(frozen=True)
class Components:
    """The router's parts, by family. `settings` are those it started with; `live.settings` those in force."""

    settings: Settings
    client: httpx.AsyncClient
    metrics: RouterMetrics
    # Each served model's own parts, in the configured order (the first serves requests naming none).
    stacks: tuple[ModelStack, ...]
    # Every engine of every model, as one pool (what health, load and the console watch).
    every_engine: Pool
    access: Access
    serving: Serving
    upkeep: Upkeep
    live: LiveConfig

    @property
    def default(self) -> ModelStack:
        """The first model's parts (what the admin and console views of one planner describe)."""
        return self.stacks[0]

    @classmethod
    async def start(cls, settings: Settings) -> Components:
        transport = build_transport(settings)
        client = build_client(settings, transport)
        engine_calls = EngineCalls(transport, engine_headers(settings))
        metrics = RouterMetrics(multiprocess=settings.workers > 1)
        stacks: list[ModelStack] = []
        learners: dict[str | None, Callable[[Outcome], None]] = {}

        def learn(outcome: Outcome) -> None:
            learner = learners.get(outcome.model) or learners.get(stacks[0].key)
            if learner is not None:
                learner(outcome)

        observer = build_observer(settings, metrics, learn)
        shadow = LiveShadow(settings, observer, metrics)
        owners = EngineOwners()
        try:
            # First, before anything else runs: a notification address that cannot be bound stops the
            # router here, with only the models built so far to close.
            for key, model_settings in settings.each_model().items():
                stack = await build_model_stack(
                    key,
                    model_settings,
                    engine_calls=engine_calls,
                    client=client,
                    metrics=metrics,
                    build=ModelServices(observer, shadow, owners),
                    pool_name=key if settings.models and key is not None else "shared",
                )
                stacks.append(stack)
                learners[key] = stack.learn_from
            return await cls._build(settings, client, metrics, tuple(stacks), observer, shadow)
        except BaseException:
            for stack in stacks:
                await stack.close()
            await client.aclose()
            raise

    @classmethod
    async def _build(
        cls,
        settings: Settings,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        stacks: tuple[ModelStack, ...],
        observer: Observer,
        shadow: LiveShadow,
    ) -> Components:
        # Every model's pools side by side (the console lists them by name).
        every = Pool.union(pool for stack in stacks for pool in stack.engines.every.parts)
        watch_adaptive(metrics, stacks)
        access = build_access(settings, stacks[0].engines, metrics)
        serving = Serving(
            Models([stack.serving for stack in stacks], aliases=settings.model_aliases),
            observer,
            shadow,
            build_responses(settings, metrics),
        )
        upkeep = build_upkeep(
            settings,
            every,
            client=client,
            metrics=metrics,
            models=[(stack.model, stack.engines.every) for stack in stacks],
            lmcache=[
                (stack.routing.lmcache, stack.engines.every) for stack in stacks if stack.routing.lmcache is not None
            ],
        )
        # A worker of several follows the workers' change log, which the supervisor names (change_log.py).
        change_log = ChangeLog.from_environment() if settings.workers > 1 else None
        live = LiveConfig(settings, live_parts(metrics, stacks, serving, access), metrics, change_log)
        components = cls(settings, client, metrics, stacks, every, access, serving, upkeep, live)
        await live.replay_changes()
        live.start()
        await upkeep.start()  # its first health round learns the names of models not configured
        for stack in stacks:
            ThresholdGauge(metrics, stack.model).reconfigure(stack.settings)
        serving.shadow.start()
        for stack in stacks:
            if stack.routing.kv_events is not None:
                stack.routing.kv_events.start()
        components.log_started()
        return components

    def log_started(self) -> None:
        for stack in self.stacks:
            shared = stack.engines.shared
            log.info(
                "dpd-router %s serving %s with %d prefillers and %d decoders (%d tenant pools), threshold %d "
                "tokens, strategy %s, api keys %s",
                __version__,
                stack.model.name or "(model not yet known)",
                len(shared.prefillers),
                len(shared.decoders),
                len(stack.engines.tenants),
                stack.settings.routing_threshold,
                stack.settings.prefill_strategy,
                "on" if self.access.gatekeeper.keys.enabled else "off",
            )

    async def close(self) -> None:
        for stack in self.stacks:
            if stack.engines.discovery is not None:
                await stack.engines.discovery.close()
        await self.live.close()
        await self.upkeep.close()
        await self.serving.shadow.close()
        for stack in self.stacks:
            await stack.close()
        await self.serving.responses.aclose()
        if self.access.limits_store is not None:
            await self.access.limits_store.aclose()
        await self.client.aclose()


def live_parts(
    metrics: RouterMetrics, stacks: Sequence[ModelStack], serving: Serving, access: Access
) -> list[Reconfigurable]:
    """What a live change reaches, in this order: each model's planners (and the adaptive model they share),
    experiment arms and gateway (timeouts and retries), given that model's settings; the shadow, admission,
    the model aliases, each model's threshold gauge, the log level."""
    return [
        *(stack.live_parts() for stack in stacks),
        serving.shadow,
        serving.models,
        access.admission,
        *(ModelParts(stack.key, [ThresholdGauge(metrics, stack.model)]) for stack in stacks),
        LogLevel(),
    ]
