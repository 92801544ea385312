"""The LoRA adapters each engine serves, from its `/v1/models`: vLLM lists an adapter with `parent` set to
its base model (loaded at startup by `--lora-modules`, or at runtime by `/v1/load_lora_adapter`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import orjson

from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool

log = logging.getLogger("dpd_router.models")


async def learn_adapters(client: httpx.AsyncClient, pool: Pool, *, probe_timeout: float) -> None:
    """Ask every engine passing its probes for its models; each keeps the adapters it lists. An engine that
    does not answer keeps what it listed last (it is out of routing while its probes fail anyway)."""
    engines = [endpoint for endpoint in pool.endpoints() if endpoint.healthy]
    await asyncio.gather(*(_learn(client, endpoint, probe_timeout) for endpoint in engines))


async def _learn(client: httpx.AsyncClient, endpoint: Endpoint, probe_timeout: float) -> None:
    try:
        response = await client.get(f"{endpoint.url}/v1/models", timeout=probe_timeout)
        listing = orjson.loads(response.content) if response.status_code == 200 else None
    except (httpx.HTTPError, orjson.JSONDecodeError):
        return
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        return
    adapters = {
        card["id"]: card
        for card in cards
        if isinstance(card, dict) and isinstance(card.get("id"), str) and _is_adapter(card)
    }
    if adapters.keys() != endpoint.adapters.keys():
        log.info("%s serves the LoRA adapters %s", endpoint.url, sorted(adapters) or "(none)")
    endpoint.adapters = adapters


def _is_adapter(card: dict[str, Any]) -> bool:
    return card.get("parent") is not None
