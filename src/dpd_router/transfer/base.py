"""The contract every KV connector implements."""

from __future__ import annotations

import asyncio
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson

from dpd_router.messages import api as messages_api
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineCalls
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import PrefillFailed
from dpd_router.responses import api as responses_api

ENGINE_PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}


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
    # The prefiller's whole answer, for connectors whose decoder continues from its first token.
    answer: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    # Concurrent connectors: the prefill call, still running beside the decode call. It resolves to
    # the prefiller's own StagedKV (its token counts), or raises PrefillFailed.
    pending: asyncio.Task[StagedKV] | None = field(default=None, compare=False, repr=False)
    # The hand-off this KV belongs to (set by the gateway; the decode call may need its ids).
    handoff: Handoff | None = field(default=None, compare=False, repr=False)
    # The prompt's token ids as the prefiller counted them (vLLM's `return_token_ids`), when its answer had them.
    prompt_ids: list[int] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Handoff:
    """One attempt to move a prompt's KV from a prefiller to a decoder, and the ids it goes by.

    `transfer` holds what the connector decided for this attempt before any call was made (LMCache's
    notification id, SGLang's bootstrap rooms); a retried prefill is a new hand-off with new ids.
    """

    request: ClientRequest
    prompt: Prompt
    prefiller: Endpoint
    decoder: Endpoint
    request_id: str
    transfer: dict[str, Any] = field(default_factory=dict)


