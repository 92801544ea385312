"""Text-completion answers turned into chat answers, as vLLM would have written them.

LMCache's decoder is asked for a plain `/v1/completions` continuation even when the client asked
`/v1/chat/completions`; these functions give the client back `chat.completion.chunk` events and a
`chat.completion` body. Fields a chat answer does not have (`text`, `prompt_logprobs`) are dropped;
usage and anything unknown at the top level pass through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_TOP_LEVEL_DROPPED = ("prompt_logprobs", "prompt_token_ids", "kv_transfer_params")


def chat_id(completion_id: Any) -> str:
    """`cmpl-X` -> `chatcmpl-X`, the id a chat answer carries."""
    text = str(completion_id or "")
    return "chat" + text if text.startswith("cmpl-") else text


def role_chunk(*, response_id: str, created: int, model: str) -> dict[str, Any]:
    """The opening event of a chat stream: the assistant's role, no content yet."""
    return chat_chunk(response_id=response_id, created=created, model=model, delta={"role": "assistant", "content": ""})


def chat_chunk(
    *,
    response_id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def chunk_to_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """One `text_completion` stream event as a `chat.completion.chunk` (an error event stays as it is)."""
    return _to_chat(payload, "chat.completion.chunk", _chunk_choice)


def _to_chat(
    payload: dict[str, Any], kind: str, convert_choice: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """`payload` (a `text_completion` event or body) as the chat object `kind`, each choice converted."""
    if "error" in payload or not isinstance(payload.get("choices"), list):
        return payload
    converted = {key: value for key, value in payload.items() if key not in _TOP_LEVEL_DROPPED}
    converted["object"] = kind
    converted["id"] = chat_id(payload.get("id"))
    converted["choices"] = [convert_choice(choice) for choice in payload["choices"] if isinstance(choice, dict)]
    return converted


def _chunk_choice(choice: dict[str, Any]) -> dict[str, Any]:
    text = choice.get("text")
    converted: dict[str, Any] = {
        "index": choice.get("index", 0),
        "delta": {"content": text} if text else {},
        "logprobs": None,
        "finish_reason": choice.get("finish_reason"),
    }
    if "stop_reason" in choice:
        converted["stop_reason"] = choice["stop_reason"]
    return converted


def body_to_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """A whole `text_completion` answer as a `chat.completion` (an error body stays as it is)."""
    return _to_chat(payload, "chat.completion", _body_choice)


def _body_choice(choice: dict[str, Any]) -> dict[str, Any]:
    converted: dict[str, Any] = {
        "index": choice.get("index", 0),
        "message": {"role": "assistant", "content": choice.get("text") or "", "tool_calls": []},
        "logprobs": None,
        "finish_reason": choice.get("finish_reason"),
    }
    if "stop_reason" in choice:
        converted["stop_reason"] = choice["stop_reason"]
    return converted
