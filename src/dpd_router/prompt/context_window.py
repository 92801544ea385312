"""What the model's context window refuses, decided before any engine is called, in vLLM's words.

vLLM (0.32) serves any prompt that leaves room for one output token, and caps the output at the
room left: a 3,904-token prompt asking for 1,000 tokens of a 4,096-token model gets 192. It
refuses, with HTTP 400 and these messages and `param`s (each ends with its parameter and value):

- an output budget above the context itself: `max_tokens=5000 cannot be greater than max_model_len=4096.`
  (`max_completion_tokens` instead on chat requests that set it; text completions ignore that field);
- a prompt longer than the context (`param: input_tokens`); a prompt given as text is tokenized up to one
  token past the limit, so the engine only knows "at least 4097" of it;
- a prompt exactly as long as the context: no room for output, `max_tokens must be at least 1, got 0.`

A request with `truncate_prompt_tokens` has its prompt cut by the engine, so only the output budget is
checked here. Of a batch of prompts only the first is known exactly: the engine judges the others.
"""

from __future__ import annotations

from typing import Any

from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import InvalidRequest


def check_context_length(request: ClientRequest, prompt: Prompt, limit: int, *, counted: int | None = None) -> None:
    """Raise InvalidRequest where vLLM would refuse the request for the model's context length; `counted`:
    the prompt's count to judge, where not its `num_tokens` (a prompt read in part)."""
    _check_output_budget(request, limit)
    if request.body.get("truncate_prompt_tokens") is not None:
        return
    count = prompt.num_tokens if counted is None else counted
    tokens = len(prompt.token_ids) if request.batch_size > 1 else count
    if tokens > limit:
        cut = _tokenized_from_text(request)
        raise prompt_too_long(limit, limit + 1 if cut else tokens, at_least=cut)
    if tokens == limit:
        raise InvalidRequest(
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", param="max_tokens"
        )


def prompt_too_long(limit: int, counted: int, *, at_least: bool) -> InvalidRequest:
    """vLLM's refusal of a prompt longer than the context (`at_least`: it stopped counting there)."""
    qualifier = "at least " if at_least else ""
    return InvalidRequest(
        f"This model's maximum context length is {limit} tokens. However, your prompt contains "
        f"{qualifier}{counted} input tokens, which exceeds this limit even without any output tokens. "
        f"Please reduce the length of the input prompt. (parameter=input_tokens, value={counted})",
        param="input_tokens",
    )


def _check_output_budget(request: ClientRequest, limit: int) -> None:
    name, asked = output_budget(request)
    if asked is not None and asked > limit:
        raise InvalidRequest(
            f"{name}={asked} cannot be greater than max_model_len={limit}. Please request fewer output "
            f"tokens. (parameter={name}, value={asked})",
            param=name,
        )


def output_budget(request: ClientRequest) -> tuple[str, int | None]:
    """The field the engine reads the output budget from, and its value (None: unset, or not a number
    the engine would read; request validation answers for that)."""
    body = request.body
    name = "max_output_tokens" if request.kind == "responses" else "max_tokens"
    if request.kind == "chat" and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    return name, _integer(body.get(name))


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tokenized_from_text(request: ClientRequest) -> bool:
    """Whether the engine tokenizes the (first) prompt itself, cutting it one token past the limit."""
    if request.kind != "completion":
        return True
    prompt = request.body.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str))
