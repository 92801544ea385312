"""A Responses body as the router reads it: converted to the chat conversation vLLM's template renders, sent
to every engine with store off, cut to a one-token prefill; its answer's events read for the first token,
the end and the usage."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from dpd_router.gateway.relay import EventStream, relay_body
from dpd_router.gateway.wires import RESPONSES_WIRE, KeptResponsesWire
from dpd_router.record.observe import Ending, Output
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import InvalidRequest
from dpd_router.responses.api import Turn
from dpd_router.transfer.base import prefill_usage
from dpd_router.transfer.nixl import prefill_body
from tests.unit.test_relay import Chunks


def parsed(body: dict[str, Any]):
    return parse_request("responses", orjson.dumps(body))


def test_input_items_become_the_chat_conversation_vllm_renders() -> None:
    request = parsed(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "ask the tool"}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
            ],
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": None}],
        }
    )
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
    assert request.template_body == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"role": "assistant", "reasoning": "ask the tool", "tool_calls": [call]},  # joined, as vLLM joins them
            {"role": "tool", "content": "Sunny", "tool_call_id": "c1"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
    }
    assert request.body["store"] is False and request.body_changed, "no engine stores a response"


def test_the_prefill_is_one_output_token_not_streamed_not_stored() -> None:
    body = prefill_body(parsed({"input": "hi", "max_output_tokens": 300, "stream": True}))
    assert body["max_output_tokens"] == 1 and body["stream"] is False and body["store"] is False
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert "max_tokens" not in body and "return_token_ids" not in body


@pytest.mark.parametrize(
    ("body", "error", "param"),
    [
        ({}, InvalidRequest, "input"),
        ({"input": 3}, InvalidRequest, "input"),
        ({"input": ["hi"]}, InvalidRequest, "input[0]"),
        ({"input": "hi", "background": True}, InvalidRequest, "background"),
        ({"input": "hi", "max_output_tokens": 0}, InvalidRequest, "max_output_tokens"),
        ({"input": "hi", "previous_response_id": ["x"]}, InvalidRequest, "previous_response_id"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(body: dict[str, Any], error: type, param: str) -> None:
    with pytest.raises(error) as refused:
        parsed(body)
    assert refused.value.param == param


def named(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **payload}) + b"\n\n"


USAGE = {"input_tokens": 300, "input_tokens_details": {"cached_tokens": 300}, "output_tokens": 2, "total_tokens": 302}
CREATED = named("response.created", {"response": {"id": "r", "status": "in_progress", "error": None, "usage": None}})
DELTA = named("response.output_text.delta", {"delta": "hi", "item_id": "m", "output_index": 0, "content_index": 0})
DONE_TEXT = named("response.output_text.done", {"text": "hihi"})
COMPLETED = named("response.completed", {"response": {"id": "r", "status": "completed", "error": None, "usage": USAGE}})


async def test_a_stream_is_read_for_its_tokens_and_its_usage_reconciled_at_its_end() -> None:
    ending, output = Ending(), Output()
    relayed = EventStream(
        httpx.Response(200, stream=Chunks([CREATED, DELTA, DELTA, DONE_TEXT, COMPLETED])),
        ending, output, cached_tokens=0, on_close=lambda: None, idle_timeout=5, wire=RESPONSES_WIRE,
    )  # fmt: skip
    out = b"".join([part async for part in relayed])
    assert ending.outcome == "ok" and output.token_chunks == 2
    assert output.completion_tokens == 2 and output.prompt_tokens == 300
    completed = orjson.loads(out.split(b"\n\n")[-2].split(b"data: ", 1)[1])
    assert completed["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert output.decoder_cached_tokens == 300


def test_a_whole_response_with_no_error_is_not_a_failure() -> None:
    answer = {"id": "r", "object": "response", "status": "completed", "error": None, "usage": dict(USAGE)}
    relayed = relay_body(orjson.dumps(answer), Output(), 10, wire=RESPONSES_WIRE)
    assert relayed.failure is None
    assert orjson.loads(relayed.content)["usage"]["input_tokens_details"]["cached_tokens"] == 10
    assert prefill_usage(answer) == (300, 300)
    failed = {**answer, "status": "failed", "error": {"code": "server_error", "message": "broke"}}
    assert RESPONSES_WIRE.errored(failed) == "broke"


class Keeper:
    """Records what a turn asked to keep, and what the client had been sent by then."""

    def __init__(self) -> None:
        self.kept: list[dict[str, Any]] = []
        self.sent_when_kept: list[bytes] = []
        self.sent = b""

    async def keep(self, turn: Turn, response: dict[str, Any]) -> None:
        self.kept.append(response)
        self.sent_when_kept.append(self.sent)


@pytest.mark.parametrize("chunked", [True, False], ids=["event by event", "all in the first read"])
async def test_a_kept_stream_is_stored_before_its_end_is_sent_and_says_what_the_client_asked(chunked: bool) -> None:
    keeper = Keeper()
    turn = Turn(keeper, "alice", True, "resp_before", [{"role": "user", "content": "hi"}])
    events = [CREATED, DELTA, DELTA, DONE_TEXT, COMPLETED]
    relayed = EventStream(
        httpx.Response(200, stream=Chunks(events if chunked else [b"".join(events)])),
        Ending(), Output(), cached_tokens=None, on_close=lambda: None, idle_timeout=5, wire=KeptResponsesWire(turn),
    )  # fmt: skip
    await relayed.prime(asyncio.get_running_loop().time() + 5)
    async for part in relayed:
        keeper.sent += part
    assert [kept["id"] for kept in keeper.kept] == [turn.id], "kept once, the completed response, by the router's id"
    assert turn.id.startswith("resp_") and turn.id != "r"
    assert b"response.completed" not in keeper.sent_when_kept[0], "kept before the client saw the end"
    shown = [orjson.loads(event.split(b"data: ", 1)[1]) for event in keeper.sent.split(b"\n\n") if b"data: " in event]
    for event in (shown[0], shown[-1]):
        assert event["response"]["store"] is True and event["response"]["previous_response_id"] == "resp_before"
        assert event["response"]["id"] == turn.id, "the client is told the id the response is kept under"
    assert keeper.kept[0]["store"] is True and keeper.kept[0]["previous_response_id"] == "resp_before"


def test_a_whole_answer_is_held_to_keep_and_a_failed_one_is_not() -> None:
    for status, kept in (("completed", True), ("incomplete", True), ("failed", False)):
        turn = Turn(Keeper(), "alice", True, None, [])
        answer = {"id": "r", "object": "response", "status": status, "error": None, "store": False, "usage": USAGE}
        content = relay_body(orjson.dumps(answer), Output(), None, wire=KeptResponsesWire(turn)).content
        assert orjson.loads(content)["store"] is True
        assert (turn.final is not None) is kept, status


def test_the_conversion_never_changes_the_clients_own_items() -> None:
    """They are sent to the engines and kept as the client sent them: a call joins a copy of its message."""
    assistant = {"role": "assistant", "content": []}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    request = parsed({"input": [{"role": "user", "content": "hi"}, assistant, call]})
    assert request.template_body["messages"][1]["tool_calls"][0]["id"] == "c1"
    assert request.body["input"][1] == assistant, "the body the engines get holds the item as it came"
