"""Messages and Responses streams continued from their text: what was said, the chat call, the events back."""

from __future__ import annotations

from typing import Any

import orjson

from dpd_router.gateway.resume_text import (
    EventTape,
    MessagesAnswer,
    ResponsesAnswer,
    by_ids,
    chat_continuation,
    said_text,
)
from dpd_router.request.client_request import parse_request


def named(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields})


def chat_chunk(text: str | None = None, finish: str | None = None, usage: dict[str, int] | None = None) -> dict:
    if usage is not None:
        return {"id": "chatcmpl-9", "choices": [], "usage": usage}
    delta = {"content": text} if text else {}
    return {"id": "chatcmpl-9", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": []}
MESSAGE_START = named("message_start", message={**MESSAGE, "usage": {"input_tokens": 7, "cache_read_input_tokens": 3}})


def messages_tape(*events: bytes) -> EventTape:
    tape = EventTape("messages", max_tokens=10_000)
    for event in events:
        tape.keep(event)
    return tape


def text_delta(text: str, index: int = 0) -> bytes:
    return named("content_block_delta", index=index, delta={"type": "text_delta", "text": text})


def test_what_a_messages_stream_said_is_its_text_in_its_open_block() -> None:
    block = named("content_block_start", index=0, content_block={"type": "text", "text": ""})
    said = messages_tape(MESSAGE_START, block, text_delta("Rivers"), text_delta(" flow")).said()
    assert (said.text, said.deltas, said.at, said.parsed) == ("Rivers flow", 2, {"index": 0}, False)
    assert said.head is not None and said.head["id"] == "msg_1"


def test_thinking_or_a_tool_call_is_output_a_continuation_cannot_carry() -> None:
    thinking = named("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""})
    assert messages_tape(MESSAGE_START, thinking).said().parsed
    tool = named("content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": "{"})
    assert messages_tape(MESSAGE_START, tool).said().parsed


def test_the_end_of_a_message_means_nothing_is_left_to_continue() -> None:
    ended = messages_tape(MESSAGE_START, text_delta("a"), named("message_delta", delta={"stop_reason": "end_turn"}))
    assert ended.finished


def test_a_tape_past_its_bound_keeps_nothing() -> None:
    tape = EventTape("messages", max_tokens=10)  # 60 bytes
    tape.keep(MESSAGE_START)
    assert tape.over and not tape.events


def test_the_continuation_is_the_conversation_with_the_text_said_for_the_output_left() -> None:
    body = {
        "model": "m",
        "max_tokens": 40,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
        "temperature": 0.5,
        "stop_sequences": ["END"],
        "stream": True,
    }
    request = parse_request("messages", orjson.dumps(body))
    said = messages_tape(MESSAGE_START, text_delta("Rivers"), text_delta(" flow")).said()
    continuation = chat_continuation(request, said, with_ids=False)
    assert continuation is not None and continuation.kind == "chat"
    chat = continuation.body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about rivers."},
        {"role": "assistant", "content": "Rivers flow"},
    ]
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    assert (chat["max_tokens"], chat["temperature"], chat["stop"], chat["model"]) == (38, 0.5, ["END"], "m")
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    used_up = messages_tape(MESSAGE_START, *(text_delta("a") for _ in range(40))).said()
    assert chat_continuation(request, used_up, with_ids=False) is None


def test_a_messages_continuation_ends_the_message_with_every_output_token_counted() -> None:
    said = messages_tape(MESSAGE_START, text_delta("Rivers"), text_delta(" flow")).said()
    answer = MessagesAnswer(said)
    assert answer.chunk(chat_chunk(" to")) == [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " to"}}
    ]
    assert answer.chunk(chat_chunk(None, finish="length")) == []
    # The continuation's prompt: the first's 10 tokens and the 2 said; its own output, 1.
    end = answer.chunk(chat_chunk(usage={"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}))
    assert [event["type"] for event in end] == ["content_block_stop", "message_delta", "message_stop"]
    assert end[1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end[1]["usage"] == {"input_tokens": 7, "cache_read_input_tokens": 3, "output_tokens": 3}
    assert answer.done() == [], "the end is written once"


def test_a_responses_continuation_completes_the_response_with_its_whole_text() -> None:
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "usage": None}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    tape = EventTape("responses", max_tokens=100)
    for event in (
        named("response.created", response=response, sequence_number=0),
        named("response.output_item.added", output_index=0, item=item, sequence_number=1),
        named("response.output_text.delta", delta="Rivers", sequence_number=2, **at),
    ):
        tape.keep(event)
    said = tape.said()
    assert (said.text, said.sequence) == ("Rivers", 3)
    answer = ResponsesAnswer(said)
    (delta,) = answer.chunk(chat_chunk(" flow"))
    assert delta == {"type": "response.output_text.delta", "sequence_number": 3, **at, "delta": " flow", "logprobs": []}
    answer.chunk(chat_chunk(None, finish="stop"))
    end = answer.chunk(chat_chunk(usage={"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}))
    assert [event["sequence_number"] for event in end] == [4, 5, 6, 7]
    completed = end[-1]["response"]
    assert completed["status"] == "completed" and completed["output"][0]["content"][0]["text"] == "Rivers flow"
    assert completed["usage"]["input_tokens"] == 8 and completed["usage"]["output_tokens"] == 2


def test_with_a_local_tokenizer_the_continuation_is_a_completion_of_the_prompt_and_the_text_said() -> None:
    body = {"model": "m", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    said = messages_tape(MESSAGE_START, text_delta("Rivers"), text_delta(" flow")).said()
    chat = chat_continuation(parse_request("messages", orjson.dumps(body)), said, with_ids=False)
    assert chat is not None and said_text(chat) == "Rivers flow"
    completion = by_ids(chat, [1, 2, 3, 40, 41])
    assert completion.kind == "completion" and completion.stream
    assert completion.body["prompt"] == [1, 2, 3, 40, 41] and completion.body["max_tokens"] == 38
    assert not {"messages", "add_generation_prompt", "continue_final_message"} & set(completion.body)
    answer = MessagesAnswer(said)
    (delta,) = answer.chunk({"choices": [{"index": 0, "text": " to", "finish_reason": None}]})
    assert delta["delta"] == {"type": "text_delta", "text": " to"}, "a text completion's chunks are read too"
