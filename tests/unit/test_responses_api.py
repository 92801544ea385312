"""A Responses body as the router reads it: converted to the chat conversation vLLM's template renders, sent
to every engine with store off, cut to a one-token prefill; its answer's events read for the first token,
the end and the usage."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from dpd_router.client_request import parse_request
from dpd_router.errors import InvalidRequest, ResponseNotFound
from dpd_router.gateway.relay import RESPONSES_WIRE, EventStream, relay_body
from dpd_router.observe import RequestTrace
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
        ({"input": "hi", "previous_response_id": "resp_1"}, ResponseNotFound, "response_id"),
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
    trace = RequestTrace(request_id="r", kind="responses", stream=True)
    relayed = EventStream(
        httpx.Response(200, stream=Chunks([CREATED, DELTA, DELTA, DONE_TEXT, COMPLETED])),
        trace, cached_tokens=0, on_close=lambda: None, idle_timeout=5, wire=RESPONSES_WIRE,
    )  # fmt: skip
    out = b"".join([part async for part in relayed])
    assert trace.outcome == "ok" and trace.token_chunks == 2
    assert trace.completion_tokens == 2 and trace.engine_prompt_tokens == 300
    completed = orjson.loads(out.split(b"\n\n")[-2].split(b"data: ", 1)[1])
    assert completed["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert trace.decoder_cached_tokens == 300


def test_a_whole_response_with_no_error_is_not_a_failure() -> None:
    trace = RequestTrace(request_id="r", kind="responses", stream=False)
    answer = {"id": "r", "object": "response", "status": "completed", "error": None, "usage": dict(USAGE)}
    content = relay_body(orjson.dumps(answer), trace, 10, wire=RESPONSES_WIRE)
    assert trace.outcome == "ok"
    assert orjson.loads(content)["usage"]["input_tokens_details"]["cached_tokens"] == 10
    assert prefill_usage(answer) == (300, 300)
    failed = {**answer, "status": "failed", "error": {"code": "server_error", "message": "broke"}}
    assert RESPONSES_WIRE.errored(failed) == "broke"
