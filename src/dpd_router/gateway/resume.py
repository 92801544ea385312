"""A stream whose decoder fails after the client saw output is continued on another decoder.

The router asks the decoder for the token ids it generates (vLLM's `return_token_ids`) and keeps them
as the stream passes, with the prompt's own ids (the first chunk's `prompt_token_ids`: the engine's
rendering, exact for any template), as bytes, cut out of the events before the client sees them (`null`
in their place, as vLLM writes them unasked).
When the decoder breaks (a reset connection, an in-band error, a stream cut short, the idle limit),
the continuation is a text completion of the prompt's ids and the generated ids, for the tokens left,
with the same sampling settings: it goes through the threshold like any prompt (a long one is
prefilled again and its KV transferred) and is served by another decoder. Its events are given back
in the client's API under the first answer's id, with usage counting the prompt once and every
output token. Greedy, the continued text is the one an uninterrupted decoder would have produced:
the continuation starts from the generated token ids, not from the text re-encoded.

A Messages or Responses stream (whose engine endpoints return no ids) is continued from its text through
the chat API instead (gateway/resume_text.py). What cannot be resumed faithfully is not tried (see
`why_not`): several choices, structured output (a grammar cannot be resumed mid-way), tools,
log-probabilities, an echoed prompt, an answer whose output was reasoning or a tool call (the engine's
parser would not see the start).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from dpd_router.gateway.answer import Answer, StreamedAnswer
from dpd_router.gateway.policy import PhaseTimeouts
from dpd_router.gateway.resume_text import (
    AnswerWriter,
    EventTape,
    MessagesAnswer,
    ResponsesAnswer,
    Said,
    chat_continuation,
    named_event,
    wanted_output,
)
from dpd_router.gateway.wires import OPENAI_WIRE, Wire, reconcile_usage
from dpd_router.pool.endpoint import Endpoint
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Ending, Output
from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import RouterError
from dpd_router.transfer import chat_chunks
from dpd_router.transfer.lmcache.bodies import CHAT_ONLY_FIELDS, requested_max_tokens, requested_min_tokens
from dpd_router.transfer.lmcache.compat import unsupported_field

log = logging.getLogger("dpd_router.gateway")

_EVENT_END = b"\n\n"
_DATA = b"data: "
_DONE = b"data: [DONE]"
_PROMPT_IDS = b'"prompt_token_ids":'
_OUTPUT_IDS = b'"token_ids":'
_FINISHED = b'"finish_reason":"'
_FAILED = b'"finish_reason":"error"'
# Output the engine's parsers made of the text: a continuation (a text completion) would not parse it.
_REASONING, _TOOL_CALLS = b'"reasoning', b'"tool_calls":['

# Chat-only fields a text completion does not take (the prompt is already token ids).
_CHAT_ONLY_FIELDS = frozenset(CHAT_ONLY_FIELDS) | {"min_completion_tokens", "add_special_tokens"}
# Continued from their text, through the chat API (gateway/resume_text.py): their engines return no ids.
_TEXT_APIS = ("messages", "responses")
_NOT_CARRIED = frozenset({"kv_transfer_params", "stream_options", "min_tokens", "max_tokens", "prompt"})

# Serves a continuation of a request's stream, away from the failed decoder, with so many continuations
# left: its answer, and where it is served (for the log line).
OpenContinuation = Callable[[ClientRequest, Endpoint | None, int], Awaitable[tuple[Answer, str]]]


def why_not(request: ClientRequest) -> str | None:
    """Why a stream of `request` cannot be continued faithfully (a metric label), None when it can."""
    if request.kind in _TEXT_APIS:
        if request.converted is None:
            return f"{request.kind}_api"
        text = request.body.get("text")
        form = text.get("format") if isinstance(text, dict) else None
        if isinstance(form, dict) and form.get("type") not in (None, "text"):
            return "structured_output"
    if request.batch_size > 1:
        return "batched_prompt"
    n = request.body.get("n")
    if n not in (None, 1):
        return "n"
    field = unsupported_field(request.body)
    if field is None:
        return None
    if field in ("response_format", "structured_outputs") or field.startswith("guided_"):
        return "structured_output"
    if field in ("tools", "functions"):
        return "tools"
    if field in ("logprobs", "top_logprobs", "prompt_logprobs"):
        return "logprobs"
    return field  # echo, suffix, best_of


@dataclass(frozen=True)
class ResumePolicy:
    """Whether this request's stream may be continued, and how often.

    `api`: the client's (a metric label). `blocked`: why not (None: it may). `left`: continuations left.
    `max_tokens`: the most tokens (prompt and output) a stream keeps for it; beyond, it is not continued.
    `strip_ids`: the router asked for the token ids, the client did not (they are cut out of what it is sent).
    """

    api: str
    blocked: str | None
    left: int
    max_tokens: int
    strip_ids: bool

    @classmethod
    def arm(
        cls,
        request: ClientRequest,
        *,
        left: int,
        max_tokens: int,
        api: str | None = None,
        blocked: str | None = None,
    ) -> ResumePolicy:
        """The policy of a streamed request (`api`: the client's, where `request` is a continuation);
        asks the decoder for the ids it needs (changes the body)."""
        blocked = blocked or why_not(request) or (None if left > 0 else "disabled")
        # A Messages or Responses stream is continued from its text: its engine endpoint returns no ids.
        asks_ids = (
            blocked is None and request.kind not in _TEXT_APIS and request.body.get("return_token_ids") is not True
        )
        if asks_ids:
            request.body["return_token_ids"] = True
            request.body_changed = True
        return cls(api or request.kind, blocked, left, max_tokens, strip_ids=asks_ids)


class StreamTape:
    """What a stream has generated, kept as it passes: the prompt's ids, the output's ids (their
    JSON arrays' bytes, parsed only when a continuation needs them), and the first answer's id."""

    __slots__ = ("_max", "_strip", "finished", "head", "off", "output", "over", "parsed", "prompt", "tokens")

    def __init__(self, *, strip: bool, max_tokens: int) -> None:
        self._strip = strip
        self._max = max_tokens
        self.prompt: bytes | None = None  # the prompt ids' array, brackets included
        self.output: list[bytes] = []  # the output ids' arrays' insides
        self.tokens = 0  # prompt and output tokens kept
        self.finished = False  # a choice's finish_reason went by: the answer is complete
        self.parsed = False  # output the engine's parsers made (reasoning, tool calls)
        self.over = False  # more tokens than the bound: nothing more is kept
        self.off = False  # nothing is kept: the engine sent no ids, or there were too many
        self.head: dict[str, Any] | None = None

    def keep(self, event: bytes) -> bytes:
        """One data event: its ids kept (and cut out where the client did not ask for them)."""
        if self.off:
            return event
        if self.prompt is None:
            # The stream's first data event carries the prompt's ids, or no event will (an engine that
            # does not return ids): then nothing is looked for again.
            event, ids = _cut_array(event, _PROMPT_IDS, self._strip)
            if ids is None:
                self.off = True
                return event
            self.prompt = ids
            self._count(ids)
        event, ids = _cut_array(event, _OUTPUT_IDS, self._strip)
        if ids is not None and len(ids) > 2 and not self.over:
            self.output.append(ids[1:-1])
            self._count(ids)
        if _FINISHED in event and _FAILED not in event:
            self.finished = True
        if _REASONING in event or _TOOL_CALLS in event:
            self.parsed = True
        return event

    def _count(self, array: bytes) -> None:
        self.tokens += array.count(b",") + 1 if len(array) > 2 else 0
        if self.tokens > self._max:
            self.over = self.off = True  # nothing is kept past the bound
            self.output.clear()

    def seen(self, payload: dict[str, Any]) -> None:
        """A parsed event of the stream: the first one's id, creation time and model name are the answer's."""
        if self.head is None and "id" in payload:
            self.head = {key: payload.get(key) for key in ("id", "created", "model")}

    def counts(self) -> tuple[int, int] | None:
        """The prompt's and the output's tokens as kept (None: not kept, so not known)."""
        if self.off or self.prompt is None:
            return None
        prompt = self.prompt.count(b",") + 1 if len(self.prompt) > 2 else 0
        return prompt, sum(part.count(b",") + 1 for part in self.output if part)

    def output_ids(self) -> list[int]:
        ids: list[int] = orjson.loads(b"[" + b",".join(self.output) + b"]")
        return ids

    def prompt_ids(self) -> list[int] | None:
        if self.prompt is None:
            return None
        ids = orjson.loads(self.prompt)
        return ids if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None


def _cut_array(event: bytes, key: bytes, strip: bool) -> tuple[bytes, bytes | None]:
    """The array value of `key` in a compact JSON event (its bytes, brackets included; None when absent or
    null), and with `strip` the event with `null` in its place: what vLLM writes when the ids are not asked
    for. A key inside a JSON string has its quotes escaped, so it is not found."""
    at = event.find(key)
    if at < 0:
        return event, None
    start = at + len(key)
    while event[start : start + 1] == b" ":
        start += 1
    if event[start : start + 1] != b"[":
        return event, None  # null
    end = event.find(b"]", start) + 1
    if end == 0:
        return event, None
    value = event[start:end]
    return (event[:start] + b"null" + event[end:] if strip else event), value


class Resumer:
    """One decoder stream's continuation: its tape, and the continuation when the decoder fails.

    A chat or text completion stream is continued from its token ids (a text completion, its chunks turned
    back into the client's); a Messages or Responses stream from its text (a chat call, its chunks written
    as the client's API's events: gateway/resume_text.py).
    """

    def __init__(
        self,
        request: ClientRequest,
        request_id: str,
        started: float,
        ending: Ending,
        output: Output,
        policy: ResumePolicy,
        decoder: Endpoint | None,
        metrics: RouterMetrics,
        *,
        open: OpenContinuation,
        timeouts: PhaseTimeouts,
        strip_usage: bool,
        wire: Wire = OPENAI_WIRE,
    ) -> None:
        self._request = request
        self._request_id = request_id
        self._started = started  # when the request reached the router (a perf_counter reading)
        # The first stream's ending and output: the continuation's failure, chunks and usage go on them.
        self._ending = ending
        self._output = output
        self._open = open
        self._timeouts = timeouts
        self._policy = policy
        self._decoder = decoder
        self._metrics = metrics
        self._strip_usage = strip_usage
        self._wire = wire
        self.tape: StreamTape | EventTape | None = None
        if policy.blocked is None:
            if request.kind in _TEXT_APIS:
                self.tape = EventTape(request.kind, max_tokens=policy.max_tokens)
            else:
                self.tape = StreamTape(strip=policy.strip_ids, max_tokens=policy.max_tokens)
        self._chat = request.kind == "chat"
        self._kept_tokens = 0
        self._said: Said | None = None
        self._writer: AnswerWriter | None = None

    def why_not(self, saw_output: bool) -> str | None:
        """Why the stream cannot be continued now (None: it can)."""
        policy, tape = self._policy, self.tape
        if policy.blocked is not None or tape is None:
            return policy.blocked or "disabled"
        if tape.over:
            return "too_long"
        if tape.finished:
            return "answer_complete"
        if isinstance(tape, EventTape):
            if self._said is None:
                self._said = tape.said()
            if self._said.parsed:
                return "parsed_output"
            if not self._said.text:
                return "no_output"
        elif tape.parsed:
            return "parsed_output"
        elif tape.prompt is None or (saw_output and not tape.output):
            return "no_token_ids"
        if time.perf_counter() - self._started >= self._timeouts.total:
            return "deadline"
        return None

    def ending(self) -> bytes | None:
        """The events that end an answer that was complete (its finish went by) when its decoder broke before
        its end, as the decoder would have sent them (the relay reads them as it read the decoder's: their
        usage counted and reconciled, a usage chunk the client did not ask for dropped, a kept response
        kept): the usage its tape counts and `[DONE]`; a Messages stream's message_stop, once its stop reason
        and usage went by; a Responses stream's closing events and its response (EventTape.ending). None
        where the tape cannot tell (no ids kept)."""
        tape = self.tape
        if isinstance(tape, EventTape):
            return tape.ending(wanted_output(self._request)) if tape.finished else None
        if not isinstance(tape, StreamTape) or not tape.finished or tape.head is None:
            return None
        counts = tape.counts()
        if counts is None:
            return None
        prompt, completion = counts
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        kind = "chat.completion.chunk" if self._chat else "text_completion"
        payload: dict[str, Any] = {**tape.head, "object": kind, "choices": [], "usage": usage}
        return _DATA + orjson.dumps(payload) + _EVENT_END + _DONE + _EVENT_END

    def count(self, outcome: str, reason: str = "") -> None:
        self._metrics.stream_continuations.labels(self._policy.api, outcome, reason).inc()

    def continuation(self) -> ClientRequest | None:
        """The continuation's request (None: no output is left to generate): a text completion of the
        prompt's and the output's ids for the tokens left, or for a Messages or Responses stream the
        conversation with the text said as the assistant's message to continue."""
        tape = self.tape
        if isinstance(tape, EventTape):
            said = self._said = self._said or tape.said()
            self._kept_tokens = said.deltas
            self._writer = MessagesAnswer(said) if self._request.kind == "messages" else ResponsesAnswer(said)
            return chat_continuation(self._request, said, with_ids=self._policy.left > 1)
        assert tape is not None
        request = self._request
        prompt = tape.prompt_ids()
        output = tape.output_ids()
        assert prompt is not None
        wanted = requested_max_tokens(request)
        if wanted is not None and wanted <= len(output):
            return None
        drop = _NOT_CARRIED | (_CHAT_ONLY_FIELDS if self._chat else frozenset())
        body = {key: value for key, value in request.body.items() if key not in drop}
        body["prompt"] = [*prompt, *output]
        body["stream"] = True
        options = request.body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        if wanted is not None:
            body["max_tokens"] = wanted - len(output)
        elif self._chat:
            body["max_tokens"] = None  # the rest of the context, as a chat request without one
        minimum = requested_min_tokens(request) - len(output)
        if minimum > 0:
            body["min_tokens"] = minimum
        body["return_token_ids"] = self._policy.left > 1 or not self._policy.strip_ids
        self._kept_tokens = len(output)
        raw = orjson.dumps(body)
        return ClientRequest(kind="completion", body=body, raw=raw, stream=True)

    async def relay(self, failure: str, cached_tokens: int | None) -> AsyncIterator[bytes]:
        """The rest of the answer, from another decoder, in the client's API; raises RouterError when it
        cannot be opened (the caller ends the stream as without a continuation)."""
        policy, ending = self._policy, self._ending
        request = self.continuation()
        if request is None:
            return
        answer, where = await self._open(request, self._decoder, policy.left - 1)
        if not isinstance(answer, StreamedAnswer):
            detail = answer.content[:300].decode(errors="replace")
            raise RouterError(f"the continuation was refused ({answer.status}): {detail}")
        ending.continuations += 1
        ending.continued_after = f"{failure} after {self._kept_tokens} tokens; continued on {where}"
        log.warning(
            "request %s: the decoder %s failed after %d tokens (%s); continuing on %s",
            self._request_id,
            None if self._decoder is None else self._decoder.url,
            self._kept_tokens,
            failure,
            where,
        )
        self.count("continued")
        pending = b""
        try:
            async for chunk in answer.events:
                pending += chunk
                if _EVENT_END not in pending:
                    continue
                *events, pending = pending.split(_EVENT_END)
                if self._writer is None:
                    out = [rewritten for event in events if (rewritten := self._rewrite(event, cached_tokens))]
                else:
                    out = await self._written(events, cached_tokens)
                if out:
                    yield _EVENT_END.join(out) + _EVENT_END
        finally:
            await answer.close()

    async def _written(self, events: list[bytes], cached_tokens: int | None) -> list[bytes]:
        """A continuation's chat events as the Messages or Responses events the client's stream goes on with;
        the usage and the ended response are the wire's to record (and, for a kept response, to keep)."""
        writer, wire, output = self._writer, self._wire, self._output
        assert writer is not None
        out: list[bytes] = []
        ended = False
        for event in events:
            if not event.startswith(_DATA):
                continue
            if event.startswith(_DONE):
                payloads = writer.done()
            else:
                try:
                    payload = orjson.loads(event[len(_DATA) :])
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(payload, dict):
                    continue
                if "error" in payload:
                    message = OPENAI_WIRE.errored(payload) or "the continuation failed"
                    self._ending.fail("upstream_error", message)
                    return [*out, wire.error_event(message).removesuffix(_EVENT_END)]
                payloads = writer.chunk(payload)
            for written in payloads:
                if wire.has_token(written):
                    output.mark_token_chunk(time.perf_counter())
                wire.reconcile(written, output, cached_tokens)
                out.append(named_event(written))
                ended = ended or wire.ends(out[-1])
        if ended:
            await wire.settle()  # a kept response is stored before the client sees its end
        return out

    def _rewrite(self, event: bytes, cached_tokens: int | None) -> bytes:
        """A continuation's event as the first answer's: its id, API and usage."""
        if not event.startswith(_DATA) or event.startswith(_DONE):
            return event
        try:
            payload = orjson.loads(event[len(_DATA) :])
        except orjson.JSONDecodeError:
            return event
        if not isinstance(payload, dict):
            return event
        if "error" in payload:
            self._ending.fail("upstream_error", OPENAI_WIRE.errored(payload) or "the continuation failed")
            return event
        # The client had the prompt's ids (if it asked) with the first answer: the continuation's prompt is not
        # one it sent. Its output ids go on where the client asked for them (null where not, as vLLM writes).
        if "prompt_token_ids" in payload:
            payload["prompt_token_ids"] = None
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict):
                if "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
                if self._policy.strip_ids and "token_ids" in choice:
                    choice["token_ids"] = None
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._as_one_usage(usage)
            reconcile_usage(payload, self._output, cached_tokens)
        if self._chat:
            payload = chat_chunks.chunk_to_chat(payload)
        tape = self.tape
        if isinstance(tape, StreamTape) and tape.head is not None:
            payload.update(tape.head)
        if any(choice.get("delta") or choice.get("text") for choice in payload.get("choices") or ()):
            self._output.mark_token_chunk(time.perf_counter())
        if self._strip_usage and "usage" in payload:
            if not payload.get("choices"):
                return b""
            payload.pop("usage")
        return _DATA + orjson.dumps(payload)

    def _as_one_usage(self, usage: dict[str, Any]) -> None:
        """The continuation's prompt held the output already sent: counted as output, the prompt once."""
        kept = self._kept_tokens
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            usage["prompt_tokens"] = prompt - kept
            usage["completion_tokens"] = completion + kept
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                details["cached_tokens"] = min(details["cached_tokens"], prompt - kept)
