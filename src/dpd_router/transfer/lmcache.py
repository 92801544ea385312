"""LMCache's disaggregated prefill (`LMCacheConnectorV1` with `enable_pd`): the prefiller pushes the KV.

See docs/connectors.md, "LMCache PD". The prefill hop is a `/v1/completions` call with the prompt as token
ids, one token, and a `disagg_spec` naming the decoder's LMCache receiver (its host, and one init
and one alloc port per decoder TP rank). The prefiller answers with the first token
(`kv_transfer_params.first_tok`) and, once the KV has landed in the decoder's buffer, each of its
workers pushes a msgpack `{"type": "ProxyNotif", "req_id": R}` to the router's ZMQ PULL socket.
Only then is the KV staged. The decoder gets a plain completion of `prompt + [first_tok]` for the
remaining tokens, and the client gets the first token at once, then the decoder's continuation in
the API it asked for (chat chunks are rebuilt from completion chunks).

The decoder's LMCache receive buffer never evicts: pushed KV leaves it only when a decode call
retrieves it, and a full buffer blocks every prefiller pushing to that decoder. So KV that no decode
call will pick up (the first token already ended the answer, the client left, the decoder could not
be reached) is drained: the decoder is asked for one token of the continuation, and the answer dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgpack
import orjson
import zmq
import zmq.asyncio

from dpd_router.errors import PrefillFailed
from dpd_router.pool.endpoint import Endpoint
from dpd_router.request import ClientRequest
from dpd_router.tasks import cancel_and_wait
from dpd_router.tokenizer import Prompt
from dpd_router.transfer import chat_chunks
from dpd_router.transfer.base import (
    DecodeCall,
    Handoff,
    StagedKV,
    new_transfer_id,
    post_prefill,
    prefill_usage,
)

log = logging.getLogger("dpd_router.lmcache")

COMPLETIONS_PATH = "/v1/completions"
# A ProxyNotif is a few dozen bytes; anything much larger is not one.
MAX_NOTIFICATION_BYTES = 64 * 1024

# The continuation cannot carry these: they change the first token's meaning (structured output,
# tool calls), need the prompt echoed, or ask for more than one sequence or for log-probabilities
# the prefiller's token would lack. Such requests are served by the decoder alone.
_UNSUPPORTED_FIELDS = (
    "tools",
    "functions",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "suffix",
    "best_of",
)
# The router renders the prompt to token ids itself, without these: a template of the request's own,
# special tokens, truncation, documents, multimodal inputs, a reasoning effort the template takes.
# Set to anything but their default, the engine would have rendered another prompt.
_PROMPT_FIELDS: dict[str, tuple[Any, ...]] = {
    "chat_template": (None,),
    "truncate_prompt_tokens": (None,),
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
    "reasoning_effort": (None,),
}
# What an engine's /tokenize is not told (the router sends it the messages alone): only a local
# tokenizer renders these as the engine's chat template would.
_TEMPLATE_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
}
# Chat-only fields a text completion does not take (the prompt is already rendered to token ids).
_CHAT_ONLY_FIELDS = (
    "messages",
    "max_completion_tokens",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
    "mm_processor_kwargs",
    "audio",
    "modalities",
)
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params")
_MIN_TOKENS_FIELDS = ("min_tokens", "min_completion_tokens")
# vLLM's default max_tokens for /v1/completions.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# A prefill answer's finish reasons that mean it failed, not that the answer is complete.
_FAILED_FINISH_REASONS = ("error", "abort")
# How long after a hand-off is given up (its client left, its notification was late) the router still
# listens for its ProxyNotif, to drain KV that lands after all.
LATE_NOTIFICATION_WINDOW = 60.0


@dataclass(frozen=True)
class Receiver:
    """A decoder's LMCache PD receiver: where the prefiller pushes the KV (one port pair per TP rank)."""

    host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]

    def spec(self, req_id: str) -> dict[str, Any]:
        return {
            "req_id": req_id,
            "receiver_host": self.host,
            "receiver_init_port": list(self.init_ports),
            "receiver_alloc_port": list(self.alloc_ports),
        }


