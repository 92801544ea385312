"""The models a router serves, the first routing key: a request goes to the gateway of the model it names.

Each served model has its own gateway (its pools, tokenizer, planners, connector and learned deadlines);
nothing of one model's state decides for another's. A request naming no model goes to the first; one
naming a model the router does not serve gets vLLM's own 404 before any engine is asked.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpd_router.client_request import ClientRequest
from dpd_router.errors import ModelNotFound
from dpd_router.gateway.handler import Gateway
from dpd_router.pool.pool import Pool
from dpd_router.pool.served_model import ServedModel


@dataclass(frozen=True)
class ServingModel:
    """One served model: its name and context length, the gateway that serves it, and its pools by tenant."""

    model: ServedModel
    gateway: Gateway
    pools: Mapping[str | None, Pool]

    @property
    def name(self) -> str | None:
        return self.model.name


class Models:
    """The served models, in the order configured (the first serves requests that name none)."""

    def __init__(self, models: Sequence[ServingModel]) -> None:
        if not models:
            raise ValueError("a router serves at least one model")
        self._models = tuple(models)
        self.default = self._models[0]

    def __iter__(self) -> Iterator[ServingModel]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def named(self, name: str | None) -> ServingModel:
        """The model called `name` (None: the default); ModelNotFound, as vLLM words it, for any other.

        A lone model whose name is neither configured nor learnt yet takes every name: its engines judge it.
        """
        if name is None:
            return self.default
        for served in self._models:
            if served.model.name == name:
                return served
        if len(self._models) == 1 and self.default.model.name is None:
            return self.default
        raise ModelNotFound(f"The model `{shortened(name)}` does not exist.", param="model")

    def resolve(self, request: ClientRequest) -> ServingModel:
        """The model `request` names, filling in the default's name when it names none."""
        asked = request.body.get("model")
        served = self.named(asked if isinstance(asked, str) else None)
        if asked is None and served.model.name is not None:
            request.body["model"] = served.model.name
            request.body_changed = True
        return served

    def listing(self) -> dict[str, Any]:
        """`/v1/models`: every model, with the fields its engines list it with."""
        data = [entry for served in self._models for entry in served.model.models_listing()["data"]]
        return {"object": "list", "data": data}


def shortened(text: str, limit: int = 200) -> str:
    """A client's string fit to be echoed in an error: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
