"""How each API's answer reads: an event with a token, where a stream ends, how its usage counts, how an
in-band error is written. The relay (gateway/relay.py) reads a decoder's answer through one, the shadow
(shadow/copies.py) a shadow's: OpenAI's chat and completions chunks, and the Responses and Messages APIs'
named events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from dpd_router.messages import api as messages_api
from dpd_router.record.observe import Output
from dpd_router.request.client_request import ClientRequest
from dpd_router.responses import api as responses_api

if TYPE_CHECKING:
    from dpd_router.responses.api import Turn

_EVENT_END = b"\n\n"
_DATA = b"data: "
_DONE = b"data: [DONE]"


def _has_token(payload: dict[str, Any]) -> bool:
    """Whether a completion chunk carries output (content, text, tool calls or a finish)."""
    choices = payload.get("choices")
    if not choices:
        return False
    for choice in choices:
        if choice.get("finish_reason") not in (None, "error") or choice.get("text"):
            return True
        delta = choice.get("delta")
        if delta and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
            return True
    return False


def _errored(payload: dict[str, Any]) -> str | None:
    if "error" in payload:
        error = payload["error"]
        return str(error.get("message") if isinstance(error, dict) else error)
    for choice in payload.get("choices") or ():
        if choice.get("finish_reason") == "error":
            return "the engine ended the request with finish_reason=error"
    return None


def reconcile_usage(payload: dict[str, Any], output: Output, cached_tokens: int | None) -> bool:
    """Keep the usage block's counts on `output`; where the decoder reported cached tokens, report the
    prefiller's instead.

    The decoder's own count is kept as `output.decoder_cached_tokens`: on the disaggregated path it
    shows whether the KV really arrived. Only a `cached_tokens` the engine wrote is replaced: a block
    it left out (continuous usage chunks, an engine without --enable-prompt-tokens-details) stays
    out, so the client sees the engine's usage shape. Returns True when the payload was changed.
    """
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return False
    completion = usage.get("completion_tokens")
    if isinstance(completion, int):
        output.completion_tokens = completion
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        output.prompt_tokens = prompt
    details = usage.get("prompt_tokens_details")
    reported = details.get("cached_tokens") if isinstance(details, dict) else None
    # None when the engine does not report it (vLLM needs --enable-prompt-tokens-details).
    output.decoder_cached_tokens = reported if isinstance(reported, int) else None
    if cached_tokens is None:
        output.cached_tokens = output.decoder_cached_tokens
        return False
    output.cached_tokens = cached_tokens
    if not isinstance(details, dict) or not isinstance(reported, int) or reported == cached_tokens:
        return False
    details["cached_tokens"] = cached_tokens
    return True


class _Unkept:
    """A wire whose answers the router does not keep: nothing to settle at a stream's end."""

    async def settle(self) -> None:
        """What the answer leaves to keep, kept (awaited before the stream's end reaches the client)."""


class OpenAIWire(_Unkept):
    """Chat and text completion answers: `data: {chunk}` events, `data: [DONE]` at the end."""

    @staticmethod
    def data(event: bytes) -> int | None:
        """Where the JSON of a data event starts (None: not a data event)."""
        return len(_DATA) if event.startswith(_DATA) else None

    @staticmethod
    def ends(event: bytes) -> bool:
        return event.startswith(_DONE)

    @staticmethod
    def only_tokens(event: bytes) -> bool:
        """An event past the first token that the metrics need not parse: one without usage or error."""
        return b'"usage"' not in event and b'"error"' not in event

    has_token = staticmethod(_has_token)
    errored = staticmethod(_errored)

    @staticmethod
    def reconcile(payload: dict[str, Any], output: Output, cached_tokens: int | None) -> bool:
        return reconcile_usage(payload, output, cached_tokens)

    @staticmethod
    def output_tokens(payload: dict[str, Any]) -> int | None:
        usage = payload.get("usage")
        completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return completion if isinstance(completion, int) else None

    @staticmethod
    def error_event(message: str) -> bytes:
        return error_event(message)


_MESSAGE_DATA = b"\ndata: "


class MessagesWire(_Unkept):
    """Messages API answers: `event: <type>` then `data: {...}`; `message_stop` ends the stream; the usage
    comes in `message_start` and `message_delta`."""

    @staticmethod
    def data(event: bytes) -> int | None:
        if event.startswith(_DATA):
            return len(_DATA)
        at = event.find(_MESSAGE_DATA)
        return None if at < 0 else at + len(_MESSAGE_DATA)

    @staticmethod
    def ends(event: bytes) -> bool:
        return event.startswith(b"event: message_stop")

    @staticmethod
    def only_tokens(event: bytes) -> bool:
        return event.startswith(b"event: content_block_delta")

    @staticmethod
    def has_token(payload: dict[str, Any]) -> bool:
        return payload.get("type") in ("content_block_delta", "message_delta")

    errored = staticmethod(_errored)

    @staticmethod
    def reconcile(payload: dict[str, Any], output: Output, cached_tokens: int | None) -> bool:
        usage = payload.get("usage")
        message = payload.get("message")
        if not isinstance(usage, dict) and isinstance(message, dict):
            usage = message.get("usage")  # message_start's
        if not isinstance(usage, dict):
            return False
        _record_counts(output, messages_api.usage_counts(usage), cached_tokens)
        return cached_tokens is not None and messages_api.reconcile_cached(usage, cached_tokens)

    @staticmethod
    def output_tokens(payload: dict[str, Any]) -> int | None:
        usage = payload.get("usage")
        output = usage.get("output_tokens") if isinstance(usage, dict) else None
        return output if isinstance(output, int) else None

    @staticmethod
    def error_event(message: str) -> bytes:
        return messages_api.error_event(message)


