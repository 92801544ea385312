"""`POST /v1/messages`: the Anthropic Messages API as vLLM serves it, over the engine's chat endpoint.

vLLM turns a Messages body into a chat request, runs it, and writes the chat answer back as a message
(its `kv_transfer_params` included) or as the API's named events. The simulator does the same around
its own chat endpoint: the body converted on the way in, the answer's bytes rewritten on the way out.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from dpd_sim.adapted import AdaptedEndpoint
from dpd_sim.completion_request import InvalidRequest
from dpd_sim.core import EngineCore

_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}


class MessagesApi:
    """The Messages API over chat, as vLLM maps it."""

    @staticmethod
    def chat_request(body: dict[str, Any]) -> dict[str, Any]:
        return chat_request(body)

    @staticmethod
    def error(error_type: str, message: str, status: int) -> bytes:
        return _error(error_type, message)

    @staticmethod
    def whole(answer: dict[str, Any], body: dict[str, Any]) -> bytes:
        return _message(answer)

    @staticmethod
    def stream(body: dict[str, Any]) -> StreamedMessage:
        return StreamedMessage()


def messages_endpoint(core: EngineCore) -> AdaptedEndpoint:
    return AdaptedEndpoint(core, MessagesApi())


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Messages body is served as (what vLLM's validation refuses, refused)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("1 validation error:\n  body.messages: Field required", param="body.messages")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequest("1 validation error:\n  body.max_tokens: must be a positive integer", param="max_tokens")
    conversation: list[dict[str, Any]] = []
    system = _joined_text(body.get("system"))
    if system:
        conversation.append({"role": "system", "content": system})
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise InvalidRequest("1 validation error:\n  body.messages.role: Input should be 'user' or 'assistant'")
        conversation.extend(_chat_messages(message))
    chat: dict[str, Any] = {"messages": conversation, "max_tokens": max_tokens}
    for name in ("model", "temperature", "top_p", "top_k", "kv_transfer_params", "seed"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def _joined_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(
        block.get("text") or "" for block in content if isinstance(block, dict) and block.get("type") == "text"
    )


def _chat_messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Messages message as chat messages: tool results as tool messages ahead of the rest."""
    role, content = message["role"], message.get("content")
    if isinstance(content, str) or role == "system":
        text = _joined_text(content)
        return [{"role": role, "content": text}] if text or role != "system" else []
    if not isinstance(content, list):
        raise InvalidRequest("1 validation error:\n  body.messages.content: Input should be a valid string or list")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and block.get("text"):
            texts.append(block["text"])
        elif kind == "tool_use":
            function = {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}
            calls.append({"id": block.get("id") or "", "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            text = (
                result
                if isinstance(result, str)
                else "\n".join(
                    item.get("text", "")
                    for item in result or []
                    if isinstance(item, dict) and item.get("type") == "text"
                )
            )
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text})
    chat: dict[str, Any] = {"role": role}
    if calls:
        chat["tool_calls"] = calls
    if len(texts) == 1:
        chat["content"] = texts[0]
    elif texts:
        chat["content"] = [{"type": "text", "text": text} for text in texts]
    if role == "assistant" or "content" in chat:
        out.append(chat)
    return out


def _error(error_type: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": error_type, "message": message}})


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's Messages usage: the prompt's uncached tokens, its cache hits, the output."""
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    answer: dict[str, Any] = {"output_tokens": usage.get("completion_tokens") or 0}
    prompt = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        answer["cache_read_input_tokens"] = details["cached_tokens"]
        prompt -= details["cached_tokens"]
    answer["input_tokens"] = max(prompt, 0)
    return answer


def _stop_reason(finish_reason: str | None, stop_reason: Any) -> tuple[str | None, str | None]:
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason or ""), None


def _message(payload: dict[str, Any]) -> bytes:
    choice = payload["choices"][0]
    stop_reason, stop_sequence = _stop_reason(choice.get("finish_reason"), choice.get("stop_reason"))
    text = (choice.get("message") or {}).get("content") or ""
    answer = {
        "id": payload["id"],
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}] if text else [],
        "model": payload["model"],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(payload.get("usage")),
    }
    if payload.get("kv_transfer_params") is not None:
        answer["kv_transfer_params"] = payload["kv_transfer_params"]
    return orjson.dumps(answer)


class StreamedMessage:
    """The chat endpoint's stream, rewritten event by event as the Messages API's named events."""

    def __init__(self) -> None:
        self._started = False
        self._block_open = False
        self._finish: tuple[str | None, Any] = (None, None)

    def event(self, data: bytes) -> bytes:
        if data == b"[DONE]":
            return self._close_block() + _event("message_stop", {"type": "message_stop"})
        chunk = orjson.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            return _event("error", {"type": "error", "error": {"type": "api_error", "message": error.get("message")}})
        out = b""
        if not self._started:
            self._started = True
            message = {
                "id": chunk["id"],
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": chunk["model"],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _usage(chunk.get("usage")),
            }
            out += _event("message_start", {"type": "message_start", "message": message})
        if not chunk["choices"]:  # the usage chunk: the message's end
            stop_reason, stop_sequence = _stop_reason(*self._finish)
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            usage = _usage(chunk.get("usage"))
            return (
                out
                + self._close_block()
                + _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            )
        choice = chunk["choices"][0]
        if choice.get("finish_reason") is not None:
            self._finish = (choice["finish_reason"], choice.get("stop_reason"))
        text = (choice.get("delta") or {}).get("content")
        if text:
            if not self._block_open:
                self._block_open = True
                block: dict[str, Any] = {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
                out += _event("content_block_start", block)
            token = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
            out += _event("content_block_delta", token)
        return out

    def _close_block(self) -> bytes:
        if not self._block_open:
            return b""
        self._block_open = False
        return _event("content_block_stop", {"type": "content_block_stop", "index": 0})


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
