"""A stream's tape (the ids it generated, cut out of what the client sees) and its continuation's request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import pytest

from dpd_router.gateway.answer import StreamedAnswer
from dpd_router.gateway.policy import PhaseTimeouts
from dpd_router.gateway.relay import EventStream
from dpd_router.gateway.resume import ResumePolicy, Resumer, StreamTape, why_not
from dpd_router.gateway.resume_text import named_event
from dpd_router.gateway.wires import MESSAGES_WIRE, OPENAI_WIRE
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Ending, Output, RequestTrace
from dpd_router.request.client_request import parse_request
from tests.unit.test_responses_api import Keeper


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload)


def chat_chunk(content: str, ids: list[int] | None, *, prompt: list[int] | None = None, finish: Any = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    payload: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    payload["choices"] = [choice]
    if prompt is not None:
        payload["prompt_token_ids"] = prompt
    return event(payload)


def test_the_tape_keeps_the_prompt_and_output_ids_and_cuts_them_out_of_what_the_client_sees() -> None:
    tape = StreamTape(strip=True, max_tokens=100)
    sent = [
        tape.keep(chat_chunk("", None, prompt=[1, 2, 3])),
        tape.keep(chat_chunk(' "token_ids":[9] is text', [11])),
        tape.keep(chat_chunk(" river", [12, 13])),
    ]
    assert tape.prompt_ids() == [1, 2, 3] and tape.output_ids() == [11, 12, 13] and tape.tokens == 6
    payloads = [orjson.loads(chunk[len(b"data: ") :]) for chunk in sent]
    assert payloads[0]["prompt_token_ids"] is None, "as vLLM writes it unasked"
    assert all(p["choices"][0]["token_ids"] is None for p in payloads[1:])
    assert payloads[1]["choices"][0]["delta"]["content"] == ' "token_ids":[9] is text', "text is never cut"
    assert not tape.finished
    tape.keep(chat_chunk("", [2], finish="stop"))
    assert tape.finished


def test_a_tape_the_client_asked_for_ids_of_keeps_them_in_the_events() -> None:
    tape = StreamTape(strip=False, max_tokens=100)
    chunk = chat_chunk(" a", [5], prompt=[1])
    assert tape.keep(chunk) == chunk and tape.output_ids() == [5]


@pytest.mark.parametrize(
    "raw",
    [
        b'data: {"token_ids":[4,5],"a":1}',
        b'data: {"a":1,"token_ids": [4,5]}',
        b'data: {"a":1,"token_ids":[4,5],"b":2}',
        b'data: {"token_ids":[4,5]}',
    ],
)
def test_ids_are_cut_wherever_the_field_stands(raw: bytes) -> None:
    tape = StreamTape(strip=True, max_tokens=100)
    tape.keep(chat_chunk("", None, prompt=[1]))
    kept = orjson.loads(tape.keep(raw)[len(b"data: ") :])
    assert tape.output_ids() == [4, 5]
    assert kept["token_ids"] is None and kept == {**orjson.loads(raw[len(b"data: ") :]), "token_ids": None}


def test_errored_or_parsed_output_is_told_apart() -> None:
    tape = StreamTape(strip=True, max_tokens=100)
    tape.keep(chat_chunk("", None, prompt=[1]))
    tape.keep(b'data: {"choices":[{"finish_reason":"error","token_ids":null}]}')
    assert not tape.output and not tape.finished, "an error is no finish"
    tape.keep(b'data: {"choices":[{"delta":{"reasoning":"hm"},"token_ids":[3]}]}')
    assert tape.parsed


def test_an_engine_that_returns_no_ids_turns_the_tape_off_at_its_first_event() -> None:
    for first in (chat_chunk("", None), b'data: {"prompt_token_ids":null,"choices":[]}'):
        tape = StreamTape(strip=True, max_tokens=100)
        tape.keep(first)
        later = chat_chunk(" a", [4])
        assert tape.off and tape.prompt is None and tape.keep(later) == later and not tape.output


def test_past_its_bound_a_tape_keeps_nothing() -> None:
    tape = StreamTape(strip=True, max_tokens=4)
    tape.keep(chat_chunk("", None, prompt=[1, 2, 3]))
    tape.keep(chat_chunk(" a", [4]))
    assert not tape.over
    tape.keep(chat_chunk(" b", [5]))
    assert tape.over and not tape.output


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({}, None),
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "structured_output"),
        ({"response_format": {"type": "text"}}, None),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, None),
        ({"logprobs": True}, "logprobs"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_output"),
    ],
)
def test_what_cannot_be_continued_faithfully_is_named(body: dict[str, Any], reason: str | None) -> None:
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, **body})
    assert why_not(parse_request("chat", raw)) == reason


def resumer_of(body: dict[str, Any], kind: str = "chat", left: int = 1) -> tuple[Resumer, ResumePolicy, Any]:
    request = parse_request(kind, orjson.dumps(body))  # type: ignore[arg-type]
    policy = ResumePolicy.arm(request, left=left, max_tokens=1000)

    async def never(*_: Any) -> Any:
        raise AssertionError("not opened here")

    resumer = Resumer(
        request, "r", time.perf_counter(), Ending(), Output(), policy, None, RouterMetrics(), open=never,
        timeouts=PhaseTimeouts(),
        strip_usage=False,
    )  # fmt: skip
    return resumer, policy, request


def test_the_continuation_is_a_completion_of_the_ids_for_the_tokens_left() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 10,
        "min_tokens": 4,
        "temperature": 0.7,
        "stop": ["\n\n"],
        "stream": True,
        "chat_template_kwargs": {"x": 1},
    }
    resumer, policy, request = resumer_of(body)
    assert request.body["return_token_ids"] is True and policy.strip_ids
    assert resumer.tape is not None
    resumer.tape.keep(chat_chunk("", None, prompt=[1, 2]))
    resumer.tape.keep(chat_chunk(" a", [7]))
    resumer.tape.keep(chat_chunk(" b", [8, 9]))
    assert resumer.why_not(saw_output=True) is None
    continuation = resumer.continuation()
    assert continuation is not None and continuation.kind == "completion" and continuation.stream
    sent = continuation.body
    assert sent["prompt"] == [1, 2, 7, 8, 9] and sent["max_tokens"] == 7 and sent["min_tokens"] == 1
    assert sent["temperature"] == 0.7 and sent["stop"] == ["\n\n"] and sent["model"] == "m"
    assert sent["stream_options"] == {"include_usage": True}
    assert not {"messages", "max_completion_tokens", "chat_template_kwargs"} & set(sent)
    assert sent["return_token_ids"] is False, "no continuation is left after this one"


def test_a_stream_whose_output_took_its_whole_budget_has_nothing_to_continue() -> None:
    resumer, _, _ = resumer_of({"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}, kind="completion")
    assert resumer.tape is not None
    resumer.tape.keep(b'data: {"choices":[{"text":" a","prompt_token_ids":[1],"token_ids":[5,6]}]}')
    assert resumer.continuation() is None


def test_a_continuations_usage_counts_the_prompt_once_and_every_output_token() -> None:
    resumer, _, _ = resumer_of({"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True}, kind="completion")
    assert resumer.tape is not None
    resumer.tape.keep(
        b'data: {"id":"cmpl-1","created":3,"choices":[{"text":" a","prompt_token_ids":[1,2],"token_ids":[5,6]}]}'
    )
    resumer.tape.seen({"id": "cmpl-1", "created": 3, "model": "m"})
    assert resumer.continuation() is not None
    usage = {
        "prompt_tokens": 4,
        "completion_tokens": 7,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    rewritten = resumer._rewrite(event({"id": "cmpl-9", "created": 8, "choices": [], "usage": usage}), None)
    payload = orjson.loads(rewritten[len(b"data: ") :])
    assert payload["id"] == "cmpl-1" and payload["created"] == 3
    assert payload["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 9,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_streams_that_cannot_be_continued_ask_for_no_ids() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    resumer, policy, request = resumer_of(body)
    assert policy.blocked == "n" and "return_token_ids" not in request.body and resumer.tape is None
    assert resumer.why_not(saw_output=True) == "n"
    _, policy, request = resumer_of({**body, "n": 1}, left=0)
    assert policy.blocked == "disabled" and "return_token_ids" not in request.body


async def relayed_with_a_resumer(
    open_continuation: Any,
    sent: Sequence[bytes] | None = None,
    *,
    strip_usage: bool = False,
    kind: str = "chat",
    left: int = 1,
    blocked: str | None = None,
) -> tuple[bytes, RequestTrace, RouterMetrics]:
    """A `kind` stream (chat, or messages) whose decoder sends `sent` (by default the prompt's ids and two
    tokens), then breaks, relayed with a Resumer (`left` continuations, or `blocked`) whose continuation
    `open_continuation` serves."""
    if sent is None:
        sent = (chat_chunk("", None, prompt=[1, 2]), chat_chunk(" a", [7]) + b"\n\n" + chat_chunk(" b", [8]))

    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            for chunk in sent:
                yield chunk + b"\n\n"
            raise httpx.ReadError("reset")

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    request = parse_request(kind, orjson.dumps(body))
    policy = ResumePolicy.arm(request, left=left, max_tokens=1000, blocked=blocked)
    trace, output, ending = RequestTrace(request_id="r", kind=kind, stream=True), Output(), Ending()
    metrics = RouterMetrics()
    wire = MESSAGES_WIRE if kind == "messages" else OPENAI_WIRE
    resumer = Resumer(
        request, "r", trace.started, ending, output, policy, None, metrics, open=open_continuation,
        timeouts=PhaseTimeouts(),
        strip_usage=strip_usage, wire=wire,
    )  # fmt: skip
    stream = EventStream(
        httpx.Response(200, stream=Broken()), ending, output, cached_tokens=None,
        on_close=lambda: trace.take(output, ending=ending), idle_timeout=5, resumer=resumer, wire=wire,
        strip_usage=strip_usage,
    )  # fmt: skip
    await stream.prime(asyncio.get_running_loop().time() + 5)
    return b"".join([chunk async for chunk in stream]), trace, metrics


async def test_a_broken_stream_goes_on_from_the_continuation_in_the_clients_api() -> None:
    asked: list[dict[str, Any]] = []

    async def open_continuation(request: Any, failed: Any, left: int) -> tuple[Any, str]:
        asked.append(request.body)
        events = [
            event({"id": "cmpl-2", "created": 9, "choices": [{"index": 0, "text": " c", "finish_reason": None}]}),
            event({"id": "cmpl-2", "choices": [{"index": 0, "text": " d", "finish_reason": "length"}]}),
            event(
                {
                    "id": "cmpl-2",
                    "choices": [],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
                }
            ),
            b"data: [DONE]",
        ]

        async def chunks() -> Any:
            yield b"\n\n".join(events) + b"\n\n"

        async def close() -> None:
            pass

        return StreamedAnswer(chunks(), close, {}), "elsewhere (direct)"

    out, trace, metrics = await relayed_with_a_resumer(open_continuation)
    assert asked[0]["prompt"] == [1, 2, 7, 8] and asked[0]["max_tokens"] == 3
    payloads = [orjson.loads(part[len(b"data: ") :]) for part in out.split(b"\n\n") if part.startswith(b"data: {")]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p.get("choices"))
    assert text == " a b c d" and out.endswith(b"data: [DONE]\n\n") and b'"error"' not in out
    assert {p["id"] for p in payloads} == {"chatcmpl-1"}, "one answer, under the first answer's id"
    assert payloads[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert trace.outcome == "ok" and trace.continuations == 1 and "after 2 tokens" in (trace.continued_after or "")
    labels = {"api": "chat", "outcome": "continued", "reason": ""}
    assert metrics.registry.get_sample_value("dpd_router_stream_continuations_total", labels) == 1


async def test_a_continuation_that_fails_unexpectedly_still_ends_the_stream_in_band() -> None:
    async def open_continuation(request: Any, failed: Any, left: int) -> tuple[Any, str]:
        raise RuntimeError("a bug")

    out, trace, metrics = await relayed_with_a_resumer(open_continuation)
    assert out.endswith(b"data: [DONE]\n\n") and b'"error"' in out
    assert trace.outcome == "upstream_error" and "RuntimeError: a bug" in (trace.error or "")
    labels = {"api": "chat", "outcome": "failed", "reason": "error"}
    assert metrics.registry.get_sample_value("dpd_router_stream_continuations_total", labels) == 1


async def never_continued(request: Any, failed: Any, left: int) -> tuple[Any, str]:
    raise AssertionError("a complete answer is not continued")


@pytest.mark.parametrize("client_asked_usage", [True, False])
async def test_a_complete_answer_whose_decoder_broke_before_its_end_ends_as_the_decoder_would_have(
    client_asked_usage: bool,
) -> None:
    """The finish went by, then the connection broke before the usage and [DONE]: nothing to continue, and
    nothing the client lacks but the end, which the tape's counts write (no error for a complete answer)."""

    sent = (chat_chunk("", None, prompt=[1, 2, 3]), chat_chunk(" a", [7]), chat_chunk(" b", [8], finish="stop"))
    out, trace, metrics = await relayed_with_a_resumer(never_continued, sent, strip_usage=not client_asked_usage)
    assert out.endswith(b"data: [DONE]\n\n") and b'"error"' not in out
    payloads = [orjson.loads(part[len(b"data: ") :]) for part in out.split(b"\n\n") if part.startswith(b"data: {")]
    usage = [p["usage"] for p in payloads if p.get("usage")]
    assert usage == ([{"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}] if client_asked_usage else [])
    if client_asked_usage:
        assert payloads[-1]["id"] == "chatcmpl-1" and payloads[-1]["object"] == "chat.completion.chunk"
    assert trace.outcome == "ok" and (trace.engine_prompt_tokens, trace.completion_tokens) == (3, 2)
    labels = {"api": "chat", "outcome": "not_tried", "reason": "answer_complete"}
    assert metrics.registry.get_sample_value("dpd_router_stream_continuations_total", labels) == 1


@pytest.mark.parametrize("complete", [True, False])
async def test_a_complete_message_whose_decoder_broke_before_its_stop_ends_with_its_message_stop(
    complete: bool,
) -> None:
    """A Messages stream whose stop reason and usage went by (message_delta) lacks only its message_stop:
    written, not an error event; one that broke before its message_delta cannot tell its stop reason."""

    def named(kind: str, **fields: Any) -> bytes:
        return named_event({"type": kind, **fields})

    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": []}
    sent = [
        named("message_start", message={**message, "usage": {"input_tokens": 7}}),
        named("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        named("content_block_delta", index=0, delta={"type": "text_delta", "text": "hi"}),
    ]
    if complete:
        sent += [
            named("content_block_stop", index=0),
            named("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 1}),
        ]
    # Complete: nothing to continue, whatever is left. Not: none left to continue it, so it ends in error.
    out, trace, _ = await relayed_with_a_resumer(
        never_continued, sent, kind="messages", left=1 if complete else 0, blocked=None if complete else "limit"
    )
    if complete:
        assert out.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n') and b"error" not in out
        assert trace.outcome == "ok" and trace.completion_tokens == 1
    else:
        assert b"event: error" in out and trace.outcome != "ok"


async def relayed_broken_response(
    sent: Sequence[bytes], body: dict[str, Any], *, partial: bytes = b""
) -> tuple[bytes, Ending, Any, Keeper, RouterMetrics]:
    """A Responses stream the client stores, whose decoder sends the events `sent` (then `partial`, an event it
    cut short) and breaks, relayed with a Resumer that must not continue it: what the client got, how the
    request ended, its turn and what the turn kept, and the metrics."""
    from dpd_router.gateway.wires import KeptResponsesWire
    from dpd_router.responses.api import Turn

    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            for event in sent:
                yield event + b"\n\n"
            if partial:
                yield partial
            raise httpx.ReadError("reset")

    async def never(*_: Any) -> Any:
        raise AssertionError("a complete answer is not continued")

    request = parse_request("responses", orjson.dumps(body))
    keeper = Keeper()
    turn = Turn(keeper, "alice", True, None, [])  # type: ignore[arg-type]
    wire = KeptResponsesWire(turn)
    output, ending, metrics = Output(), Ending(), RouterMetrics()
    resumer = Resumer(
        request, "r", time.perf_counter(), ending, output, ResumePolicy.arm(request, left=1, max_tokens=1000), None,
        metrics, open=never, timeouts=PhaseTimeouts(), strip_usage=False, wire=wire,
    )  # fmt: skip
    stream = EventStream(
        httpx.Response(200, stream=Broken()), ending, output, cached_tokens=None, on_close=lambda: None,
        idle_timeout=5, resumer=resumer, wire=wire,
    )  # fmt: skip
    await stream.prime(asyncio.get_running_loop().time() + 5)
    return b"".join([chunk async for chunk in stream]), ending, turn, keeper, metrics


def named(kind: str, sequence: int, **fields: Any) -> bytes:
    """A Responses stream's event as its engine writes it, numbered `sequence`."""
    return named_event({"type": kind, "sequence_number": sequence, **fields})


def message_events(first: int, index: int, item: dict[str, Any], part: dict[str, Any], **extra: Any) -> list[bytes]:
    """A message item's events from its output_item.added to its output_item.done, numbered from `first`, at
    output `index`, its text "Hello" in two deltas (`extra`: fields of each delta and of the text's done)."""
    at = {"item_id": item["id"], "output_index": index, "content_index": 0}
    closed = {**item, "status": "completed", "content": [part]}
    return [
        named("response.output_item.added", first, output_index=index, item=item),
        named("response.content_part.added", first + 1, **at, part={**part, "text": ""}),
        named("response.output_text.delta", first + 2, **at, delta="Hel", **extra),
        named("response.output_text.delta", first + 3, **at, delta="lo", **extra),
        named("response.output_text.done", first + 4, **at, text="Hello", **extra),
        named("response.content_part.done", first + 5, **at, part=part),
        named("response.output_item.done", first + 6, output_index=index, item=closed),
    ]


def stored_body(max_output: int | None) -> dict[str, Any]:
    """A streamed Responses request the client stores, with its output limit if any."""
    body: dict[str, Any] = {"model": "m", "input": "hi", "stream": True, "store": True}
    if max_output is not None:
        body["max_output_tokens"] = max_output
    return body


@pytest.mark.parametrize("passed", [0, 1, 2], ids=["after its text", "after its part", "after its item"])
@pytest.mark.parametrize("max_output", [None, 2], ids=["stopped", "at the output limit"])
async def test_a_complete_response_whose_decoder_broke_before_its_end_is_completed_and_kept(
    passed: int, max_output: int | None
) -> None:
    """A Responses stream whose text was all said (its output_text.done went by) lacks only the events that
    close the part, the item and the response: written from what went by, numbered on, and the response read
    as the decoder's own would have been, so a response the client stores is kept under the router's id."""

    head = {"id": "resp_engine", "object": "response", "model": "m", "status": "in_progress", "output": []}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "Hello", "annotations": []}
    sent = [named("response.created", 0, response={**head, "usage": None}), *message_events(1, 0, item, part)]
    out, ending, turn, keeper, metrics = await relayed_broken_response(
        sent[: 6 + passed],
        stored_body(max_output),
        partial=b"event: response.comp",  # a partial event, never relayed
    )

    assert b"error" not in out and b"response.comp\n" not in out and ending.outcome == "ok"
    events = [orjson.loads(e.split(b"\ndata: ", 1)[1]) for e in out.split(b"\n\n") if e.startswith(b"event: ")]
    assert [e["type"] for e in events[6:]] == [
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ], "each closing event once: those the decoder sent, then the router's"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    completed = events[-1]["response"]
    status = "incomplete" if max_output == 2 else "completed"  # two deltas: at least two tokens
    assert completed["status"] == status and completed["id"] == turn.id
    assert completed["output"][0]["content"][0]["text"] == "Hello" and completed["output"][0]["status"] == "completed"
    assert completed["usage"] is None, "the engine told no counts before its end"
    assert [response["id"] for response in keeper.kept] == [turn.id], "kept before the client saw its end"
    labels = {"api": "responses", "outcome": "not_tried", "reason": "answer_complete"}
    assert metrics.registry.get_sample_value("dpd_router_stream_continuations_total", labels) == 1


@pytest.mark.parametrize("cut_after", ["response.output_text.done", "response.output_item.done"])
async def test_the_end_written_for_a_broken_response_is_the_one_its_decoder_would_have_sent(cut_after: str) -> None:
    """The simulated engine's Responses stream (as vLLM's: created, in progress, the item and part opened, a delta
    a token, both closed, completed), cut after `cut_after`: the events the router writes parse as the official
    client's, and the response completed is the decoder's own but for its usage (null) and what the router
    tells the client of its own (id, store)."""
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    from dpd_sim.responses import StreamedResponse

    body: dict[str, Any] = {"model": "m", "input": "hi", "stream": True, "store": True, "max_output_tokens": 16}
    engine = StreamedResponse(body)
    chunks: list[dict[str, Any]] = [
        {"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"id": "chatcmpl-7", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"id": "chatcmpl-7", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
    ]
    whole = b"".join(engine.event(orjson.dumps(chunk)) for chunk in chunks)
    events = [event for event in whole.split(b"\n\n") if event]
    cut = next(i for i, event in enumerate(events) if event.startswith(b"event: " + cut_after.encode())) + 1
    out, ending, turn, keeper, _ = await relayed_broken_response(events[:cut], body)

    sent = [orjson.loads(e.split(b"\ndata: ", 1)[1]) for e in out.split(b"\n\n") if e.startswith(b"event: ")]
    engines = [orjson.loads(e.split(b"\ndata: ", 1)[1]) for e in events]
    assert [e["type"] for e in sent] == [e["type"] for e in engines], "the events the engine would have sent"
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in sent:
        adapter.validate_python(event)  # as the official client reads each one
    completed, expected = sent[-1]["response"], engines[-1]["response"]
    assert completed["usage"] is None and ending.outcome == "ok"
    assert completed["id"] == turn.id and completed["store"] is True
    if cut_after == "response.output_text.done":
        # Its item never went by: the router's item says no logprobs as its part events do ([]), where this
        # engine's final item writes null.
        assert completed["output"][0]["content"][0].pop("logprobs") == []
        expected["output"][0]["content"][0].pop("logprobs")
    ours = {key: value for key, value in completed.items() if key not in ("id", "store", "usage")}
    assert ours == {key: value for key, value in expected.items() if key not in ("id", "store", "usage")}
    assert [response["id"] for response in keeper.kept] == [turn.id]


@pytest.mark.parametrize("passed", [0, 1, 2], ids=["after its text", "after its part", "after its item"])
@pytest.mark.parametrize("max_output", [None, 3], ids=["stopped", "at the output limit"])
async def test_a_response_that_reasoned_before_its_text_is_completed_with_its_reasoning(
    passed: int, max_output: int | None
) -> None:
    """A reasoning model's Responses stream: a reasoning item the engine closed, then the message, whose text
    was all said when the decoder broke. The response the router completes holds both items, the reasoning
    as the engine closed it and the message as the text said; each event parses as the official client's.
    Its reasoning deltas count as output: four of them reach a limit of three (incomplete)."""
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    head = {"id": "resp_engine", "object": "response", "created_at": 1, "model": "m", "status": "in_progress"}
    head |= {"output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": None}
    thought = {"id": "rs_1", "type": "reasoning", "summary": [], "status": "in_progress"}
    thought_done = {**thought, "status": "completed", "content": [{"type": "reasoning_text", "text": "Think."}]}
    in_thought = {"item_id": "rs_1", "output_index": 0, "content_index": 0}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}
    sent = [
        named("response.created", 0, response=head),
        named("response.output_item.added", 1, output_index=0, item=thought),
        named("response.reasoning_text.delta", 2, **in_thought, delta="Thi"),
        named("response.reasoning_text.delta", 3, **in_thought, delta="nk."),
        named("response.reasoning_text.done", 4, **in_thought, text="Think."),
        named("response.output_item.done", 5, output_index=0, item=thought_done),
        *message_events(6, 1, item, part, logprobs=[]),
    ]
    out, ending, turn, keeper, _ = await relayed_broken_response(sent[: 11 + passed], stored_body(max_output))

    assert b"event: error" not in out and ending.outcome == "ok"
    events = [orjson.loads(e.split(b"\ndata: ", 1)[1]) for e in out.split(b"\n\n") if e.startswith(b"event: ")]
    assert [e["type"] for e in events[11:]] == [
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in events[11:]:
        adapter.validate_python(event)
    completed = events[-1]["response"]
    assert completed["output"][0] == thought_done, "the reasoning as the engine closed it"
    assert completed["output"][1]["content"] == [part] and completed["output"][1]["id"] == "msg_1"
    assert completed["status"] == ("incomplete" if max_output == 3 else "completed")
    assert completed["id"] == turn.id and [response["id"] for response in keeper.kept] == [turn.id]


async def test_a_response_whose_reasoning_the_engine_had_not_closed_before_its_text_ends_with_an_error() -> None:
    """Where an item before the message never went by closed, what the response held cannot be told."""

    head = {"id": "resp_engine", "object": "response", "model": "m", "status": "in_progress", "output": []}
    at = {"item_id": "msg_1", "output_index": 1, "content_index": 0}
    sent = [
        named("response.created", 0, response=head),
        named("response.output_item.added", 1, output_index=0, item={"id": "rs_1", "type": "reasoning", "summary": []}),
        named("response.reasoning_text.delta", 2, item_id="rs_1", output_index=0, content_index=0, delta="Hm"),
        named("response.output_item.added", 3, output_index=1, item={"id": "msg_1", "type": "message", "content": []}),
        named("response.output_text.delta", 4, **at, delta="Hi"),
        named("response.output_text.done", 5, **at, text="Hi"),
    ]
    out, ending, *_ = await relayed_broken_response(sent, {"model": "m", "input": "hi", "stream": True})
    assert b"event: error" in out and ending.outcome != "ok"
