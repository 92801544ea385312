"""vLLM's ExampleConnector (shared storage): the prefiller writes the KV to a shared directory.

See docs/connectors.md, "Shared storage". The prefill hop is the client's request cut to one token and not
streamed; a 200 answer means the prefiller computed the prompt and saved its KV. The decoder then
receives the client's request unchanged and finds the KV on disk by the prompt's hash: no
`kv_transfer_params` travel in either direction.
"""

from __future__ import annotations

from typing import Any

from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import PrefillFailed
from dpd_router.transfer.base import SequentialConnector, StagedKV, one_token_body, staged_from_prefill


def prefill_body(request: ClientRequest, *, ids: bool = True) -> dict[str, Any]:
    """The client's body turned into a KV-saving call: one token, not streamed; `ids`: the prompt's ids asked
    for too."""
    return one_token_body(request, ids=ids)


def staged_from_answer(payload: Any) -> StagedKV:
    """Read the prefiller's answer: the KV is on disk; keep its token counts for usage."""
    if not isinstance(payload, dict):
        raise PrefillFailed("bad_answer", "the prefill answer is not a JSON object")
    return staged_from_prefill(payload, {})


class SharedStorageConnector(SequentialConnector):
    """Sequential prefill-then-decode through a directory both engines mount."""

    name = "shared_storage"

    def prefill_body(self, request: ClientRequest, *, ids: bool = True) -> dict[str, Any]:
        return prefill_body(request, ids=ids)

    def read_answer(self, payload: dict[str, Any]) -> StagedKV:
        return staged_from_answer(payload)

    def decode_body(self, request: ClientRequest, staged: StagedKV) -> bytes:
        """The client's request as it came: the decoder looks the KV up by the prompt itself."""
        return request.encoded()
