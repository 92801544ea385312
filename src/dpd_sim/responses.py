"""`POST /v1/responses`: the OpenAI Responses API as vLLM 0.32 serves it by default (nothing stored), over
the engine's chat endpoint: the instructions and input items as chat messages, the answer as a response
object (its `kv_transfer_params` included) or as the API's named events."""

from __future__ import annotations

import time
from typing import Any

import orjson

from dpd_sim.adapted import AdaptedEndpoint
from dpd_sim.completion_request import InvalidRequest
from dpd_sim.core import EngineCore
from dpd_sim.openai_format import error_body


class ResponsesApi:
    """The Responses API over chat, as vLLM maps it."""

    @staticmethod
    def chat_request(body: dict[str, Any]) -> dict[str, Any]:
        given = body.get("input")
        if not isinstance(given, str | list):
            raise InvalidRequest("1 validation error:\n  body.input: Field required", param="input")
        if body.get("previous_response_id") is not None:
            raise _NotFound(str(body["previous_response_id"]))
        conversation: list[dict[str, Any]] = []
        if body.get("instructions"):
            conversation.append({"role": "system", "content": body["instructions"]})
        if isinstance(given, str):
            conversation.append({"role": "user", "content": given})
        else:
            conversation.extend(_chat_message(item) for item in given)
        chat: dict[str, Any] = {"messages": conversation}
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        for name in ("model", "temperature", "top_p", "seed", "kv_transfer_params"):
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("stream"):
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return chat

    @staticmethod
    def error(error_type: str, message: str, status: int) -> bytes:
        return error_body(message, error_type, status)

    @staticmethod
    def whole(answer: dict[str, Any], body: dict[str, Any]) -> bytes:
        choice = answer["choices"][0]
        text = (choice.get("message") or {}).get("content") or ""
        response = _response(
            body, answer["id"], _status(choice.get("finish_reason")), [_output_message(answer["id"], text)]
        )
        response["usage"] = _usage(answer.get("usage"))
        response["kv_transfer_params"] = answer.get("kv_transfer_params")
        return orjson.dumps(response)

    @staticmethod
    def stream(body: dict[str, Any]) -> StreamedResponse:
        return StreamedResponse(body)


def responses_endpoint(core: EngineCore) -> AdaptedEndpoint:
    return AdaptedEndpoint(core, ResponsesApi())


class _NotFound(InvalidRequest):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param="response_id")


def _chat_message(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InvalidRequest("1 validation error:\n  body.input: Input should be a valid list of items")
    kind = item.get("type")
    if kind == "function_call":
        call = {"name": item.get("name"), "arguments": item.get("arguments")}
        return {"role": "assistant", "tool_calls": [{"id": item.get("call_id"), "type": "function", "function": call}]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if "role" not in item:
        raise InvalidRequest(f"Unsupported input item type: {kind}", param="input")
    content = item.get("content")
    if isinstance(content, list):  # input_text and output_text parts: their text, as the template reads it
        content = "\n".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return {"role": item["role"], "content": content}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _output_message(response_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content: list[dict[str, Any]] = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}] if text else []
    )
    return {"id": f"msg_{response_id}", "type": "message", "role": "assistant", "status": status, "content": content}


def _response(body: dict[str, Any], chat_id: str, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": "resp_" + chat_id.removeprefix("chatcmpl-"),
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model"),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata"),
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "store": False,  # vLLM's default: store is ignored unless the engine was started to keep responses
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": None,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


class StreamedResponse:
    """The chat endpoint's stream, rewritten as the Responses API's events: created and in progress, the
    message item and its text part opened, a delta a token, both closed, then completed with the usage."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._body = body
        self._sequence = 0
        self._id = ""
        self._text: list[str] = []
        self._finish: str | None = None

    def event(self, data: bytes) -> bytes:
        if data == b"[DONE]":
            return b""
        chunk = orjson.loads(data)
        if "error" in chunk:
            return self._event(
                "error", {"code": "internal_error", "message": chunk["error"].get("message"), "param": None}
            )
        out = b""
        if not self._id:
            self._id = chunk["id"]
            response = _response(self._body, self._id, "in_progress", [])
            out += self._event("response.created", {"response": response})
            out += self._event("response.in_progress", {"response": response})
            out += self._event("response.output_item.added", {"output_index": 0, "item": self._item("in_progress")})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event("response.content_part.added", self._at({"part": part}))
        if not chunk["choices"]:  # the usage chunk: the end
            return out + self._done(chunk.get("usage"))
        choice = chunk["choices"][0]
        self._finish = choice.get("finish_reason") or self._finish
        text = (choice.get("delta") or {}).get("content")
        if text:
            self._text.append(text)
            out += self._event("response.output_text.delta", self._at({"delta": text, "logprobs": []}))
        return out

    def _done(self, usage: dict[str, Any] | None) -> bytes:
        text = "".join(self._text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = self._item("completed")
        response = _response(self._body, self._id, _status(self._finish), [item])
        response["usage"] = _usage(usage)
        return b"".join(
            (
                self._event("response.output_text.done", self._at({"text": text, "logprobs": []})),
                self._event("response.content_part.done", self._at({"part": part})),
                self._event("response.output_item.done", {"output_index": 0, "item": item}),
                self._event("response.completed", {"response": response}),
            )
        )

    def _item(self, status: str) -> dict[str, Any]:
        return _output_message(self._id, "".join(self._text) if status == "completed" else "", status)

    def _at(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": f"msg_{self._id}", "output_index": 0, "content_index": 0, **fields}

    def _event(self, name: str, fields: dict[str, Any]) -> bytes:
        payload = {"type": name, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