class ReceiverMap:
    """Which receiver each decoder runs: a per-decoder entry, else the default ports on the decoder's host."""

    def __init__(
        self,
        init_ports: Sequence[int],
        alloc_ports: Sequence[int],
        overrides: Mapping[str, Receiver] | None = None,
    ) -> None:
        self._init_ports = tuple(init_ports)
        self._alloc_ports = tuple(alloc_ports)
        self._overrides = dict(overrides or {})

    def for_decoder(self, decoder: Endpoint) -> Receiver:
        override = self._overrides.get(decoder.url)
        if override is not None:
            return override
        host = urlsplit(decoder.url).hostname or "127.0.0.1"
        return Receiver(host, self._init_ports, self._alloc_ports)


class ProxyNotifications:
    """The router's end of LMCache's ProxyNotif channel: a ZMQ PULL socket the prefillers' workers push to.

    A hand-off registers its `req_id` before its prefill call is sent, so no notification can
    arrive unexpected; notifications for ids nobody waits for (late ones, after a timeout) are
    dropped. What is held is bounded by the prefill calls in flight.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._waiting: dict[str, _Expected] = {}
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.received = 0
        self.ignored = 0

    async def start(self) -> None:
        """Bind the PULL socket (raises zmq.ZMQError when the address is taken) and start receiving."""
        if self._context is not None:
            return
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.PULL)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_NOTIFICATION_BYTES)
        try:
            socket.bind(self.address)
        except zmq.ZMQError:
            socket.close(linger=0)
            self._context.term()
            self._context = None
            raise
        self._socket = socket
        self._task = asyncio.create_task(self._receive(), name="lmcache-notifications")
        log.info("waiting for LMCache ProxyNotif messages on %s", self.address)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None
        for expected in self._waiting.values():
            expected.landed.set()
        self._waiting.clear()

    def expect(self, req_id: str, count: int) -> None:
        """Wait for `count` notifications for `req_id` from now on."""
        self._waiting[req_id] = _Expected(count)

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)

    async def wait(self, req_id: str, within: float) -> bool:
        """Whether every expected notification for `req_id` arrived within `within` seconds."""
        expected = self._waiting.get(req_id)
        if expected is None:
            return False
        try:
            async with asyncio.timeout(within):
                await expected.landed.wait()
        except TimeoutError:
            return False
        return expected.seen >= expected.count

    def arrived(self, payload: bytes) -> None:
        """Count one message; anything but a ProxyNotif for an awaited id is ignored."""
        try:
            message = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.UnpackException):
            message = None
        req_id = message.get("req_id") if isinstance(message, dict) and message.get("type") == "ProxyNotif" else None
        expected = self._waiting.get(req_id) if isinstance(req_id, str) else None
        if expected is None:
            self.ignored += 1
            log.debug("ignored a message on the LMCache notification socket: %r", message)
            return
        self.received += 1
        expected.seen += 1
        if expected.seen >= expected.count:
            expected.landed.set()

    async def _receive(self) -> None:
        assert self._socket is not None
        try:
            while True:
                self.arrived(await self._socket.recv())
        except zmq.ZMQError as exc:
            log.error("the LMCache notification socket %s stopped: %s", self.address, exc)


class _Expected:
    __slots__ = ("count", "landed", "seen")

    def __init__(self, count: int) -> None:
        self.count = max(count, 1)
        self.seen = 0
        self.landed = asyncio.Event()


def unsupported(request: ClientRequest, *, local_tokenizer: bool = True) -> str | None:
    """Why LMCache's continuation cannot serve this request exactly (None: it can).

    `local_tokenizer`: whether the router renders chat prompts with the model's own tokenizer (else
    an engine's /tokenize, which is told the messages alone).
    """
    body = request.body
    if request.batch_size > 1:
        return "a batched prompt"
    n = body.get("n")
    if n not in (None, 1):
        return "n > 1"
    if requested_max_tokens(request) == 1:
        # The prefill's token is the whole answer: a decoder would never retrieve the pushed KV.
        return "a one-token answer"
    for name in _UNSUPPORTED_FIELDS:
        value = body.get(name)
        if value is None or value is False or _harmless(name, value, body):
            continue
        return f"the '{name}' field"
    return _prompt_differs(request, local_tokenizer)


def _prompt_differs(request: ClientRequest, local_tokenizer: bool) -> str | None:
    """Why the router's token ids may not be the prompt the engine would render (None: they are)."""
    body = request.body
    chat = request.kind == "chat"
    harmless = dict(_PROMPT_FIELDS)
    # vLLM adds special tokens to text prompts, not to a rendered chat template.
    harmless["add_special_tokens"] = (None, not chat)
    if chat and not local_tokenizer:
        harmless |= _TEMPLATE_FIELDS
    for name, defaults in harmless.items():
        if name in body and body[name] not in defaults:
            return f"the '{name}' field"
    if not chat:
        return None
    for message in body["messages"]:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
            return "content that is not text"
        if len(content) > 1 and local_tokenizer:
            return "content in several parts"  # the engine joins them with newlines, the tokenizer does not
    return None


