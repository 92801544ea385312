"""vLLM's NixlConnector protocol: a max_tokens=1 prefill, then the decoder pulls the blocks.

See PROTOCOLS.md section 2. The prefiller's `kv_transfer_params` are passed on verbatim:
rewriting `remote_host` breaks deployments whose side channel differs from the HTTP host.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from dpd_router.errors import PrefillFailed
from dpd_router.pool.endpoint import Endpoint
from dpd_router.request import ClientRequest
from dpd_router.transfer.base import StagedKV

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(request: ClientRequest) -> dict[str, Any]:
    """The client's body turned into a KV-staging call: one token, not streamed."""
    body = {key: value for key, value in request.body.items() if key not in _DROPPED_FOR_PREFILL}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return body


def decode_body(request: ClientRequest, params: dict[str, Any]) -> dict[str, Any]:
    """The client's original body plus the prefiller's transfer parameters."""
    return {**request.body, "kv_transfer_params": params}


def staged_from_answer(payload: Any) -> StagedKV:
    """Read the prefiller's answer; raise PrefillFailed when it staged nothing."""
    if not isinstance(payload, dict):
        raise PrefillFailed("bad_answer", "the prefill answer is not a JSON object")
    params = payload.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        raise PrefillFailed("no_kv_params", "the prefill answer carries no kv_transfer_params")
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    prompt_tokens = usage.get("prompt_tokens")
    return StagedKV(
        params=params,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


class NixlConnector:
    """Sequential prefill-then-decode over vLLM's NIXL KV transfer."""

    name = "nixl"

    def __init__(self, client: httpx.AsyncClient, *, timeout: httpx.Timeout, path_for: dict[str, str]):
        self._client = client
        self._timeout = timeout
        self._path_for = path_for

    async def prefill(self, request: ClientRequest, prefiller: Endpoint, request_id: str) -> StagedKV:
        url = f"{prefiller.url}{self._path_for[request.kind]}"
        body = orjson.dumps(prefill_body(request))
        try:
            response = await self._client.post(
                url,
                content=body,
                headers={"X-Request-Id": request_id, "Content-Type": "application/json"},
                timeout=self._timeout,
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
        return staged_from_answer(payload)

    def decode_body(self, request: ClientRequest, staged: StagedKV) -> bytes:
        return orjson.dumps(decode_body(request, staged.params))
