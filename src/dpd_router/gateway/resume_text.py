"""Continuing a Messages or Responses stream: from its text, back in its own events.

vLLM's Messages and Responses endpoints return no token ids, so these streams are continued from the text
the client has seen. With a local tokenizer the continuation is a text completion of ids: the request's
prompt as the router renders it (the engine's rendering, which the router's count already matches) followed
by the text said, encoded as one text (`by_ids`). Without one, the chat API continues the conversation with
that text as a final assistant message (`continue_final_message`); a template that trims its messages then
continues a slightly different text. Either is a faithful continuation of the same text, not token-exact at the cut
as a chat or text completion stream is (gateway/resume.py). The answer's chunks are written as the client's
API's events: text deltas in the open block or item, then the events that close the answer, with usage that
counts the prompt once and every output token (the output said counted by the events that carried it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from dpd_router.gateway.wires import MESSAGES_WIRE
from dpd_router.request.client_request import ClientRequest

_DATA = b"\ndata: "
_MESSAGES_ENDS = (b"event: message_delta", b"event: message_stop")
_RESPONSES_ENDS = (b"event: response.output_text.done", b"event: response.completed", b"event: response.incomplete")
# The events after a Responses answer's text is done (the part, the item, the response), in their order.
_RESPONSES_CLOSING = (b"event: response.content_part.done", b"event: response.output_item.done")
# What a Messages stop reason is for each chat finish reason.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# What a chat continuation has that a text completion of ids does not take.
_NOT_COMPLETION_FIELDS = frozenset(
    {"messages", "tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
)


def _payload(event: bytes) -> dict[str, Any] | None:
    start = MESSAGES_WIRE.data(event)  # a named event's data, as the relay finds it (Responses' too)
    if start is None:
        return None
    try:
        payload = orjson.loads(event[start:])
    except orjson.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def named_event(payload: dict[str, Any]) -> bytes:
    """A Messages or Responses event: its type's name, then its data."""
    return b"event: " + str(payload["type"]).encode() + _DATA + orjson.dumps(payload)


@dataclass
class Said:
    """What a Messages or Responses stream said before its decoder failed."""

    text: str = ""
    deltas: int = 0  # output events: each carried one token or more
    parsed: bool = False  # a block or item other than text (thinking, a tool call): not continued
    head: dict[str, Any] | None = None  # message_start's message, or response.created's response
    at: dict[str, Any] = field(default_factory=dict)  # where the text goes: block index, or item and part
    sequence: int = 0  # the Responses stream's next sequence number
    # A Responses stream's text part and message item as the engine closed them (content_part.done,
    # output_item.done), where those went by.
    part: dict[str, Any] | None = None
    item: dict[str, Any] | None = None
    # A Responses stream's items by output index, as added and as the engine closed them (a reasoning item
    # before the message, say), and the output events of items other than the text (their deltas).
    added: dict[int, dict[str, Any]] = field(default_factory=dict)
    closed: dict[int, dict[str, Any]] = field(default_factory=dict)
    other_deltas: int = 0


# The bytes a Messages or Responses stream keeps for each token of the bound (`stream_continuation_max_tokens`):
# as many as a chat stream's ids take; its events take about 150 a token, so it keeps fewer tokens.
BYTES_PER_TOKEN = 6


