"""SGLang's disaggregation: prefiller and decoder get the same request at once and meet in a bootstrap room.

See docs/connectors.md, "SGLang". Both engines receive the client's body plus `bootstrap_host` (the
prefiller's host), `bootstrap_port` (its bootstrap server, 8998 unless configured) and
`bootstrap_room` (a random 63-bit id; one per prompt of a batch, with a host and a port each).
The decoder registers with the prefiller's bootstrap server, receives the KV and streams the
answer, which is what the client gets; the prefill call's own answer is read and discarded. If
the prefill call fails before the decoder's first token, the gateway cancels the decode call and
treats it as a failed prefill hop. A decode-mode server cannot serve a request without a room, so
every request takes the prefill hop, and one that no prefiller can take is refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineCalls
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import PrefillFailed
from dpd_router.transfer.base import DecodeCall, Handoff, StagedKV, hop_limits, prefill_usage, send_prefill

DEFAULT_BOOTSTRAP_PORT = 8998
_ROOM_BITS = 63


def new_room() -> int:
    """A bootstrap room: random, non-negative, fits a signed 64-bit integer."""
    return secrets.randbits(_ROOM_BITS)


def bootstrap_fields(request: ClientRequest, host: str, port: int) -> dict[str, Any]:
    """The fields both engines get: scalars for one prompt, lists (one room each) for a batch."""
    size = request.batch_size
    if size == 1:
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": new_room()}
    return {
        "bootstrap_host": [host] * size,
        "bootstrap_port": [port] * size,
        "bootstrap_room": [new_room() for _ in range(size)],
    }


def engine_body(request: ClientRequest, fields: Mapping[str, Any]) -> bytes:
    """The client's body plus the bootstrap fields: what the prefiller and the decoder both receive."""
    return orjson.dumps({**request.body, **fields})


def read_answer(content: bytes, prefiller: Endpoint) -> StagedKV:
    """The prefill call's answer, streamed or whole: its token counts, or PrefillFailed for an in-band error."""
    payloads: list[Any] = []
    if content.lstrip().startswith(b"data:"):
        for event in content.split(b"\n\n"):
            event = event.strip()
            if not event.startswith(b"data:") or event == b"data: [DONE]":
                continue
            try:
                payloads.append(orjson.loads(event[len(b"data:") :]))
            except orjson.JSONDecodeError:
                raise PrefillFailed("bad_answer", f"{prefiller.url} streamed an event that is not JSON") from None
    else:
        try:
            payloads.append(orjson.loads(content))
        except orjson.JSONDecodeError:
            raise PrefillFailed("bad_answer", f"{prefiller.url} answered with invalid JSON") from None
    prompt_tokens: int | None = None
    cached_tokens = 0
    for payload in payloads:
        if not isinstance(payload, dict):
            raise PrefillFailed("bad_answer", "the prefill answer is not a JSON object")
        error = payload.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            raise PrefillFailed("in_band_error", f"{prefiller.url} failed the prefill: {message}")
        if any(isinstance(c, dict) and c.get("finish_reason") == "error" for c in payload.get("choices") or ()):
            raise PrefillFailed("in_band_error", f"{prefiller.url} ended the prefill with finish_reason=error")
        if isinstance(payload.get("usage"), dict):
            prompt_tokens, cached_tokens = prefill_usage(payload)
    return StagedKV(params={}, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)


class SGLangConnector:
    """Concurrent prefill and decode, rendezvous in a bootstrap room on the prefiller."""

    name = "sglang"
    concurrent = True
    batches = True
    # A decode-mode SGLang server aborts a request without bootstrap fields: nothing is served direct.
    serves_direct = False
    pushes_to_decoder = False
    holds_kv = False

    def __init__(
        self,
        engines: EngineCalls,
        *,
        timeout: httpx.Timeout,
        path_for: dict[str, str],
        bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
        bootstrap_ports: Mapping[str, int] | None = None,
    ) -> None:
        self._engines = engines
        self._hop_limits = hop_limits(timeout)
        self._path_for = path_for
        self._bootstrap_port = bootstrap_port
        self._bootstrap_ports = dict(bootstrap_ports or {})

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def unsupported(self, request: ClientRequest) -> str | None:
        # SGLang's servers read the bootstrap fields on their OpenAI endpoints only.
        return f"the {request.kind.capitalize()} API" if request.kind in ("messages", "responses") else None

    def bootstrap_port(self, prefiller: Endpoint) -> int:
        return self._bootstrap_ports.get(prefiller.url, self._bootstrap_port)

    def handoff(
        self, request: ClientRequest, prompt: Prompt, prefiller: Endpoint, decoder: Endpoint, request_id: str
    ) -> Handoff:
        host = urlsplit(prefiller.url).hostname or "127.0.0.1"
        fields = bootstrap_fields(request, host, self.bootstrap_port(prefiller))
        return Handoff(request, prompt, prefiller, decoder, request_id, transfer=fields)

    async def stage(self, handoff: Handoff) -> StagedKV:
        content = await send_prefill(
            self._engines,
            handoff.prefiller,
            self._path_for[handoff.request.kind],
            engine_body(handoff.request, handoff.transfer),
            request_id=handoff.request_id,
            limits=self._hop_limits,
        )
        return read_answer(content, handoff.prefiller)

    def decode_call(self, handoff: Handoff, staged: StagedKV) -> DecodeCall:
        return DecodeCall(self._path_for[handoff.request.kind], engine_body(handoff.request, handoff.transfer))

    def release_unused(self, staged: StagedKV, *, after: float = 0.0) -> None:
        pass  # the gateway cancels a prefill call still running; its room closes with it