class AnswerRewrite(Protocol):
    """Turns a decoder's answer into the one the client asked for (LMCache: a continuation in another API)."""

    def head(self) -> bytes:
        """SSE events the client gets before the decoder's, as soon as the KV is staged (may be empty)."""
        ...

    def chunk(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One event of the decoder's stream, rewritten."""
        ...

    def body(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The decoder's whole (non-streamed) answer, rewritten."""
        ...


@dataclass(frozen=True)
class DecodeCall:
    """What goes to the decoder, and how its answer reaches the client.

    `answer` rewrites the decoder's answer (None: relayed as it is). `answered` is set when the
    prefill already produced the whole answer (a one-token request): the router relays these bytes,
    in the decoder's format, instead of calling a decoder at all.
    """

    path: str
    body: bytes
    answer: AnswerRewrite | None = None
    answered: bytes | None = None

    @classmethod
    def unchanged(cls, request: ClientRequest) -> DecodeCall:
        """The client's request as it came, to the engine path of its kind."""
        return cls(ENGINE_PATHS[request.kind], request.encoded())

    @property
    def head(self) -> bytes:
        return self.answer.head() if self.answer is not None else b""


class Connector(Protocol):
    """Runs the prefill hop and shapes the decode call for one KV-transfer protocol.

    The gateway plans a `handoff()` (no I/O), runs `stage()` as the prefill hop and sends the
    decoder `decode_call()`. A sequential connector's decode call starts once `stage()` returned
    (NIXL, shared storage, LMCache). A `concurrent` one's starts with it (SGLang's bootstrap):
    `stage()` runs beside the decode call and only has to succeed before the decoder's first token.
    """

    name: str
    concurrent: bool
    # Whether a batched prompt (a list of prompts in /v1/completions) can be disaggregated.
    batches: bool
    # Whether a decoder can serve a request without a prefill hop (SGLang's decode-mode servers cannot:
    # every request is disaggregated, and one that no prefiller can take is refused).
    serves_direct: bool
    # Whether the prefill pushes the KV into the chosen decoder (LMCache): then the staged KV serves
    # that decoder only, and stays in its buffer until a decode call there picks it up.
    pushes_to_decoder: bool
    # Whether staged KV is held (on the prefiller, or pushed into a decoder) until a decode call picks
    # it up: the gateway then has `release_unused` free what no decode call will (NIXL, LMCache).
    holds_kv: bool

    async def start(self) -> None:
        """Open what the connector listens on (LMCache's notification socket)."""
        ...

    async def close(self) -> None:
        """Close what start() opened, and stop background work (LMCache's drains)."""
        ...

    def unsupported(self, request: ClientRequest) -> str | None:
        """Why this connector cannot disaggregate `request` (None: it can)."""
        ...

    def handoff(
        self, request: ClientRequest, prompt: Prompt, prefiller: Endpoint, decoder: Endpoint, request_id: str
    ) -> Handoff:
        """Decide the ids of one hand-off."""
        ...

    async def stage(self, handoff: Handoff) -> StagedKV:
        """The prefill call; raise PrefillFailed when it did not stage the KV."""
        ...

    def decode_call(self, handoff: Handoff, staged: StagedKV) -> DecodeCall:
        """What the decoder receives to pick up `staged`."""
        ...

    def release_unused(self, staged: StagedKV, *, after: float = 0.0) -> None:
        """No decode call will pick up `staged`: free what it holds, in the background, `after` seconds from
        now (LMCache drains the KV pushed to `staged.handoff.decoder`; NIXL has a decoder free the
        prefiller's blocks)."""
        ...


def hop_limits(timeout: httpx.Timeout) -> httpx.Timeout:
    """A prefill call's own limits: its connect timeout alone. The prefill hop (gateway/prefill.py) bounds the
    whole call, by the live `prefill_timeout` and the call's watch; a read limit of its own inside that, fixed
    when the connector was built, cost every call a timer and capped a `prefill_timeout` raised while serving
    at its startup value. A connector's other calls (a release, a drain) keep their whole limits."""
    return httpx.Timeout(None, connect=timeout.connect)


async def post_prefill(
    engines: EngineCalls,
    prefiller: Endpoint,
    path: str,
    body: dict[str, Any],
    *,
    request_id: str,
    limits: httpx.Timeout,
) -> dict[str, Any]:
    """Send a prefill call and return its JSON answer; every way it can fail becomes PrefillFailed."""
    content = await send_prefill(engines, prefiller, path, orjson.dumps(body), request_id=request_id, limits=limits)
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        raise PrefillFailed("bad_answer", f"{prefiller.url} answered with invalid JSON") from None
    if not isinstance(payload, dict):
        raise PrefillFailed("bad_answer", "the prefill answer is not a JSON object")
    return payload


async def send_prefill(
    engines: EngineCalls,
    prefiller: Endpoint,
    path: str,
    content: bytes,
    *,
    request_id: str,
    limits: httpx.Timeout,
) -> bytes:
    """Send a prefill call and read its answer; a failed call or a status other than 200 is PrefillFailed."""
    headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
    try:
        response = await engines.whole(f"{prefiller.url}{path}", content, headers, limits=limits)
    except httpx.TimeoutException as exc:
        raise PrefillFailed("timeout", f"{prefiller.url}: {type(exc).__name__}") from None
    except httpx.HTTPError as exc:
        raise PrefillFailed("connect_error", f"{prefiller.url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        reason = "status_5xx" if response.status_code >= 500 else "status_4xx"
        raise PrefillFailed(reason, f"{prefiller.url} answered {response.status_code}: {response.text[:300]}")
    return response.content


def prefill_usage(payload: dict[str, Any]) -> tuple[int | None, int]:
    """(prompt tokens, the prefiller's cached prompt tokens) from a prefill answer's usage (OpenAI's chat and
    completions', the Responses API's or the Messages API's)."""
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    if "input_tokens_details" in usage:  # the Responses API's: input_tokens count the whole prompt
        prompt, cached, _ = responses_api.usage_counts(usage)
        return prompt, cached or 0
    if "input_tokens" in usage:  # the Messages API's: input_tokens count what was not read from a cache
        prompt, cached, _ = messages_api.usage_counts(usage)
        return prompt, cached or 0
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = {}
    prompt_tokens = usage.get("prompt_tokens")
    return (prompt_tokens if isinstance(prompt_tokens, int) else None), int(details.get("cached_tokens") or 0)


def prefill_prompt_ids(payload: dict[str, Any], prompt_tokens: int | None) -> list[int] | None:
    """The prompt's ids in a prefill answer asked for them (a chat answer has them at its top, a text
    completion's in its choice), when they are ids and as many as its usage counted; else None."""
    ids = payload.get("prompt_token_ids")
    if ids is None:
        choices = payload.get("choices")
        if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
    if not isinstance(ids, list) or not ids or len(ids) != prompt_tokens:
        return None
    try:
        array("q", ids)  # ids are integers: checked at C speed (tens of thousands of them)
    except (TypeError, OverflowError):
        return None
    return ids


def staged_from_prefill(payload: dict[str, Any], params: dict[str, Any]) -> StagedKV:
    """The KV a one-token prefill answer staged: `params` for the decoder, the answer's usage, and the
    prompt's ids where it carries them."""
    prompt_tokens, cached_tokens = prefill_usage(payload)
    return StagedKV(
        params=params,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        prompt_ids=prefill_prompt_ids(payload, prompt_tokens),
    )


# The prefill answer is not the client's (a sequential connector's): whether it brings the prompt's ids is the
# router's choice (`one_token_body`), whatever the client (or a stream's continuation) asked of the decoder.
_DROPPED_FOR_PREFILL = (
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
    "kv_transfer_params",
    "return_token_ids",
)


def one_token_body(request: ClientRequest, *, ids: bool = True) -> dict[str, Any]:
    """The client's body cut to a prefill: one token, not streamed, no minimum length; `ids`: the answer
    brings the prompt's ids (where the API has them)."""
    body = {key: value for key, value in request.body.items() if key not in _DROPPED_FOR_PREFILL}
    body["stream"] = False
    if request.kind == "responses":
        body["max_output_tokens"] = 1
        return body  # vLLM's Responses answer has no prompt ids to ask for
    body["max_tokens"] = 1
    if request.kind == "messages":
        return body  # nor has its Messages answer
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    # Where the router wants the whole prompt's ids (Prompt.wants_ids: a cache-aware threshold's prefix index
    # holds every block), the answer brings them: indexed by the prefiller's own encoding instead of encoding
    # the prompt whole here. Otherwise it is not asked for thousands of ids nobody reads (the count comes from
    # the usage). The decode call is the client's body; a stream's asks for its ids to be continued elsewhere
    # if its decoder fails (gateway/resume.py).
    if ids:
        body["return_token_ids"] = True
    return body


class SequentialConnector:
    """A prefill call that must finish before the decode call starts (NIXL, shared storage).

    Subclasses say how the prefill body looks (`prefill_body`) and what its answer staged
    (`read_answer`); the call itself, and its failures, are the same for all of them.
    """

    name = "sequential"
    concurrent = False
    batches = False
    serves_direct = True
    pushes_to_decoder = False
    holds_kv = False

    def __init__(self, engines: EngineCalls, *, timeout: httpx.Timeout, path_for: dict[str, str]):
        self._engines = engines
        self._timeout = timeout
        self._hop_limits = hop_limits(timeout)
        self._path_for = path_for

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def unsupported(self, request: ClientRequest) -> str | None:
        return None

    def release_unused(self, staged: StagedKV, *, after: float = 0.0) -> None:
        pass  # nothing is held for a decoder (shared storage: the files stay for any engine)

    def handoff(
        self, request: ClientRequest, prompt: Prompt, prefiller: Endpoint, decoder: Endpoint, request_id: str
    ) -> Handoff:
        return Handoff(request, prompt, prefiller, decoder, request_id)

    async def stage(self, handoff: Handoff) -> StagedKV:
        return await self.prefill(handoff.request, handoff.prefiller, handoff.request_id, ids=handoff.prompt.wants_ids)

    def decode_call(self, handoff: Handoff, staged: StagedKV) -> DecodeCall:
        return DecodeCall(self._path_for[handoff.request.kind], self.decode_body(handoff.request, staged))

    def decode_body(self, request: ClientRequest, staged: StagedKV) -> bytes:
        """The body the decoder receives to pick up `staged`."""
        raise NotImplementedError

    def prefill_body(self, request: ClientRequest, *, ids: bool = True) -> dict[str, Any]:
        """The prefill call's body; `ids`: its answer brings the prompt's ids."""
        raise NotImplementedError

    def read_answer(self, payload: dict[str, Any]) -> StagedKV:
        raise NotImplementedError

    async def prefill(
        self, request: ClientRequest, prefiller: Endpoint, request_id: str, *, ids: bool = True
    ) -> StagedKV:
        payload = await post_prefill(
            self._engines,
            prefiller,
            self._path_for[request.kind],
            self.prefill_body(request, ids=ids),
            request_id=request_id,
            limits=self._hop_limits,
        )
        return self.read_answer(payload)


def new_transfer_id() -> str:
    """A fresh id for one hand-off (never the client's request id: a retry must not match a late
    message of the attempt before it)."""
    return uuid.uuid4().hex
