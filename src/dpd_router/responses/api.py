"""The OpenAI Responses API (`POST /v1/responses`): what the router reads of a body, and the chat conversation
the engine renders it as.

vLLM serves `/v1/responses` itself, `kv_transfer_params` on the request and on its whole answer, so both
hops send the client's body to the engines' own endpoint, as for chat. What the router adds: the chat
conversation the engine renders of the instructions, input items and tools (the threshold counts its
tokens), and the history: stored responses and `previous_response_id` are the router's
(responses.history), and every engine is sent `store: false`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from dpd_router.request.errors import InvalidRequest


class Keeper(Protocol):
    """What keeps a turn's ended response (responses.history.ResponsesHistory)."""

    async def keep(self, turn: Turn, response: dict[str, Any]) -> None: ...


@dataclass
class Turn:
    """One Responses request the router keeps or continues: who asked (a stored response is its API key's
    alone), whether to keep it, what it continued and its own input (responses.history)."""

    history: Keeper
    owner: str
    store: bool
    previous: str | None
    own_input: list[Any]
    final: dict[str, Any] | None = field(default=None, repr=False)
    # The id a kept response is stored and answered under: the router's own, so no engine's choice (vLLM
    # takes a body's `request_id` as its response's id) can name another caller's response.
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    _kept: bool = field(default=False, repr=False)

    def seen(self, response: dict[str, Any], *, ended: bool) -> bool:
        """The answer's response object passing by (whole, or in a stream's event): tell it the client's
        `store` and `previous_response_id`, and hold it to keep once it has `ended` (completed or
        incomplete, not failed). True when it was changed."""
        changed = False
        if self.store and response.get("id") != self.id:
            response["id"] = self.id
            changed = True
        if response.get("store") is not self.store:
            response["store"] = self.store
            changed = True
        if self.previous is not None and response.get("previous_response_id") != self.previous:
            response["previous_response_id"] = self.previous
            changed = True
        if ended and self.store and response.get("status") in ("completed", "incomplete"):
            self.final = response
        return changed

    async def settle(self) -> None:
        """Keep the ended response, once (the relay calls this before it sends the answer's end)."""
        if self.final is None or self._kept:
            return
        self._kept = True
        await self.history.keep(self, self.final)


def check_body(body: dict[str, Any]) -> None:
    """Refuse what the router cannot carry, and what vLLM would refuse among the fields it reads."""
    given = body.get("input")
    if given is None:
        raise InvalidRequest("'input' is a required property.", param="input")
    if not isinstance(given, str | list):
        raise InvalidRequest("'input' must be a string or an array of input items.", param="input")
    if isinstance(given, list):
        for index, item in enumerate(given):
            if not isinstance(item, dict):
                raise InvalidRequest(f"input[{index}] must be an input item object.", param=f"input[{index}]")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string.", param="instructions")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise InvalidRequest("'tools' must be an array of tool objects.", param="tools")
    if body.get("background") is True:
        raise InvalidRequest(
            "'background' responses run on after their request and are fetched later, which dpd-router does "
            "not serve: send the request without 'background'.",
            param="background",
        )
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidRequest("'previous_response_id' must be a string.", param="previous_response_id")


def template_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body the engine renders a Responses body as: the instructions as the system message, the
    input items as chat messages (tool calls and reasoning joined to the assistant message before them),
    function tools as chat's; vLLM converts the body so before its chat template renders it."""
    conversation: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        conversation.append({"role": "system", "content": instructions})
    given = body["input"]
    if isinstance(given, str):
        conversation.append({"role": "user", "content": given})
    else:
        for item in given:
            message = _message(item, conversation[-1] if conversation else None)
            if message is not None:
                conversation.append(message)
    chat: dict[str, Any] = {"messages": conversation}
    tools = [_function(tool) for tool in body.get("tools") or () if tool.get("type") == "function"]
    if tools:
        chat["tools"] = tools
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    return chat


def _message(item: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message of one input item; None when it joined `previous` (an assistant message)."""
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        if assistant is not None and isinstance(assistant.get("tool_calls", []), list):
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        reasoning = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content)
        if text is None:
            return dict(item)  # a copy: a tool call or reasoning after it joins it, never the client's own item
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if "role" in item:
        return item
    raise InvalidRequest(f"Unsupported input item type: {kind}", param="input")


def _first_text(parts: Any) -> str | None:
    if isinstance(parts, list) and parts and isinstance(parts[0], dict):
        text = parts[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = {key: value for key, value in tool.items() if key != "type" and value is not None}
    return {"type": "function", "function": function}


def usage_counts(usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, cached prompt tokens, output tokens) of a Responses usage block, whose
    `input_tokens` count the whole prompt and `input_tokens_details.cached_tokens` its cache hit."""
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return _count(usage.get("input_tokens")), _count(cached), _count(usage.get("output_tokens"))


def reconcile_cached(usage: dict[str, Any], cached_tokens: int) -> bool:
    """Report the prefiller's cache hit in place of the decoder's; True when the block was changed."""
    details = usage.get("input_tokens_details")
    if not isinstance(details, dict) or _count(details.get("cached_tokens")) in (None, cached_tokens):
        return False
    details["cached_tokens"] = cached_tokens
    return True


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
