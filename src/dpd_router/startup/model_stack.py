"""One served model's parts, built from its settings (the top level's, or an entry of `models`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx

from dpd_router.config import Settings
from dpd_router.gateway.models import ServingModel
from dpd_router.live import Reconfigurable
from dpd_router.pool.adapters import AdapterLoader
from dpd_router.pool.discovery import EngineOwners
from dpd_router.pool.served_model import ServedModel
from dpd_router.pool.transport import EngineCalls
from dpd_router.prompt.tokenizer import TokenCounter
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Observer
from dpd_router.record.outcome import Outcome
from dpd_router.shadow import LiveShadow
from dpd_router.startup.connectors import build_connector, warn_about_connector
from dpd_router.startup.families import Engines, Routing, build_engines, build_gateway, build_routing
from dpd_router.startup.tokenizers import load_tokenizers
from dpd_router.transfer.base import Connector


@dataclass(frozen=True)
class ModelStack:
    """A model's connector, engines, token counters, routing and gateway: nothing of it is another model's."""

    # The model's key in `Settings.each_model()`: its configured name (None: a lone model learnt from its engines).
    key: str | None
    settings: Settings
    connector: Connector
    engines: Engines
    tokenizers: Mapping[str | None, TokenCounter]
    routing: Routing
    serving: ServingModel

    @property
    def model(self) -> ServedModel:
        return self.serving.model

    def live_parts(self) -> Reconfigurable:
        """What a live change reaches in this model, given this model's settings in force."""
        parts: list[Reconfigurable] = [*self.routing.planners.values(), self.routing.adapters]
        if self.routing.experiments is not None:
            parts.append(self.routing.experiments)
        parts.append(self.serving.gateway)
        return ModelParts(self.key, parts)

    def learn_from(self, outcome: Outcome) -> None:
        routing = self.routing
        (routing.adaptive.learn_from if routing.experiments is None else routing.experiments.learn_from)(outcome)

    async def close(self) -> None:
        """Stop what runs on its own (before the process-wide parts it uses close)."""
        if self.routing.kv_events is not None:
            await self.routing.kv_events.close()
        await self.serving.gateway.close()
        await self.connector.close()
        for tokenizer in {id(tokenizer): tokenizer for tokenizer in self.tokenizers.values()}.values():
            await tokenizer.aclose()


class ModelParts:
    """A model's reconfigurable parts, each given the model's own settings out of the router's."""

    def __init__(self, key: str | None, parts: Sequence[Reconfigurable]) -> None:
        self._key = key
        self._parts = tuple(parts)

    def reconfigure(self, settings: Settings) -> None:
        mine = settings.each_model().get(self._key)
        if mine is None:  # the models cannot change while the router runs (live.py refuses it)
            return
        for part in self._parts:
            part.reconfigure(mine)


async def build_model_stack(
    key: str | None,
    settings: Settings,
    *,
    engine_calls: EngineCalls,
    client: httpx.AsyncClient,
    metrics: RouterMetrics,
    build: ModelServices,
    pool_name: str = "shared",
) -> ModelStack:
    """The model's parts; its connector started (a notification address that cannot be bound stops here)."""
    warn_about_connector(settings)
    connector = build_connector(settings, engine_calls)
    await connector.start()
    try:
        engines = await build_engines(settings, metrics, pool_name=pool_name, owners=build.owners)
        model = ServedModel(settings.model)
        tokenizers = await load_tokenizers(settings, client, engines.by_tenant, model, metrics)
        routing = build_routing(settings, engines, metrics, client, connector)
        loader = (
            AdapterLoader(client, settings.lora_adapters, metrics, model=model, timeout=settings.request_timeout)
            if settings.lora_adapters
            else None
        )
        gateway = build_gateway(
            settings,
            engine_calls=engine_calls,
            connector=connector,
            metrics=metrics,
            model=model,
            tokenizers=tokenizers,
            routing=routing,
            observer=build.observer,
            shadow=build.shadow,
            adapter_loader=loader,
        )
    except BaseException:
        await connector.close()
        raise
    return ModelStack(
        key, settings, connector, engines, tokenizers, routing, ServingModel(model, gateway, engines.by_tenant, loader)
    )


@dataclass(frozen=True)
class ModelServices:
    """What every model's parts share: the observer that records requests, the shadow, and which model each
    engine discovery finds serves."""

    observer: Observer
    shadow: LiveShadow
    owners: EngineOwners


def watch_adaptive(metrics: RouterMetrics, stacks: Sequence[ModelStack]) -> None:
    """Export every model's adaptive view as one family (the decoders of two models are never the same)."""
    metrics.watch_adaptive(
        lambda: [
            (entry["decoder"], math.inf if entry["threshold_tokens"] is None else entry["threshold_tokens"])
            for stack in stacks
            for entry in stack.routing.planner.adaptive_view()
        ],
        lambda: [row for stack in stacks for row in stack.routing.adaptive.cost_rows()],
    )
