"""What a chat template renders of a chat body: the conversation (content parts flattened to text, as vLLM
does), the tools and the template's arguments. Shared by the router's own renders and its render workers
(template_sandbox), which must make the same text of the same body."""

from __future__ import annotations

from typing import Any

from dpd_router.request.client_request import TEXT_PART_TYPES


def _text_of_content(content: Any) -> Any:
    """Chat templates expect strings; flatten OpenAI content-part arrays to their text, one part per
    line, as vLLM does before it applies the template (plain strings in the array are text parts)."""
    if isinstance(content, list):
        return "\n".join(
            part if isinstance(part, str) else part.get("text") or ""
            for part in content
            if isinstance(part, str) or (isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES)
        )
    return content


_RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "tools", "tokenize", "return_dict", "return_tensors", "chat_template"}
)


def client_template(body: dict[str, Any]) -> str | None:
    """The chat template a chat request brought, as vLLM reads it: `chat_template`, else
    `chat_template_kwargs.chat_template`."""
    kwargs = body.get("chat_template_kwargs")
    template = body.get("chat_template")
    if template is None and isinstance(kwargs, dict):
        template = kwargs.get("chat_template")
    return template if isinstance(template, str) else None


def template_inputs(body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """What the tokenizer's template renders of a chat body: its conversation, its tools, the template's
    arguments. None of them are fields the router changes, so the body's bytes as they came render
    the same text (TemplateSandbox.render_body)."""
    return _conversation(body), body.get("tools"), _template_kwargs(body)


def _conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**message, "content": _text_of_content(message.get("content"))} for message in body["messages"]]


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
    }
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, dict):
        kwargs.update({k: v for k, v in extra.items() if k not in _RESERVED_TEMPLATE_ARGS})
    return kwargs