class ResponsesWire(MessagesWire):
    """Responses API answers: named events as the Messages API's (`response.output_text.delta` and the other
    deltas carry the output); `response.completed` (or `.incomplete`, `.failed`) ends the stream with the
    whole response, its usage counting the whole prompt as `input_tokens`."""

    _ENDS = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")

    @staticmethod
    def ends(event: bytes) -> bool:
        return event.startswith(ResponsesWire._ENDS)

    @staticmethod
    def only_tokens(event: bytes) -> bool:
        return event.startswith(b"event: response.") and event[: event.find(b"\n")].endswith(b".delta")

    @staticmethod
    def has_token(payload: dict[str, Any]) -> bool:
        kind = payload.get("type")
        return isinstance(kind, str) and kind.startswith("response.") and kind.endswith(".delta")

    @staticmethod
    def errored(payload: dict[str, Any]) -> str | None:
        """An `error` event, a failed response, or a whole answer whose `error` is set (it is null when none)."""
        if payload.get("type") == "error":
            return str(payload.get("message") or "the engine reported an error")
        inner = payload.get("response")
        response: dict[str, Any] = inner if isinstance(inner, dict) else payload
        error = response.get("error")
        if error is None and response.get("status") != "failed":
            return None
        return str(error.get("message") if isinstance(error, dict) else error or "the response failed")

    @staticmethod
    def reconcile(payload: dict[str, Any], output: Output, cached_tokens: int | None) -> bool:
        response = payload.get("response")
        usage = (response if isinstance(response, dict) else payload).get("usage")
        if not isinstance(usage, dict):
            return False
        _record_counts(output, responses_api.usage_counts(usage), cached_tokens)
        return cached_tokens is not None and responses_api.reconcile_cached(usage, cached_tokens)

    @staticmethod
    def error_event(message: str) -> bytes:
        payload = {"type": "error", "code": "upstream_error", "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(payload) + _EVENT_END


class KeptResponsesWire(ResponsesWire):
    """A Responses answer the router keeps or continues: each response object that passes (a whole answer,
    or an event's `response`) is shown to the request's turn (responses.history), which tells it the
    client's `store` and `previous_response_id` and holds the ended one to keep."""

    _ENDED = ("response.completed", "response.incomplete")

    def __init__(self, turn: Turn) -> None:
        self._turn = turn

    def reconcile(self, payload: dict[str, Any], output: Output, cached_tokens: int | None) -> bool:  # type: ignore[override]
        changed = ResponsesWire.reconcile(payload, output, cached_tokens)
        inner = payload.get("response")
        if isinstance(inner, dict):
            return self._turn.seen(inner, ended=payload.get("type") in self._ENDED) or changed
        if payload.get("object") == "response":
            return self._turn.seen(payload, ended=True) or changed
        return changed

    async def settle(self) -> None:
        await self._turn.settle()


def _record_counts(
    output: Output, counts: tuple[int | None, int | None, int | None], cached_tokens: int | None
) -> None:
    """Keep an answer's (prompt, cached, output) token counts on `output`; the cache hit the client is told
    is the prefiller's where there was one (`cached_tokens`), the decoder's own kept beside it."""
    prompt, cached, completion = counts
    if completion is not None:
        output.completion_tokens = completion
    if prompt is not None:
        output.prompt_tokens = prompt
    output.decoder_cached_tokens = cached
    output.cached_tokens = cached if cached_tokens is None else cached_tokens


Wire = OpenAIWire | MessagesWire | ResponsesWire
OPENAI_WIRE, MESSAGES_WIRE, RESPONSES_WIRE = OpenAIWire(), MessagesWire(), ResponsesWire()
_WIRES: dict[str, Wire] = {"messages": MESSAGES_WIRE, "responses": RESPONSES_WIRE}


def wire_of(request: ClientRequest) -> Wire:
    """The API the engine answers `request` in (for a Responses request the router keeps, with its turn)."""
    if request.turn is not None:
        return KeptResponsesWire(request.turn)
    return wire_for(request.kind)


def wire_for(kind: str) -> Wire:
    """The API an engine answers a request of `kind` in."""
    return _WIRES.get(kind, OPENAI_WIRE)


def error_event(message: str) -> bytes:
    """An in-band error and the end of the stream, for a stream the client has already seen bytes of."""
    error = {"error": {"message": message, "type": "BadGatewayError", "param": None, "code": 502}}
    return _DATA + orjson.dumps(error) + _EVENT_END + _DONE + _EVENT_END
