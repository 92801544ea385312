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
