"""The model the pool serves: its name and context length, from settings or the decoders."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson

from dpd_router.pool.pool import Pool

log = logging.getLogger("dpd_router.models")


class ServedModel:
    """The served model's name (configured, or learnt from a decoder's `/v1/models`)."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.configured = name is not None
        self.max_model_len: int | None = None
        self.listing: dict[str, Any] | None = None

    async def discover(self, client: httpx.AsyncClient, pool: Pool, *, probe_timeout: float) -> bool:
        """Ask the decoders for their model list; True once a decoder has answered."""
        for decoder in pool.decoders:
            try:
                response = await client.get(f"{decoder.url}/v1/models", timeout=probe_timeout)
                listing = orjson.loads(response.content) if response.status_code == 200 else None
            except (httpx.HTTPError, orjson.JSONDecodeError):
                continue
            if not isinstance(listing, dict):
                continue
            models = listing.get("data")
            if not models:
                continue
            self._learn(listing, models)
            return True
        return False

    def _learn(self, listing: dict[str, Any], models: list[dict[str, Any]]) -> None:
        # Not an adapter (vLLM lists those after the base model, with a `parent`).
        bases = [m for m in models if isinstance(m, dict) and m.get("parent") is None]
        entry = (
            next((m for m in bases if m.get("id") == self.name), None) if self.configured else next(iter(bases), None)
        )
        if entry is None:
            log.warning("the decoders serve %s, not the configured model %s", [m.get("id") for m in models], self.name)
            return
        if self.name is None:
            self.name = str(entry["id"])
            log.info("serving model %s (learnt from the decoders)", self.name)
        if isinstance(entry.get("max_model_len"), int):
            self.max_model_len = entry["max_model_len"]
        self.listing = {"object": "list", "data": [entry]}

    def models_listing(self) -> dict[str, Any]:
        if self.listing is not None:
            return self.listing
        data = [] if self.name is None else [{"id": self.name, "object": "model", "owned_by": "dpd-router"}]
        return {"object": "list", "data": data}
