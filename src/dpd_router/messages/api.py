"""The Anthropic Messages API (`POST /v1/messages`) as the router carries it.

vLLM serves `/v1/messages` itself, with `kv_transfer_params` on the request and on its whole answer, so
both hops send the client's body to the engines' own endpoint and relay what they answer. The router
needs two things of its own: the chat conversation the engine's template will render of the body (the
threshold counts its tokens, and `/v1/messages/count_tokens` answers with them), and errors in the
shape the anthropic clients read on this endpoint.

Only what the router acts on is checked; every other field (tools, thinking, metadata, top_k, what a
later vLLM adds) goes to the engine, which answers for it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from dpd_router.request.errors import InvalidRequest

ROLES = frozenset({"user", "assistant", "system"})
# Claude Code's system prompt starts with a header that changes each request; vLLM leaves it out of the
# prompt (it would defeat prefix caching), so the router does too.
_BILLING_HEADER = "x-anthropic-billing-header"

# The error types the anthropic clients know, by the status the router answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error")


def error_body(status: int, message: str) -> bytes:
    """An error as the Messages API writes one: `{"type": "error", "error": {"type", "message"}}`."""
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


def error_event(message: str) -> bytes:
    """An in-band error for a stream the client has already seen events of (the API's own `error` event)."""
    payload = orjson.dumps({"type": "error", "error": {"type": "api_error", "message": message}})
    return b"event: error\ndata: " + payload + b"\n\n"


def check_body(body: dict[str, Any], *, counting: bool = False) -> None:
    """Refuse what vLLM's Messages endpoint would refuse among the fields the router reads: the messages,
    the system prompt and (except to count tokens) `max_tokens`; raise InvalidRequest naming the field."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' is a required array of messages.", param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object.", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(f"{where}.role must be one of 'user', 'assistant', 'system'.", param=f"{where}.role")
        _check_content(message.get("content"), f"{where}.content", required=True)
    _check_content(body.get("system"), "system", required=False)
    if not counting:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise InvalidRequest("'max_tokens' is a required property.", param="max_tokens")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise InvalidRequest("'tools' must be an array of tool objects.", param="tools")


def _check_content(content: Any, where: str, *, required: bool) -> None:
    if content is None and not required:
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or an array of content blocks.", param=where)
    for number, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            at = f"{where}[{number}]"
            raise InvalidRequest(f"{at} must be a content block with a 'type'.", param=at)
        for name in ("text", "thinking"):
            value = block.get(name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequest(f"{where}[{number}].{name} must be a string.", param=f"{where}[{number}].{name}")


def template_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body the engine renders a Messages body as: its conversation (system prompt first, tool
    calls and results as chat's), its tools as functions, the template's arguments. vLLM converts the body
    so before its chat template renders it; the router's count must be of the same text."""
    conversation: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        conversation.append({"role": "system", "content": system})
    for message in body["messages"]:
        _convert_message(message, conversation)
    chat: dict[str, Any] = {"messages": conversation}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [_function(tool) for tool in tools]
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    return chat


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        return ""
    return "".join(
        block["text"]
        for block in system
        if block.get("type") == "text" and block.get("text") and not block["text"].startswith(_BILLING_HEADER)
    )


def _convert_message(message: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
    role, content = message["role"], message["content"]
    if role == "system":
        text = content if isinstance(content, str) else _system_text(content)
        if text and not text.startswith(_BILLING_HEADER):
            conversation.append({"role": "system", "content": text})
        return
    if isinstance(content, str):
        conversation.append({"role": role, "content": content})
        return
    converted: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})  # as vLLM writes them: the template sees this text
            call = {"name": block.get("name") or "", "arguments": arguments}
            tool_calls.append({"id": block.get("id") or "", "type": "function", "function": call})
        elif kind == "tool_result" and role == "user":
            # A result becomes a tool message of its own, ahead of what else the user message says.
            conversation.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": _result_text(block)}
            )
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if len(parts) == 1:
        converted["content"] = parts[0]["text"] if parts[0]["type"] == "text" else parts
    elif parts:
        converted["content"] = parts
    if role == "user" and "content" not in converted:
        return  # only tool results: they are the tool messages already added
    conversation.append(converted)


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(item.get("text", "")) for item in content if isinstance(item, dict) and item.get("type") == "text"
        )
    return ""


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url") or "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    schema = tool.get("input_schema")
    parameters = {"type": "object", **schema} if isinstance(schema, dict) and "type" not in schema else schema
    function = {"name": tool.get("name"), "description": tool.get("description"), "parameters": parameters}
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def usage_counts(usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, cached prompt tokens, output tokens) of a Messages usage block: the API counts the
    prompt as `input_tokens` (uncached) plus `cache_read_input_tokens` and `cache_creation_input_tokens`."""
    uncached, read = _count(usage, "input_tokens"), _count(usage, "cache_read_input_tokens")
    prompt = None if uncached is None else uncached + (read or 0) + (_count(usage, "cache_creation_input_tokens") or 0)
    return prompt, read, _count(usage, "output_tokens")


def reconcile_cached(usage: dict[str, Any], cached_tokens: int) -> bool:
    """Report the prefiller's cache hit in place of the decoder's (which counts the transferred KV as
    read from cache); the uncached `input_tokens` change with it. True when the block was changed."""
    prompt, read, _ = usage_counts(usage)
    if prompt is None or read is None or read == cached_tokens:
        return False
    created = _count(usage, "cache_creation_input_tokens") or 0
    usage["cache_read_input_tokens"] = cached_tokens
    usage["input_tokens"] = max(prompt - cached_tokens - created, 0)
    return True


def _count(usage: dict[str, Any], name: str) -> int | None:
    value = usage.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
