"""The models a router serves, the first routing key: a request goes to the gateway of the model it names.

Each served model has its own gateway (its pools, tokenizer, planners, connector and learned deadlines);
nothing of one model's state decides for another's. A request naming no model goes to the first; one
naming a model the router does not serve gets vLLM's own 404 before any engine is asked.

A LoRA adapter is a name some of a model's engines list in their `/v1/models` (learnt each health
round): its requests go to that model's gateway, which serves them on engines that list it alone. An
adapter no decoder lists is refused as its decoders would refuse it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpd_router.config import Settings
from dpd_router.gateway.handler import Gateway
from dpd_router.pool.adapters import AdapterLoader
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.pool.served_model import ServedModel
from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import ModelNotFound
from dpd_router.routing.experiments import arm_position


@dataclass(frozen=True)
class ServingModel:
    """One served model: its name and context length, the gateway that serves it, and its pools by tenant."""

    model: ServedModel
    gateway: Gateway
    pools: Mapping[str | None, Pool]
    # Loads the adapters of its `lora_adapters` setting where a request needs one (None: none to load).
    adapter_loader: AdapterLoader | None = None

    @property
    def name(self) -> str | None:
        return self.model.name

    def engines(self) -> Iterator[Endpoint]:
        for pool in self.pools.values():
            yield from pool.endpoints()

    def serves_adapter(self, name: str) -> bool:
        """Whether a decoder of this model lists the LoRA adapter `name`, or the router loads it where needed."""
        if self.adapter_loader is not None and name in self.adapter_loader.names:
            return True
        return any(endpoint.role == "decode" and name in endpoint.adapters for endpoint in self.engines())

    def adapter_cards(self) -> list[dict[str, Any]]:
        """The adapters its engines list, as they list them (one card each), then those the router would load."""
        cards: dict[str, dict[str, Any]] = {}
        for endpoint in self.engines():
            for name, card in endpoint.adapters.items():
                cards.setdefault(name, card)
        if self.adapter_loader is not None:
            for name in sorted(self.adapter_loader.names - cards.keys()):
                cards[name] = self.adapter_loader.card(name)
        return list(cards.values())


class Models:
    """The served models, in the order configured (the first serves requests that name none), and the aliases
    over them (`model_aliases`, live)."""

    def __init__(self, models: Sequence[ServingModel], *, aliases: Mapping[str, Mapping[str, float]] | None = None):
        if not models:
            raise ValueError("a router serves at least one model")
        self._models = tuple(models)
        self.default = self._models[0]
        self._aliases: Mapping[str, Mapping[str, float]] = aliases or {}
        self._spread = random.Random()  # where requests without a sticky key fall

    def reconfigure(self, settings: Settings) -> None:
        self._aliases = settings.model_aliases

    @property
    def aliased(self) -> bool:
        """Whether any alias is in force (none: no request needs its sticky key worked out)."""
        return bool(self._aliases)

    def __iter__(self) -> Iterator[ServingModel]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def named(self, name: str | None) -> ServingModel:
        """The model called `name`, or whose LoRA adapter it is (None: the default); ModelNotFound, as
        vLLM words it, for any other.

        A lone model whose name is neither configured nor learnt yet takes every name: its engines judge it.
        """
        return self.route(name)[0]

    def route(self, name: str | None, *, sticky: str | None = None) -> tuple[ServingModel, str | None]:
        """The model `name` names and, when it is a LoRA adapter of it, the adapter. An alias names one of its
        models by weight: the same for every request with the same `sticky` key."""
        if name is None:
            return self.default, None
        targets = self._aliases.get(name)
        if targets:
            name = self._choose(name, targets, sticky)
        for served in self._models:
            if served.model.name == name:
                return served, None
        for served in self._models:
            if served.serves_adapter(name):
                return served, name
        if len(self._models) == 1 and self.default.model.name is None:
            return self.default, None
        raise ModelNotFound(f"The model `{shortened(name)}` does not exist.", param="model")

    def resolve(self, request: ClientRequest, *, sticky: str | None = None) -> tuple[ServingModel, str | None]:
        """The model `request` names (and its adapter, if it names one), filling in the model's name when it
        names none or an alias (`sticky`: the key that keeps a session's requests on one of an alias's models)."""
        asked = request.body.get("model")
        served, adapter = self.route(asked if isinstance(asked, str) else None, sticky=sticky)
        if adapter is None and served.model.name is not None and asked != served.model.name:
            request.body["model"] = served.model.name
            request.body_changed = True
        return served, adapter

    def _choose(self, alias: str, targets: Mapping[str, float], sticky: str | None) -> str:
        """One of an alias's models, by weight: where the sticky key's stable hash falls (the same in every
        process), or at random without one."""
        total = sum(targets.values())
        point = (arm_position(f"{alias}\n{sticky}") if sticky is not None else self._spread.random()) * total
        for target, weight in targets.items():
            point -= weight
            if point < 0:
                return target
        return list(targets)[-1]  # a rounding short of the total

    def listing(self) -> dict[str, Any]:
        """`/v1/models`: every model, then its adapters, with the fields their engines list them with; then
        each alias, as the card of its most weighted model under the alias's name."""
        data = [
            entry
            for served in self._models
            for entry in [*served.model.models_listing()["data"], *served.adapter_cards()]
        ]
        cards = {entry.get("id"): entry for entry in data}
        for alias, targets in self._aliases.items():
            card = cards.get(max(targets, key=lambda target: targets[target]))
            data.append({**(card or {"object": "model", "owned_by": "dpd-router"}), "id": alias})
        return {"object": "list", "data": data}


def shortened(text: str, limit: int = 200) -> str:
    """A client's string fit to be echoed in an error: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
