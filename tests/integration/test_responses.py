"""The OpenAI Responses API through the router, driven by the official openai client: a long input through
both hops, streamed and not, a short one straight to a decoder; nothing stored, so what asks for a stored
response is answered as a default vLLM answers it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dpd_sim.cluster import SimCluster

from .conftest import MODEL, fresh, kinds_seen, metric, openai_client, rid, running_router, settled

THRESHOLD = 64
LONG_TEXT = "The quarterly report shows steady growth across every region and product line. " * 12


SHORT_TEXT = "Hello there!"


@pytest.fixture(scope="module")
async def router(cluster: SimCluster, tokenizer_dir: Path):
    async with running_router(
        prefill_urls=cluster.prefill_urls,
        decode_urls=cluster.decode_urls,
        tokenizer=str(tokenizer_dir),
        routing_threshold=THRESHOLD,
        threshold_mode="static",
    ) as base_url:
        yield base_url


async def test_a_long_input_goes_through_a_prefiller_and_answers_as_the_decoder_alone(
    router: str, cluster: SimCluster
) -> None:
    request_id = rid()
    ask: dict[str, Any] = {"model": MODEL, "instructions": fresh("Answer in one line."), "input": LONG_TEXT}
    through = await openai_client(router).responses.create(
        **ask, max_output_tokens=12, extra_headers={"X-Request-Id": request_id}
    )
    assert await kinds_seen(cluster.prefill_urls, request_id) == ["remote_prefill"]
    assert await kinds_seen(cluster.decode_urls, request_id) == ["kv_decode"]

    alone = await openai_client(cluster.decode_urls[0]).responses.create(**ask, max_output_tokens=12)
    assert through.output_text and through.output_text == alone.output_text
    assert through.usage is not None and alone.usage is not None
    assert through.usage.input_tokens == alone.usage.input_tokens >= THRESHOLD
    assert through.usage.output_tokens == 12
    # The prefiller's cache view (nothing cached there), not the decoder's (which loaded the whole prompt).
    assert through.usage.input_tokens_details.cached_tokens == 0
    assert through.store is False, "nothing was stored, and the response says so"


async def test_a_long_input_streams_its_events_through_both_hops(router: str, cluster: SimCluster) -> None:
    request_id = rid()
    before = await metric(router, "dpd_router_time_to_first_token_seconds_count", {"path": "disaggregated"})
    async with openai_client(router).responses.stream(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": fresh(LONG_TEXT + " Stream it.")}]}],
        max_output_tokens=16,
        extra_headers={"X-Request-Id": request_id},
    ) as stream:
        events = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.output_text.delta" in events
    assert final.output_text and final.usage is not None and final.usage.output_tokens == 16
    assert final.usage.input_tokens_details.cached_tokens == 0
    assert await kinds_seen(cluster.prefill_urls, request_id) == ["remote_prefill"]
    assert await kinds_seen(cluster.decode_urls, request_id) == ["kv_decode"]
    await settled(router)
    after = await metric(router, "dpd_router_time_to_first_token_seconds_count", {"path": "disaggregated"})
    assert after == before + 1, "the first text delta was seen as the stream's first token"
    assert await metric(router, "dpd_router_api_requests_total", {"api": "responses", "outcome": "ok"}) >= 1


async def test_a_short_input_with_tool_turns_goes_straight_to_a_decoder(router: str, cluster: SimCluster) -> None:
    request_id = rid()
    turns: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"role": "user", "content": SHORT_TEXT},
    ]
    answer = await openai_client(router).responses.create(
        model=MODEL, input=turns, max_output_tokens=6, extra_headers={"X-Request-Id": request_id}
    )
    assert answer.output_text and answer.usage is not None and answer.usage.output_tokens == 6
    assert await kinds_seen(cluster.prefill_urls, request_id) == []
    assert await kinds_seen(cluster.decode_urls, request_id) == ["local"]


async def test_stored_responses_are_not_found_as_with_a_default_vllm(router: str) -> None:
    client = openai_client(router)
    with pytest.raises(openai.NotFoundError) as follow_up:
        await client.responses.create(model=MODEL, input=SHORT_TEXT, previous_response_id="resp_earlier")
    assert "resp_earlier" in follow_up.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_earlier")
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete("resp_earlier")
    async with httpx.AsyncClient(base_url=router) as raw:
        background = await raw.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True})
        no_input = await raw.post("/v1/responses", json={"model": MODEL})
        budget = await raw.post("/v1/responses", json={"input": "hi", "max_output_tokens": 0})
    for answer, param in ((background, "background"), (no_input, "input"), (budget, "max_output_tokens")):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
