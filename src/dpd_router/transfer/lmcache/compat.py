"""Which requests LMCache's continuation serves exactly; the others go to the decoder alone."""

from __future__ import annotations

from typing import Any

from dpd_router.request.client_request import ClientRequest
from dpd_router.transfer.lmcache.bodies import requested_max_tokens

# The continuation cannot carry these: they change the first token's meaning (structured output,
# tool calls), need the prompt echoed, or ask for more than one sequence or for log-probabilities
# the prefiller's token would lack. Such requests are served by the decoder alone.
_UNSUPPORTED_FIELDS = (
    "tools",
    "functions",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "suffix",
    "best_of",
)
# The router renders the prompt to token ids itself, without these: a template of the request's own,
# special tokens, truncation, documents, multimodal inputs, a reasoning effort the template takes.
# Set to anything but their default, the engine would have rendered another prompt.
_PROMPT_FIELDS: dict[str, tuple[Any, ...]] = {
    "chat_template": (None,),
    "truncate_prompt_tokens": (None,),
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
    "reasoning_effort": (None,),
}
# What an engine's /tokenize is not told (the router sends it the messages alone): only a local
# tokenizer renders these as the engine's chat template would.
_TEMPLATE_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
}


def unsupported(request: ClientRequest, *, local_tokenizer: bool = True) -> str | None:
    """Why LMCache's continuation cannot serve this request exactly (None: it can).

    `local_tokenizer`: whether the router renders chat prompts with the model's own tokenizer (else
    an engine's /tokenize, which is told the messages alone).
    """
    body = request.body
    if request.kind in ("messages", "responses"):
        return f"the {request.kind.capitalize()} API"  # the continuation is written as chat and completions chunks
    if request.batch_size > 1:
        return "a batched prompt"
    n = body.get("n")
    if n not in (None, 1):
        return "n > 1"
    if requested_max_tokens(request) == 1:
        # The prefill's token is the whole answer: a decoder would never retrieve the pushed KV.
        return "a one-token answer"
    field = unsupported_field(body)
    if field is not None:
        return f"the '{field}' field"
    return _prompt_differs(request, local_tokenizer)


def unsupported_field(body: dict[str, Any]) -> str | None:
    """The first field of `body` a continuation from token ids cannot carry (None: none)."""
    for name in _UNSUPPORTED_FIELDS:
        value = body.get(name)
        if value is None or value is False or _harmless(name, value, body):
            continue
        return name
    return None


def _prompt_differs(request: ClientRequest, local_tokenizer: bool) -> str | None:
    """Why the router's token ids may not be the prompt the engine would render (None: they are)."""
    body = request.body
    chat = request.kind == "chat"
    harmless = dict(_PROMPT_FIELDS)
    # vLLM adds special tokens to text prompts, not to a rendered chat template.
    harmless["add_special_tokens"] = (None, not chat)
    if chat and not local_tokenizer:
        harmless |= _TEMPLATE_FIELDS
    for name, defaults in harmless.items():
        if name in body and body[name] not in defaults:
            return f"the '{name}' field"
    if not chat:
        return None
    for message in body["messages"]:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
            return "content that is not text"
        if len(content) > 1 and local_tokenizer:
            return "content in several parts"  # the engine joins them with newlines, the tokenizer does not
    return None


def _harmless(name: str, value: Any, body: dict[str, Any]) -> bool:
    """A field set to what asking nothing would mean."""
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name == "tools":
        return body.get("tool_choice") == "none" or value == []
    return name == "best_of" and value == 1
