"""The contract every KV connector implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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