def _harmless(name: str, value: Any, body: dict[str, Any]) -> bool:
    """A field set to what asking nothing would mean."""
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name == "tools":
        return body.get("tool_choice") == "none" or value == []
    return name == "best_of" and value == 1


def requested_max_tokens(request: ClientRequest) -> int | None:
    """The client's output limit (None: a chat request that takes the rest of the context)."""
    body = request.body
    for name in ("max_completion_tokens", "max_tokens") if request.kind == "chat" else ("max_tokens",):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None if request.kind == "chat" else COMPLETION_DEFAULT_MAX_TOKENS


def _completion_fields(request: ClientRequest) -> dict[str, Any]:
    """The client's body as a text completion's fields: chat-only fields dropped."""
    return {key: value for key, value in request.body.items() if key not in _CHAT_ONLY_FIELDS}


def prefill_body(request: ClientRequest, prompt: Prompt, spec: dict[str, Any]) -> dict[str, Any]:
    """The prefill call: the prompt's token ids, one unstreamed token, and where to push the KV.

    A client's minimum length of at least one token becomes one here: the first token may not end
    the answer (an end-of-sequence token or a stop), as it could not on an engine serving it alone.
    """
    body = {key: value for key, value in _completion_fields(request).items() if key not in _DROPPED_FOR_PREFILL}
    body.update(
        prompt=list(prompt.token_ids),
        max_tokens=1,
        stream=False,
        kv_transfer_params={"ret_first_tok": True, "disagg_spec": spec},
    )
    if requested_min_tokens(request) >= 1:
        body["min_tokens"] = 1
    return body


def requested_min_tokens(request: ClientRequest) -> int:
    """The client's minimum output length (0: none)."""
    for name in _MIN_TOKENS_FIELDS:
        value = request.body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def decode_body(request: ClientRequest, prompt: Prompt, first_token: int) -> dict[str, Any]:
    """The decode call: a plain completion of the prompt and the first token, for the tokens left."""
    body = {key: value for key, value in _completion_fields(request).items() if key != "kv_transfer_params"}
    wanted = requested_max_tokens(request)
    body.update(prompt=[*prompt.token_ids, first_token], max_tokens=None if wanted is None else wanted - 1)
    for name in _MIN_TOKENS_FIELDS:
        body.pop(name, None)
    minimum = requested_min_tokens(request)
    if minimum > 1:
        body["min_tokens"] = minimum - 1  # the prefiller's token was the first of them
    return body


