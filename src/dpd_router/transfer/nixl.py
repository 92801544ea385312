"""vLLM's NixlConnector protocol: a max_tokens=1 prefill, then the decoder pulls the blocks.

See PROTOCOLS.md section 2. The prefiller's `kv_transfer_params` are passed on verbatim:
rewriting `remote_host` breaks deployments whose side channel differs from the HTTP host.
"""

from __future__ import annotations

from typing import Any

import orjson

from dpd_router.errors import PrefillFailed
from dpd_router.request import ClientRequest
from dpd_router.transfer.base import SequentialConnector, StagedKV, one_token_body, prefill_usage

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(request: ClientRequest) -> dict[str, Any]:
    """The client's body turned into a KV-staging call: one token, not streamed, remote decode asked for."""
    body = one_token_body(request)
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


class NixlConnector(SequentialConnector):
    """Sequential prefill-then-decode over vLLM's NIXL KV transfer."""

    name = "nixl"

    def prefill_body(self, request: ClientRequest) -> dict[str, Any]:
        return prefill_body(request)

    def read_answer(self, payload: dict[str, Any]) -> StagedKV:
        return staged_from_answer(payload)

    def decode_body(self, request: ClientRequest, staged: StagedKV) -> bytes:
        return orjson.dumps(decode_body(request, staged.params))