class EventTape:
    """A Messages or Responses stream's events, kept as they pass (read only if its decoder fails), within
    a bound on their bytes."""

    __slots__ = ("_api", "_closed", "_max", "_size", "_stopped", "events", "finished", "over")

    def __init__(self, api: str, *, max_tokens: int) -> None:
        self._api = api
        self._max = max_tokens * BYTES_PER_TOKEN
        self._size = 0
        self.events: list[bytes] = []
        self.over = False
        self.finished = False
        self._stopped = False  # a Messages stream's message_delta went by: its stop reason and usage
        self._closed: set[str] = set()  # the Responses events that close the answer's text which went by

    def keep(self, event: bytes) -> bytes:
        if event.startswith(_MESSAGES_ENDS if self._api == "messages" else _RESPONSES_ENDS):
            self.finished = True
            self._stopped = self._stopped or event.startswith(_MESSAGES_ENDS[0])
        elif self.finished and event.startswith(_RESPONSES_CLOSING):
            self._closed.add(event[len(b"event: ") : event.find(b"\n")].decode())
        if not self.over:
            self.events.append(event)
            self._size += len(event)
            if self._size > self._max:
                self.over = True
                self.events.clear()
        return event

    def seen(self, payload: dict[str, Any]) -> None:
        """The relay's parsed events are read again from the tape."""

    def ending(self, max_output: int | None) -> bytes | None:
        """What a finished answer lacks when its decoder broke before its last event: a Messages stream
        whose message_delta (its stop reason and usage) went by lacks only its message_stop; a Responses
        stream whose text is all said (its output_text.done went by) lacks the events that close its part,
        its item and the response, which the router writes from what went by (the response.created head, the
        items before the message as the engine closed them (reasoning), the text, the part and item where the
        engine closed them), as a continuation's end is written, without a usage (the engine told none before
        its end).
        `max_output`: the client's limit on output tokens (an answer with as many output deltas ended by it).
        None where the events cannot tell: a Messages stream before its message_delta, a Responses stream
        whose text is not its last item's, with an item before it the engine did not close, or with no
        response.created."""
        if self._api == "messages":
            return named_event({"type": "message_stop"}) + b"\n\n" if self._stopped else None
        said = self.said()
        if not self.finished or said.head is None:
            return None
        message = said.at.get("output_index", 0)
        item = said.added.get(message)
        if item is None or item.get("type") != "message" or message != max(said.added):
            return None  # the text is not the last item's: what came after it cannot be told
        before = [index for index in said.added if index != message]
        if any(index not in said.closed for index in before):
            return None
        length = max_output is not None and said.deltas + said.other_deltas >= max_output
        answer = ResponsesAnswer(said)
        events = answer.after_text(length=length, passed=self._closed, before=[said.closed[i] for i in sorted(before)])
        return b"".join(named_event(event) + b"\n\n" for event in events)

    def said(self) -> Said:
        said = Said()
        messages = self._api == "messages"
        texts: list[str] = []
        for event in self.events:
            payload = _payload(event)
            if payload is None:
                continue
            kind = payload.get("type")
            if messages:
                _read_message_event(kind, payload, said, texts)
            else:
                _read_response_event(kind, payload, said, texts)
        said.text = "".join(texts)
        return said


def _read_message_event(kind: Any, payload: dict[str, Any], said: Said, texts: list[str]) -> None:
    if kind == "message_start" and isinstance(payload.get("message"), dict):
        said.head = payload["message"]
    elif kind == "content_block_start":
        block = payload.get("content_block")
        if not isinstance(block, dict) or block.get("type") != "text":
            said.parsed = True
        said.at = {"index": payload.get("index", 0)}
    elif kind == "content_block_delta":
        delta = payload.get("delta")
        if isinstance(delta, dict) and delta.get("type") == "text_delta":
            texts.append(str(delta.get("text") or ""))
            said.deltas += 1
        else:
            said.parsed = True


def _read_response_event(kind: Any, payload: dict[str, Any], said: Said, texts: list[str]) -> None:
    sequence = payload.get("sequence_number")
    if isinstance(sequence, int):
        said.sequence = sequence + 1
    if kind == "response.created" and isinstance(payload.get("response"), dict):
        said.head = payload["response"]
    elif kind == "response.output_item.added":
        item = payload.get("item")
        index = payload.get("output_index", 0)
        if not isinstance(item, dict) or item.get("type") != "message":
            said.parsed = True
        if isinstance(item, dict) and isinstance(index, int):
            said.added[index] = item
        said.at = {"output_index": index, "item": item}
        said.part = said.item = None  # those of the item before, if any
    elif kind == "response.output_text.delta":
        texts.append(str(payload.get("delta") or ""))
        said.deltas += 1
        said.at.update(item_id=payload.get("item_id"), content_index=payload.get("content_index", 0))
    elif kind == "response.content_part.done" and isinstance(payload.get("part"), dict):
        if payload.get("output_index", 0) == said.at.get("output_index", 0):  # the text's part, not reasoning's
            said.part = payload["part"]
    elif kind == "response.output_item.done" and isinstance(payload.get("item"), dict):
        index = payload.get("output_index", 0)
        if isinstance(index, int):
            said.closed[index] = payload["item"]
        if index == said.at.get("output_index", 0):
            said.item = payload["item"]
    elif isinstance(kind, str) and kind.endswith(".delta"):
        said.parsed = True  # reasoning, a function call's arguments
        said.other_deltas += 1


