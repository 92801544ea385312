"""vLLM's ExampleConnector (shared storage): the prefiller writes the KV to a shared directory.

See PROTOCOLS.md section 6. The prefill hop is the client's request cut to one token and not
streamed; a 200 answer means the prefiller computed the prompt and saved its KV. The decoder then
receives the client's request unchanged and finds the KV on disk by the prompt's hash: no
`kv_transfer_params` travel in either direction.
"""

from __future__ import annotations

from typing import Any

import httpx

from dpd_router.errors import PrefillFailed
from dpd_router.pool.endpoint import Endpoint
from dpd_router.request import ClientRequest
from dpd_router.transfer.base import StagedKV, post_prefill, prefill_usage

_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params")


def prefill_body(request: ClientRequest) -> dict[str, Any]:
    """The client's body turned into a KV-saving call: one token, not streamed."""
    body = {key: value for key, value in request.body.items() if key not in _DROPPED_FOR_PREFILL}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    return body


def staged_from_answer(payload: Any) -> StagedKV:
    """Read the prefiller's answer: the KV is on disk; keep its token counts for usage."""
    if not isinstance(payload, dict):
        raise PrefillFailed("bad_answer", "the prefill answer is not a JSON object")
    prompt_tokens, cached_tokens = prefill_usage(payload)
    return StagedKV(params={}, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)


class SharedStorageConnector:
    """Sequential prefill-then-decode through a directory both engines mount."""

    name = "shared_storage"

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
        """The client's request as it came: the decoder looks the KV up by the prompt itself."""
        return request.encoded()
