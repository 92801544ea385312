"""The LoRA adapters each engine serves, from its `/v1/models`: vLLM lists an adapter with `parent` set to
its base model (loaded at startup by `--lora-modules`, or at runtime by `/v1/load_lora_adapter`, which
`AdapterLoader` calls for the adapters of the `lora_adapters` setting)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx
import orjson

from dpd_router.pool.endpoint import Endpoint, Role
from dpd_router.pool.pool import Pool
from dpd_router.pool.served_model import ServedModel
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.errors import UpstreamError

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


# Seconds a failed adapter load answers for the next loads of the same adapter and role in the same pool.
LOAD_RETRY_AFTER = 5.0


class AdapterLoader:
    """Loads the adapters of the `lora_adapters` setting (name -> path on the engines) where a request needs
    one: on the least busy healthy decoder when no healthy decoder lists it, and likewise on a prefiller, so
    both hops can run with it. One load at a time per pool, role and adapter: requests that need the same
    wait for it. A decoder that cannot load it fails the request (502, with the engine's words); a prefiller
    that cannot leaves the prefill hop out for it (decode alone), as for any adapter no prefiller lists. A
    failed load is not tried again for `LOAD_RETRY_AFTER` seconds: the requests meanwhile get its answer at
    once rather than each asking the engine again."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        paths: Mapping[str, str],
        metrics: RouterMetrics,
        *,
        model: ServedModel,
        timeout: float,
    ) -> None:
        self._client = client
        self._paths = dict(paths)
        self.names = frozenset(self._paths)  # the adapters it may load
        self._metrics = metrics
        self._model = model  # the base model, whose name may be learnt from the engines after startup
        self._timeout = timeout
        self._loading: dict[tuple[str, Role, str], asyncio.Future[None]] = {}
        # A failed load's error, and until when (monotonic) it stands for the next loads of the same.
        self._failed: dict[tuple[str, Role, str], tuple[float, UpstreamError]] = {}

    def card(self, name: str) -> dict[str, Any]:
        """The adapter as vLLM lists it once loaded."""
        path, parent = self._paths[name], self._model.name
        return {"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": parent}

    async def ensure(self, pool: Pool, adapter: str) -> None:
        """Each role of `pool` with a healthy engine has one that lists `adapter` (a no-op for an adapter this
        loader has no path for)."""
        if adapter not in self._paths:
            return
        roles: tuple[Role, ...] = ("decode", "prefill")
        for role in roles:
            healthy = pool.healthy(role)
            if not healthy or any(adapter in engine.adapters for engine in healthy):
                continue
            # One load per pool, role and adapter at a time: the requests that arrive meanwhile wait for it.
            key: tuple[str, Role, str] = (pool.name, role, adapter)
            try:
                failed = self._failed.get(key)
                if failed is not None and time.monotonic() < failed[0]:
                    raise failed[1]
                pending = self._loading.get(key)
                if pending is None:
                    engine = min(healthy, key=lambda endpoint: endpoint.in_flight)
                    pending = self._loading[key] = asyncio.ensure_future(self._call(engine, adapter, role))
                    pending.add_done_callback(functools.partial(self._loaded, key))
                await asyncio.shield(pending)
            except UpstreamError:
                if role == "decode":
                    raise
                # Its prefill hop is left out: the adapter's planner finds no prefiller listing it.

    def _loaded(self, key: tuple[str, Role, str], done: asyncio.Future[None]) -> None:
        self._loading.pop(key, None)
        error = None if done.cancelled() else done.exception()  # retrieved, whoever still waits for it
        if isinstance(error, UpstreamError):
            self._failed[key] = (time.monotonic() + LOAD_RETRY_AFTER, error)
        else:
            self._failed.pop(key, None)

    async def _call(self, engine: Endpoint, adapter: str, role: Role) -> None:
        body = {"lora_name": adapter, "lora_path": self._paths[adapter]}
        try:
            response = await self._client.post(f"{engine.url}/v1/load_lora_adapter", json=body, timeout=self._timeout)
        except httpx.HTTPError as exc:
            self._metrics.adapter_loads.labels(role, "failed").inc()
            log.warning("could not load LoRA adapter %s on %s: %s", adapter, engine.url, exc)
            raise UpstreamError(f"The LoRA adapter `{adapter}` could not be loaded: {type(exc).__name__}.") from None
        text = response.text
        # vLLM answers 400 for an adapter it has already: another router (or an operator) loaded it.
        if response.status_code == 200 or "already been loaded" in text:
            engine.adapters = {**engine.adapters, adapter: self.card(adapter)}
            self._metrics.adapter_loads.labels(role, "loaded").inc()
            log.info("loaded LoRA adapter %s on %s", adapter, engine.url)
            return
        self._metrics.adapter_loads.labels(role, "failed").inc()
        log.warning("could not load LoRA adapter %s on %s: %s %s", adapter, engine.url, response.status_code, text)
        raise UpstreamError(
            f"The LoRA adapter `{adapter}` could not be loaded on a {role} engine "
            f"(HTTP {response.status_code}): {_engine_message(text)}"
        )


def _engine_message(text: str) -> str:
    """The error message of an engine's answer (OpenAI-style JSON or text), shortened."""
    try:
        body = orjson.loads(text)
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    except (orjson.JSONDecodeError, AttributeError):
        message = None
    return (message if isinstance(message, str) else text)[:300]
