"""The context-window check answers as vLLM 0.32 does (figures read from a real engine, max_model_len 4096)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from dpd_router.prompt.context_window import check_context_length
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.client_request import RequestKind, parse_request
from dpd_router.request.errors import InvalidRequest

LIMIT = 4096


def check(kind: RequestKind, body: dict[str, Any], prompt_tokens: int, first_prompt_tokens: int | None = None) -> None:
    request = parse_request(kind, orjson.dumps(body))
    first = prompt_tokens if first_prompt_tokens is None else first_prompt_tokens
    check_context_length(request, Prompt(token_ids=[7] * first, num_tokens=prompt_tokens, seconds=0.0), LIMIT)


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "a long report"}], **fields}


def text(**fields: Any) -> dict[str, Any]:
    return {"prompt": "a long report", **fields}


def ids(count: int, **fields: Any) -> dict[str, Any]:
    return {"prompt": [7] * count, **fields}


@pytest.mark.parametrize(
    ("kind", "body", "tokens"),
    [
        # The engine caps the output at the room left (192 tokens here) instead of refusing.
        ("completion", ids(3904, max_tokens=1000), 3904),
        ("completion", text(max_tokens=1000), 3904),
        ("chat", chat(max_tokens=1000), 3904),
        ("chat", chat(max_completion_tokens=1000), 3904),
        ("chat", chat(), 4095),
        # Text completions have no max_completion_tokens: the engine ignores it, whatever it holds.
        ("completion", ids(16, max_tokens=4, max_completion_tokens=5000), 16),
        ("completion", ids(16, max_completion_tokens="lots"), 16),
        ("completion", ids(16, max_completion_tokens=[1]), 16),
        ("completion", ids(16, max_completion_tokens={"n": 1}), 16),
        ("completion", ids(3904, max_completion_tokens=1000), 3904),
        # The engine cuts the prompt to fit.
        ("completion", ids(5000, max_tokens=16, truncate_prompt_tokens=4000), 5000),
    ],
)
def test_what_the_engine_serves_passes(kind: RequestKind, body: dict[str, Any], tokens: int) -> None:
    check(kind, body, tokens)


@pytest.mark.parametrize(
    ("kind", "body", "tokens", "message", "param"),
    [
        (
            "completion",
            ids(2, max_tokens=5000),
            2,
            "max_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. "
            "(parameter=max_tokens, value=5000)",
            "max_tokens",
        ),
        (
            "chat",
            chat(max_tokens=10, max_completion_tokens=5000),
            2,
            "max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output "
            "tokens. (parameter=max_completion_tokens, value=5000)",
            "max_completion_tokens",
        ),
        (
            "completion",
            ids(5000, max_tokens=16),
            5000,
            "This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, "
            "which exceeds this limit even without any output tokens. Please reduce the length of the input "
            "prompt. (parameter=input_tokens, value=5000)",
            "input_tokens",
        ),
        (
            # The engine tokenizes text only up to one token past the limit.
            "completion",
            text(max_tokens=16),
            4997,
            "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
            "input prompt. (parameter=input_tokens, value=4097)",
            "input_tokens",
        ),
        (
            "chat",
            chat(max_tokens=16),
            4997,
            "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input "
            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
            "input prompt. (parameter=input_tokens, value=4097)",
            "input_tokens",
        ),
        (
            # No room for a single output token.
            "completion",
            ids(4096, max_tokens=16),
            4096,
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "max_tokens",
        ),
    ],
)
def test_what_the_engine_refuses_is_refused_in_its_words(
    kind: RequestKind, body: dict[str, Any], tokens: int, message: str, param: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check(kind, body, tokens)
    assert (refused.value.message, refused.value.param, refused.value.status_code) == (message, param, 400)


def test_of_a_batch_the_first_prompt_is_judged_here_and_the_others_by_the_engine() -> None:
    with pytest.raises(InvalidRequest, match="contains 5000 input tokens"):
        check("completion", {"prompt": [[7] * 5000, [7] * 100], "max_tokens": 16}, 5100, first_prompt_tokens=5000)
    check("completion", {"prompt": [[7] * 100, [7] * 9000], "max_tokens": 16}, 9100, first_prompt_tokens=100)