def drain_body(request: ClientRequest, prompt: Prompt, first_token: int) -> dict[str, Any]:
    """A one-token continuation whose answer nobody reads: it makes the decoder retrieve (and so
    free) the KV pushed for `prompt`."""
    body: dict[str, Any] = {"prompt": [*prompt.token_ids, first_token], "max_tokens": 1, "stream": False}
    if request.body.get("model") is not None:
        body["model"] = request.body["model"]
    return body


@dataclass(frozen=True)
class FirstToken:
    """The prefiller's one token, as its answer gave it."""

    token_id: int
    text: str
    finish_reason: str | None
    response_id: str
    created: int
    model: str
    # What stopped it, when it stopped on its own (a stop token's id or a stop string).
    stop_reason: int | str | None = None

    @classmethod
    def from_answer(cls, payload: dict[str, Any]) -> FirstToken:
        """The first token of a prefill answer; PrefillFailed when it has none or the engine failed it."""
        choices = payload.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        finish_reason = choice.get("finish_reason")
        if finish_reason in _FAILED_FINISH_REASONS:
            raise PrefillFailed("in_band_error", f"the prefill ended with finish_reason={finish_reason}")
        params = payload.get("kv_transfer_params")
        token_id = params.get("first_tok") if isinstance(params, dict) else None
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise PrefillFailed("bad_answer", "the prefill answer carries no kv_transfer_params.first_tok")
        created = payload.get("created")
        stop_reason = choice.get("stop_reason")
        return cls(
            token_id=token_id,
            text=str(choice.get("text") or ""),
            finish_reason=finish_reason,
            response_id=str(payload.get("id") or "cmpl-lmcache"),
            created=created if isinstance(created, int) else int(time.time()),
            model=str(payload.get("model") or ""),
            stop_reason=stop_reason if isinstance(stop_reason, int | str) else None,
        )

    @property
    def ends_the_answer(self) -> bool:
        """The prefiller stopped on its own (an end-of-sequence token or a stop string)."""
        return self.finish_reason not in (None, "length")


class Continuation:
    """The decoder continues after the prefiller's first token: that token goes first (early, when
    streamed), counts as output, and the answer is given back in the client's own API.

    The decoder's usage counts the first token as prompt: the client's prompt is one shorter and
    its output one longer.
    """

    def __init__(self, kind: str, first: FirstToken) -> None:
        self._chat = kind == "chat"
        self._first = first
        self._response_id = chat_chunks.chat_id(first.response_id) if self._chat else first.response_id

    def head(self) -> bytes:
        first = self._first
        if self._chat:
            events = [
                chat_chunks.role_chunk(response_id=self._response_id, created=first.created, model=first.model),
                chat_chunks.chat_chunk(
                    response_id=self._response_id,
                    created=first.created,
                    model=first.model,
                    delta={"content": first.text},
                ),
            ]
        else:
            choice = {"index": 0, "text": first.text, "logprobs": None, "finish_reason": None, "stop_reason": None}
            events = [
                {
                    "id": self._response_id,
                    "object": "text_completion",
                    "created": first.created,
                    "model": first.model,
                    "choices": [choice],
                }
            ]
        return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)

    def chunk(self, payload: dict[str, Any]) -> dict[str, Any]:
        if "error" in payload:
            return payload
        _count_first_token(payload)
        self._as_one_answer(payload)
        return chat_chunks.chunk_to_chat(payload) if self._chat else payload

    def body(self, payload: dict[str, Any]) -> dict[str, Any]:
        if "error" in payload:
            return payload
        _count_first_token(payload)
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                choice["text"] = self._first.text + str(choice.get("text") or "")
        self._as_one_answer(payload)
        return chat_chunks.body_to_chat(payload) if self._chat else payload

    def _as_one_answer(self, payload: dict[str, Any]) -> None:
        """The id and creation time of the head: the client sees one answer, not two engines'."""
        payload["id"] = self._response_id
        payload["created"] = self._first.created


