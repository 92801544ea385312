"""The Anthropic Messages API through dpd-router in front of two real vLLM engines moving the KV over NIXL:
a long message is disaggregated and answers as one engine alone does; the router's token count is the
engine's own."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from dpd_sim.vllm_cpu import MODEL_NAME, VllmPair
from tests.e2e_vllm.conftest import (
    ANSWER_TOKENS,
    THRESHOLD,
    EngineCounters,
    anthropic_client,
    counters_after_a_transfer,
    long_text,
)


def client(base_url: str) -> anthropic.AsyncAnthropic:
    return anthropic_client(base_url)


async def message_text(base_url: str, body: dict[str, Any], *, stream: bool) -> tuple[str, anthropic.types.Usage]:
    """One greedy Messages request: its text and usage."""
    async with client(base_url) as anthropic_client:
        if not stream:
            answer = await anthropic_client.messages.create(**body)
        else:
            async with anthropic_client.messages.stream(**body) as events:
                answer = await events.get_final_message()
    return "".join(block.text for block in answer.content if block.type == "text"), answer.usage


def prompt_tokens(usage: anthropic.types.Usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_long_message_is_prefilled_on_one_engine_and_decoded_on_the_other(
    router: str, nixl_pair: VllmPair, stream: bool
) -> None:
    body = {
        "model": MODEL_NAME,
        "max_tokens": ANSWER_TOKENS,
        "extra_body": {"temperature": 0},  # greedy (this client release has no temperature argument)
        "system": "You summarise reports.",
        "messages": [{"role": "user", "content": long_text(seed=f"messages-{stream}")}],
    }
    before = await EngineCounters.read(nixl_pair)

    text, usage = await message_text(router, body, stream=stream)

    after = await counters_after_a_transfer(nixl_pair, before)
    assert after.prefill_requests == before.prefill_requests + 1, "the prefiller ran the prefill hop"
    assert after.decode_requests == before.decode_requests + 1

    # The same request on one engine, no transfer: greedy decoding gives the same text.
    reference, reference_usage = await message_text(nixl_pair.prefill.url, body, stream=False)
    assert text == reference
    assert prompt_tokens(usage) == prompt_tokens(reference_usage) > THRESHOLD
    assert usage.output_tokens == reference_usage.output_tokens


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "Summarise the quarter."}]},
        {
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What grew?"}]},
                {"role": "assistant", "content": "Sales."},
                {"role": "user", "content": "By how much?"},
            ],
        },
    ],
    ids=["one-message", "system-and-turns"],
)
async def test_count_tokens_answers_as_the_engine_does(router: str, nixl_pair: VllmPair, body: dict[str, Any]) -> None:
    async with client(router) as routed, client(nixl_pair.decode.url) as engine:
        counted = await routed.messages.count_tokens(model=MODEL_NAME, **body)
        reference = await engine.messages.count_tokens(model=MODEL_NAME, **body)
    assert counted.input_tokens == reference.input_tokens > 0
