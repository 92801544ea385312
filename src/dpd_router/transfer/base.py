"""The contract every KV connector implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import orjson

from dpd_router.errors import PrefillFailed
from dpd_router.pool.endpoint import Endpoint
from dpd_router.request import ClientRequest


@dataclass(frozen=True)
class StagedKV:
    """What the prefill hop left behind for the decoder to pick up.

    `params` go to the decoder verbatim; `cached_tokens` is the prefiller's own prefix-cache hit,
    which the client is told instead of the decoder's view (the decoder counts transferred
    tokens as cached).
    """

    params: dict[str, Any]
    prompt_tokens: int | None
    cached_tokens: int


class Connector(Protocol):
    """Runs the prefill hop and shapes the decode call for one KV-transfer protocol."""

    name: str

    async def prefill(self, request: ClientRequest, prefiller: Endpoint, request_id: str) -> StagedKV:
        """Stage the prompt's KV on `prefiller`; raise PrefillFailed when nothing was staged."""
        ...

    def decode_body(self, request: ClientRequest, staged: StagedKV) -> bytes:
        """The body the decoder receives to pick up `staged`."""
        ...


async def post_prefill(
    client: httpx.AsyncClient,
    prefiller: Endpoint,
    path: str,
    body: dict[str, Any],
    *,
    request_id: str,
    limits: httpx.Timeout,
) -> dict[str, Any]:
    """Send a prefill call and return its JSON answer; every way it can fail becomes PrefillFailed."""
    try:
        response = await client.post(
            f"{prefiller.url}{path}",
            content=orjson.dumps(body),
            headers={"X-Request-Id": request_id, "Content-Type": "application/json"},
            timeout=limits,
        )
    except httpx.TimeoutException as exc:
        raise PrefillFailed("timeout", f"{prefiller.url}: {type(exc).__name__}") from None
    except httpx.HTTPError as exc:
        raise PrefillFailed("connect_error", f"{prefiller.url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        reason = "status_5xx" if response.status_code >= 500 else "status_4xx"
        raise PrefillFailed(reason, f"{prefiller.url} answered {response.status_code}: {response.text[:300]}")
    try:
        payload = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        raise PrefillFailed("bad_answer", f"{prefiller.url} answered with invalid JSON") from None
    if not isinstance(payload, dict):
        raise PrefillFailed("bad_answer", "the prefill answer is not a JSON object")
    return payload


def prefill_usage(payload: dict[str, Any]) -> tuple[int | None, int]:
    """(prompt tokens, the prefiller's cached prompt tokens) from a prefill answer's usage."""
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    prompt_tokens = usage.get("prompt_tokens")
    return (prompt_tokens if isinstance(prompt_tokens, int) else None), int(details.get("cached_tokens") or 0)


_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params")


def one_token_body(request: ClientRequest) -> dict[str, Any]:
    """The client's body cut to a prefill: one token, not streamed, no minimum length."""
    body = {key: value for key, value in request.body.items() if key not in _DROPPED_FOR_PREFILL}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    return body


class SequentialConnector:
    """A prefill call that must finish before the decode call starts (NIXL, shared storage).

    Subclasses say how the prefill body looks (`prefill_body`) and what its answer staged
    (`read_answer`); the call itself, and its failures, are the same for all of them.
    """

    name = "sequential"

    def __init__(self, client: httpx.AsyncClient, *, timeout: httpx.Timeout, path_for: dict[str, str]):
        self._client = client
        self._timeout = timeout
        self._path_for = path_for

    def prefill_body(self, request: ClientRequest) -> dict[str, Any]:
        raise NotImplementedError

    def read_answer(self, payload: dict[str, Any]) -> StagedKV:
        raise NotImplementedError

    async def prefill(self, request: ClientRequest, prefiller: Endpoint, request_id: str) -> StagedKV:
        payload = await post_prefill(
            self._client,
            prefiller,
            self._path_for[request.kind],
            self.prefill_body(request),
            request_id=request_id,
            limits=self._timeout,
        )
        return self.read_answer(payload)
