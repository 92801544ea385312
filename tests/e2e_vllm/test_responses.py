"""The OpenAI Responses API through dpd-router in front of two real vLLM engines moving the KV over NIXL: a
long input is disaggregated and answers as one engine alone does, streamed or not; a follow-up by a stored
response is answered as that engine answers it (vLLM stores nothing by default)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from dpd_sim.vllm_cpu import MODEL_NAME, VllmPair
from tests.e2e_vllm.conftest import (
    ANSWER_TOKENS,
    THRESHOLD,
    EngineCounters,
    _say,
    counters_after_a_transfer,
    long_text,
    openai_client,
)


async def response_of(base_url: str, body: dict[str, Any], *, stream: bool) -> Any:
    """One greedy Responses request: the whole response object."""
    async with openai_client(base_url) as client:
        if not stream:
            return await client.responses.create(**body)
        async with client.responses.stream(**body) as events:
            return await events.get_final_response()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_long_input_is_prefilled_on_one_engine_and_decoded_on_the_other(
    router: str, nixl_pair: VllmPair, stream: bool
) -> None:
    body = {
        "model": MODEL_NAME,
        "instructions": "You summarise reports.",
        "input": long_text(seed=f"responses-{stream}"),
        "max_output_tokens": ANSWER_TOKENS,
        "temperature": 0,
    }
    before = await EngineCounters.read(nixl_pair)

    routed = await response_of(router, body, stream=stream)

    after = await counters_after_a_transfer(nixl_pair, before)
    assert after.prefill_requests == before.prefill_requests + 1, "the prefiller ran the prefill hop"
    assert after.decode_requests == before.decode_requests + 1

    reference = await response_of(nixl_pair.prefill.url, body, stream=False)
    _say(f"responses ({'streamed' if stream else 'whole'}): {routed.usage.input_tokens} prompt tokens, {routed.status}")
    assert routed.output_text == reference.output_text
    assert routed.usage.input_tokens == reference.usage.input_tokens > THRESHOLD
    assert routed.usage.output_tokens == reference.usage.output_tokens
    assert routed.status == reference.status


async def test_a_follow_up_by_a_stored_response_is_answered_as_the_engine_answers_it(
    router: str, nixl_pair: VllmPair
) -> None:
    body = {"model": MODEL_NAME, "input": "And then?", "previous_response_id": "resp_not_kept", "max_output_tokens": 4}
    answers = []
    for base_url in (router, nixl_pair.decode.url):
        with pytest.raises(openai.NotFoundError) as refused:
            await response_of(base_url, body, stream=False)
        answers.append(refused.value.body)
    assert answers[0] == answers[1]
