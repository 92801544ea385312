"""A Messages body as the router reads it: checked where vLLM would refuse it, converted to the chat body
vLLM's template renders, cut to a one-token prefill; its usage counted."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from dpd_router.messages.api import template_body, usage_counts
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import InvalidRequest
from dpd_router.transfer.base import one_token_body, prefill_usage
from dpd_router.transfer.nixl import prefill_body

# As vLLM writes a tool call's arguments (json.dumps' separators), and an input schema given no type.
CALL_ARGUMENTS = json.dumps({"city": "Paris"})
OBJECT_SCHEMA = {"type": "object", "properties": {}}


def parsed(body: dict[str, Any], **kwargs: Any):
    return parse_request("messages", orjson.dumps(body), **kwargs)


def test_tool_turns_become_the_chat_conversation_vllm_renders() -> None:
    body = {
        "max_tokens": 8,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: abc"}, {"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "Sunny"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        "tools": [{"name": "weather", "description": "Forecast", "input_schema": {"properties": {}}}],
    }
    chat = template_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "reasoning": "use the tool",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny"},  # ahead of the user's own words
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Forecast",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    request = parsed(body)
    assert request.template_body == chat and request.batch_size == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": "hi"}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": 4, "messages": [{"role": {"a": 1}, "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0]"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "system": 3}, "system"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {}},
            "kv_transfer_params",
        ),
    ],
)
def test_what_vllm_refuses_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parsed(body)
    assert refused.value.param == param


def test_count_tokens_needs_no_max_tokens_and_unknown_fields_pass() -> None:
    request = parsed({"messages": [{"role": "user", "content": "hi"}], "metadata": {"user_id": "u"}}, counting=True)
    assert request.body["metadata"] == {"user_id": "u"}


def test_the_prefill_is_one_token_not_streamed_with_the_kv_request_and_no_openai_fields() -> None:
    request = parsed({"max_tokens": 300, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    body = prefill_body(request)
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert "return_token_ids" not in body and "max_completion_tokens" not in body
    assert one_token_body(request)["messages"] == request.body["messages"]


def test_a_messages_usage_counts_the_whole_prompt() -> None:
    usage = {"input_tokens": 20, "cache_read_input_tokens": 256, "cache_creation_input_tokens": 4, "output_tokens": 1}
    assert usage_counts(usage) == (280, 256, 1)
    assert prefill_usage({"usage": usage}) == (280, 256)
    assert prefill_usage({"usage": {"input_tokens": 9, "output_tokens": 1}}) == (9, 0)
