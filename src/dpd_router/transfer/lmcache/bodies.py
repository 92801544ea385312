"""The engine calls' bodies: the prefill (one token, KV pushed), the decode continuation, and the drain."""

from __future__ import annotations

from typing import Any

from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.client_request import ClientRequest

# Chat-only fields a text completion does not take (the prompt is already rendered to token ids).
CHAT_ONLY_FIELDS = (
    "messages",
    "max_completion_tokens",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
    "mm_processor_kwargs",
    "audio",
    "modalities",
)
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params")
_MIN_TOKENS_FIELDS = ("min_tokens", "min_completion_tokens")
# vLLM's default max_tokens for /v1/completions.
COMPLETION_DEFAULT_MAX_TOKENS = 16


def requested_max_tokens(request: ClientRequest) -> int | None:
    """The client's output limit (None: a chat request that takes the rest of the context)."""
    body = request.body
    for name in ("max_completion_tokens", "max_tokens") if request.kind == "chat" else ("max_tokens",):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None if request.kind == "chat" else COMPLETION_DEFAULT_MAX_TOKENS


def _completion_fields(request: ClientRequest) -> dict[str, Any]:
    """The client's body as a text completion's fields: chat-only fields dropped."""
    return {key: value for key, value in request.body.items() if key not in CHAT_ONLY_FIELDS}


def prefill_body(request: ClientRequest, prompt: Prompt, spec: dict[str, Any]) -> dict[str, Any]:
    """The prefill call: the prompt's token ids, one unstreamed token, and where to push the KV.

    A client's minimum length of at least one token becomes one here: the first token may not end
    the answer (an end-of-sequence token or a stop), as it could not on an engine serving it alone.
    """
    body = {key: value for key, value in _completion_fields(request).items() if key not in _DROPPED_FOR_PREFILL}
    body.update(
        prompt=list(prompt.token_ids),
        max_tokens=1,
        stream=False,
        kv_transfer_params={"ret_first_tok": True, "disagg_spec": spec},
    )
    if requested_min_tokens(request) >= 1:
        body["min_tokens"] = 1
    return body


def requested_min_tokens(request: ClientRequest) -> int:
    """The client's minimum output length (0: none)."""
    for name in _MIN_TOKENS_FIELDS:
        value = request.body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def decode_body(request: ClientRequest, prompt: Prompt, first_token: int) -> dict[str, Any]:
    """The decode call: a plain completion of the prompt and the first token, for the tokens left."""
    body = {key: value for key, value in _completion_fields(request).items() if key != "kv_transfer_params"}
    wanted = requested_max_tokens(request)
    body.update(prompt=[*prompt.token_ids, first_token], max_tokens=None if wanted is None else wanted - 1)
    for name in _MIN_TOKENS_FIELDS:
        body.pop(name, None)
    minimum = requested_min_tokens(request)
    if minimum > 1:
        body["min_tokens"] = minimum - 1  # the prefiller's token was the first of them
    return body


def drain_body(request: ClientRequest, prompt: Prompt, first_token: int) -> dict[str, Any]:
    """A one-token continuation whose answer nobody reads: it makes the decoder retrieve (and so
    free) the KV pushed for `prompt`."""
    body: dict[str, Any] = {"prompt": [*prompt.token_ids, first_token], "max_tokens": 1, "stream": False}
    if request.body.get("model") is not None:
        body["model"] = request.body["model"]
    return body