def _count_first_token(payload: dict[str, Any]) -> None:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        usage["prompt_tokens"] -= 1
    if isinstance(usage.get("completion_tokens"), int):
        usage["completion_tokens"] += 1


def answered_by_prefill(request: ClientRequest, prompt_tokens: int, first: FirstToken) -> bytes:
    """What a decoder would answer with no token left to generate, in its (text completion) format.

    The Continuation then adds the first token: a prefill whose first token ended the answer needs
    no decoder (its pushed KV is drained).
    """
    finish_reason = first.finish_reason or "length"
    choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
    choice["stop_reason"] = first.stop_reason
    usage = {"prompt_tokens": prompt_tokens + 1, "completion_tokens": 0, "total_tokens": prompt_tokens + 1}
    head = {"id": first.response_id, "object": "text_completion", "created": first.created, "model": first.model}
    if not request.stream:
        return orjson.dumps({**head, "choices": [choice], "usage": usage})
    events = [{**head, "choices": [choice]}]
    options = request.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        events.append({**head, "choices": [], "usage": usage})
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"


class LMCacheConnector:
    """Sequential prefill-then-decode over LMCache's PD push, with the first token sent early.

    Pushed KV that no decode call will retrieve is drained in the background (`release_unused`, and
    a hand-off given up after its prefill answered); `close()` cancels the drains still running.
    """

    name = "lmcache"
    concurrent = False
    batches = False
    serves_direct = True
    # The KV lands in the chosen decoder's buffer: it serves that decoder only.
    pushes_to_decoder = True
    holds_kv = True

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        timeout: httpx.Timeout,
        receivers: ReceiverMap,
        notifications: ProxyNotifications,
        notify_timeout: float,
        notify_count: int | None = None,
        local_tokenizer: bool = True,
        late_notification_window: float = LATE_NOTIFICATION_WINDOW,
    ) -> None:
        self._client = client
        self._timeout = timeout
        self._receivers = receivers
        self.notifications = notifications
        self._notify_timeout = notify_timeout
        self._notify_count = notify_count
        self._local_tokenizer = local_tokenizer
        self._late_window = late_notification_window
        self._drains: set[asyncio.Task[None]] = set()
        self.drained = 0

    async def start(self) -> None:
        await self.notifications.start()

    async def close(self) -> None:
        drains, self._drains = set(self._drains), set()
        for task in drains:
            task.cancel()
        if drains:
            await asyncio.wait(drains)
        await self.notifications.close()

    def unsupported(self, request: ClientRequest) -> str | None:
        return unsupported(request, local_tokenizer=self._local_tokenizer)

    def handoff(
        self, request: ClientRequest, prompt: Prompt, prefiller: Endpoint, decoder: Endpoint, request_id: str
    ) -> Handoff:
        receiver = self._receivers.for_decoder(decoder)
        req_id = f"{request_id}-{new_transfer_id()[:12]}"
        return Handoff(request, prompt, prefiller, decoder, request_id, transfer={"disagg_spec": receiver.spec(req_id)})

    def expected_notifications(self, handoff: Handoff) -> int:
        return self._notify_count or len(handoff.transfer["disagg_spec"]["receiver_init_port"]) or 1

    async def stage(self, handoff: Handoff) -> StagedKV:
        """The prefill call, then its ProxyNotifs. A hand-off given up once the prefiller answered
        (its client left, the notifications were late) may still land: it is drained if it does."""
        spec = handoff.transfer["disagg_spec"]
        req_id = spec["req_id"]
        self.notifications.expect(req_id, self.expected_notifications(handoff))
        first: FirstToken | None = None
        landed = False
        try:
            payload = await post_prefill(
                self._client,
                handoff.prefiller,
                COMPLETIONS_PATH,
                prefill_body(handoff.request, handoff.prompt, spec),
                request_id=handoff.request_id,
                limits=self._timeout,
            )
            first = FirstToken.from_answer(payload)
            landed = await self.notifications.wait(req_id, self._notify_timeout)
        finally:
            if first is not None and not landed:
                self._drain_if_it_lands(handoff, first, req_id)  # it forgets the id when done
            else:
                self.notifications.forget(req_id)
        if not landed:
            raise PrefillFailed(
                "no_notification",
                f"{handoff.prefiller.url} answered, but the KV did not reach {spec['receiver_host']} "
                f"(no ProxyNotif for {req_id} within {self._notify_timeout:g} s)",
            )
        prompt_tokens, cached_tokens = prefill_usage(payload)
        return StagedKV(
            params={"first_tok": first.token_id},
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            answer=payload,
        )

    def decode_call(self, handoff: Handoff, staged: StagedKV) -> DecodeCall:
        first = FirstToken.from_answer(staged.answer or {})
        request = handoff.request
        answer = Continuation(request.kind, first)
        wanted = requested_max_tokens(request)
        if first.ends_the_answer or (wanted is not None and wanted <= 1):
            # No decoder call: the gateway releases the pushed KV when the request ends.
            prompt_tokens = staged.prompt_tokens if staged.prompt_tokens is not None else handoff.prompt.num_tokens
            answered = answered_by_prefill(request, prompt_tokens, first)
            return DecodeCall(COMPLETIONS_PATH, b"", answer, answered=answered)
        body = decode_body(request, handoff.prompt, first.token_id)
        return DecodeCall(COMPLETIONS_PATH, orjson.dumps(body), answer)

    def release_unused(self, staged: StagedKV) -> None:
        """Drain the KV `staged` left in its decoder's buffer, in the background."""
        handoff = staged.handoff
        if handoff is None or staged.answer is None:
            return
        first = staged.params.get("first_tok")
        if isinstance(first, int):
            self._track(self._drain(handoff, first), handoff)

    def _drain_if_it_lands(self, handoff: Handoff, first: FirstToken, req_id: str) -> None:
        self._track(self._drain_once_landed(handoff, first.token_id, req_id), handoff)

    def _track(self, work: Coroutine[Any, Any, None], handoff: Handoff) -> None:
        task = asyncio.create_task(work, name=f"lmcache-drain {handoff.request_id}")
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain_once_landed(self, handoff: Handoff, first_token: int, req_id: str) -> None:
        try:
            landed = await self.notifications.wait(req_id, self._late_window)
        finally:
            self.notifications.forget(req_id)
        if landed:
            log.info("the KV of %s reached %s after its hand-off was given up", req_id, handoff.decoder.url)
            await self._drain(handoff, first_token)

    async def _drain(self, handoff: Handoff, first_token: int) -> None:
        """Ask the decoder for one token of the continuation: LMCache frees pushed KV only when a
        decode call retrieves it. The answer is dropped; a failure is logged."""
        decoder = handoff.decoder
        body = orjson.dumps(drain_body(handoff.request, handoff.prompt, first_token))
        headers = {"X-Request-Id": f"{handoff.request_id}-drain", "Content-Type": "application/json"}
        try:
            response = await self._client.post(
                f"{decoder.url}{COMPLETIONS_PATH}", content=body, headers=headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            log.warning(
                "request %s: could not drain the KV pushed to %s (%s: %s); it stays in that decoder's LMCache buffer",
                handoff.request_id,
                decoder.url,
                type(exc).__name__,
                exc,
            )
            return
        if response.status_code != 200:
            log.warning(
                "request %s: draining the KV pushed to %s got status %d: %s",
                handoff.request_id,
                decoder.url,
                response.status_code,
                response.text[:300],
            )
            return
        self.drained += 1
        log.debug("request %s: drained the KV pushed to %s", handoff.request_id, decoder.url)