def by_ids(chat: ClientRequest, prompt_ids: list[int]) -> ClientRequest:
    """The chat continuation (`chat_continuation`) as a text completion of `prompt_ids`: the prompt's and the
    text said's, encoded as one text."""
    body = {key: value for key, value in chat.body.items() if key not in _NOT_COMPLETION_FIELDS}
    body["prompt"] = prompt_ids
    return ClientRequest(kind="completion", body=body, raw=orjson.dumps(body), stream=True)


def said_text(chat: ClientRequest) -> str:
    """The text a chat continuation continues (its final assistant message's)."""
    return str(chat.body["messages"][-1]["content"])


def wanted_output(request: ClientRequest) -> int | None:
    """The client's output limit (None: unset)."""
    name = "max_tokens" if request.kind == "messages" else "max_output_tokens"
    value = request.body.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def chat_continuation(request: ClientRequest, said: Said, *, with_ids: bool) -> ClientRequest | None:
    """The continuation: the request's chat conversation with the text said as the final assistant message,
    which the engine continues, for the output left (None: none left)."""
    assert request.converted is not None
    body = request.body
    wanted = wanted_output(request)
    if wanted is not None and wanted <= said.deltas:
        return None
    chat: dict[str, Any] = {**request.converted}
    chat["messages"] = [*chat["messages"], {"role": "assistant", "content": said.text}]
    chat.update(add_generation_prompt=False, continue_final_message=True, stream=True)
    chat["stream_options"] = {"include_usage": True}
    for name in ("model", "temperature", "top_p", "top_k", "seed"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if request.kind == "messages" and body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    if wanted is not None:
        chat["max_tokens"] = wanted - said.deltas
    if with_ids:
        chat["return_token_ids"] = True
    return ClientRequest(kind="chat", body=chat, raw=orjson.dumps(chat), stream=True)


class _ChatAnswer:
    """Reads a continuation's chat chunks: each text delta, the finish reason, and the end (its usage chunk,
    or the stream's end without one), which is written once."""

    def __init__(self, said: Said) -> None:
        self._said = said
        self._continued = 0  # the continuation's output events
        self._finish: tuple[Any, Any] = (None, None)  # the chat finish reason, and what stopped it
        self._ended = False

    def chunk(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        choices = payload.get("choices") or []
        if not choices:
            usage = payload.get("usage")
            return self._end(usage if isinstance(usage, dict) else None)
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self._finish = (choice["finish_reason"], choice.get("stop_reason"))
        # A chat chunk's delta, or a text completion's text.
        text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if not text:
            return []
        self._continued += 1
        return [self._delta(text)]

    def done(self) -> list[dict[str, Any]]:
        return self._end(None)

    def _end(self, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        if self._ended:
            return []
        self._ended = True
        return self._closing(usage)

    def _output_tokens(self, usage: dict[str, Any] | None) -> int:
        """Every output token: those said before the continuation (one an event) and its own (its usage's,
        else one an event)."""
        completion = None if usage is None else usage.get("completion_tokens")
        return self._said.deltas + (completion if isinstance(completion, int) else self._continued)

    def _delta(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _closing(self, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        raise NotImplementedError


class MessagesAnswer(_ChatAnswer):
    """The continuation's chat chunks as the Messages stream's events: deltas in the open text block, then
    the block's end, the message's stop reason and usage, and its end."""

    def __init__(self, said: Said) -> None:
        super().__init__(said)
        self._index = said.at.get("index", 0)
        usage = (said.head or {}).get("usage")
        self._usage = usage if isinstance(usage, dict) else {}

    def _delta(self, text: str) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": {"type": "text_delta", "text": text}}

    def _closing(self, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        finish, stop = self._finish
        reason = "stop_sequence" if finish == "stop" and isinstance(stop, str) else _STOP_REASONS.get(finish or "")
        output = {**self._usage, "output_tokens": self._output_tokens(usage)}
        delta = {"stop_reason": reason, "stop_sequence": stop if reason == "stop_sequence" else None}
        return [
            {"type": "content_block_stop", "index": self._index},
            {"type": "message_delta", "delta": delta, "usage": output},
            {"type": "message_stop"},
        ]


class ResponsesAnswer(_ChatAnswer):
    """The continuation's chat chunks as the Responses stream's events: text deltas in the open part, then
    the part, the item and the response completed, with the whole text and the usage."""

    def __init__(self, said: Said) -> None:
        super().__init__(said)
        self._sequence = said.sequence
        self._texts = [said.text]
        at = said.at
        item = at.get("item")
        self._item_id = at.get("item_id") or (item.get("id") if isinstance(item, dict) else None)
        self._output_index = at.get("output_index", 0)
        self._content_index = at.get("content_index", 0)

    def _delta(self, text: str) -> dict[str, Any]:
        self._texts.append(text)
        return self._event("response.output_text.delta", self._at({"delta": text, "logprobs": []}))

    def after_text(
        self, *, length: bool, passed: set[str], before: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """The events that close an answer whose text was all said before its decoder broke (its
        output_text.done went by, and the events named in `passed`): numbered on from the last that went by,
        the part and item as the engine closed them where it did, the items `before` the message (as the
        engine closed them) first in the response's output, the response `incomplete` where the output limit
        ended it (`length`), its usage unknown."""
        self._finish = ("length" if length else "stop", None)
        closing = self._closing(None, part=self._said.part, item=self._said.item, before=before)
        events = [event for event in closing[1:] if event["type"] not in passed]
        for number, event in enumerate(events, start=self._said.sequence):
            event["sequence_number"] = number
        return events

    def _closing(
        self,
        usage: dict[str, Any] | None,
        *,
        part: dict[str, Any] | None = None,
        item: dict[str, Any] | None = None,
        before: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        text = "".join(self._texts)
        part = part or {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        status = "incomplete" if self._finish[0] == "length" else "completed"
        item = item or {
            "id": self._item_id,
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [part],
        }
        response = {**(self._said.head or {}), "status": status, "output": [*(before or []), item]}
        response["incomplete_details"] = {"reason": "max_output_tokens"} if status == "incomplete" else None
        response["usage"] = self._usage(usage)
        return [
            self._event("response.output_text.done", self._at({"text": text, "logprobs": []})),
            self._event("response.content_part.done", self._at({"part": part})),
            self._event("response.output_item.done", {"output_index": self._output_index, "item": item}),
            self._event("response.completed", {"response": response}),
        ]

    def _usage(self, usage: dict[str, Any] | None) -> dict[str, Any] | None:
        """The continuation's usage, its prompt less the text said (counted as output)."""
        if usage is None:
            return None
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None
        first = self._said.head.get("usage") if self._said.head else None
        # The first response tells no prompt count before its end: the continuation's, less the output said.
        input_tokens = first.get("input_tokens") if isinstance(first, dict) else None
        input_tokens = input_tokens if isinstance(input_tokens, int) else prompt - self._said.deltas
        output = self._output_tokens(usage)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": min(cached or 0, input_tokens)},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output,
        }

    def _at(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {
            "item_id": self._item_id,
            "output_index": self._output_index,
            "content_index": self._content_index,
            **fields,
        }

    def _event(self, name: str, fields: dict[str, Any]) -> dict[str, Any]:
        payload = {"type": name, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return payload


# Writes a continuation's chat chunks as the client's API's events (payloads, each with its "type").
AnswerWriter = MessagesAnswer | ResponsesAnswer
