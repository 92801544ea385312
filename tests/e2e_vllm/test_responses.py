"""The OpenAI Responses API through dpd-router in front of two real vLLM engines moving the KV over NIXL: a
long input is disaggregated and answers as one engine alone does, streamed or not; a follow-up by a response
the router stored answers as the engine answers the same history sent explicitly; an unknown one is refused
as the engine refuses it."""

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


async def test_a_follow_up_answers_as_the_engine_answers_the_whole_history_sent_explicitly(
    router: str, nixl_pair: VllmPair
) -> None:
    opening = long_text(seed="responses-history")
    asked = {"model": MODEL_NAME, "max_output_tokens": ANSWER_TOKENS, "temperature": 0}
    async with openai_client(router) as client:
        first = await client.responses.create(**asked, input=opening)
        before = await EngineCounters.read(nixl_pair)
        follow = await client.responses.create(**asked, input="And then?", previous_response_id=first.id)
    after = await counters_after_a_transfer(nixl_pair, before)
    assert after.prefill_requests == before.prefill_requests + 1, "the whole history went through both hops"
    assert follow.previous_response_id == first.id

    history = [
        {"type": "message", "role": "user", "content": opening},
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"type": "message", "role": "user", "content": "And then?"},
    ]
    reference = await response_of(nixl_pair.prefill.url, {**asked, "input": history, "store": False}, stream=False)
    _say(f"responses follow-up: {follow.usage.input_tokens} prompt tokens, {follow.output_text!r}")
    assert follow.usage.input_tokens == reference.usage.input_tokens > THRESHOLD
    assert follow.output_text == reference.output_text


async def test_a_follow_up_by_an_unknown_response_is_refused_as_the_engine_refuses_it(
    router: str, nixl_pair: VllmPair
) -> None:
    body = {"model": MODEL_NAME, "input": "And then?", "previous_response_id": "resp_not_kept", "max_output_tokens": 4}
    answers = []
    for base_url in (router, nixl_pair.decode.url):
        with pytest.raises(openai.NotFoundError) as refused:
            await response_of(base_url, body, stream=False)
        answers.append(refused.value.body)
    assert answers[0] == answers[1]
