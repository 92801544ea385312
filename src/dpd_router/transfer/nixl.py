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
from dpd_router.transfer.base import StagedKV, post_prefill, prefill_usage

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
    prompt_tokens, cached_tokens = prefill_usage(payload)
    return StagedKV(params=params, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)


class NixlConnector:
    """Sequential prefill-then-decode over vLLM's NIXL KV transfer."""

    name = "nixl"

    def __init__(self, client: httpx.AsyncClient, *, timeout: httpx.Timeout, path_for: dict[str, str]):
        self._client = client
        self._timeout = timeout
        self._path_for = path_for

    async def prefill(self, request: ClientRequest, prefiller: Endpoint, request_id: str) -> StagedKV:
        payload = await post_prefill(
            self._client,
            prefiller,
            self._path_for[request.kind],
            prefill_body(request),
            request_id=request_id,
            limits=self._timeout,
        )
        return staged_from_answer(payload)

    def decode_body(self, request: ClientRequest, staged: StagedKV) -> bytes:
        return orjson.dumps(decode_body(request, staged.params))
