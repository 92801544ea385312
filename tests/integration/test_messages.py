"""The Anthropic Messages API through the router, driven by the official anthropic client: a long prompt
through both hops, a short one straight to a decoder, the router's token count, and refusals in the shape
the client reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster

from .conftest import MODEL, engine_stats, fresh, kinds_seen, metric, rid, running_router, settled

THRESHOLD = 64
LONG_TEXT = "The quarterly report shows steady growth across every region and product line. " * 12


SHORT_TEXT = "Hello there!"


@pytest.fixture(scope="module")
async def router(cluster: SimCluster, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f"keys:\n  - sha256: {hash_key('good-key')}\n")
    async with running_router(
        prefill_urls=cluster.prefill_urls,
        decode_urls=cluster.decode_urls,
        tokenizer=str(tokenizer_dir),
        routing_threshold=THRESHOLD,
        threshold_mode="static",
        api_keys_file=str(keys),
    ) as base_url:
        yield base_url


def client(base_url: str, api_key: str = "good-key") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)


async def test_a_long_message_goes_through_a_prefiller_and_answers_as_the_decoder_alone(
    router: str, cluster: SimCluster
) -> None:
    request_id = rid()
    messages: list[Any] = [{"role": "user", "content": LONG_TEXT}]
    system = fresh("Answer in one line.")  # the prompt's start: what the prefiller's cache would match first
    through = await client(router).messages.create(
        model=MODEL,
        max_tokens=12,
        system=system,
        messages=messages,
        extra_headers={"X-Request-Id": request_id},
    )
    assert await kinds_seen(cluster.prefill_urls, request_id) == ["remote_prefill"]
    assert await kinds_seen(cluster.decode_urls, request_id) == ["kv_decode"]

    alone = await client(cluster.decode_urls[0]).messages.create(
        model=MODEL, max_tokens=12, system=system, messages=messages
    )
    assert through.type == "message" and through.role == "assistant"
    assert [block.type for block in through.content] == ["text"]
    assert through.content == alone.content
    assert through.stop_reason == alone.stop_reason == "max_tokens"
    assert through.usage.output_tokens == 12
    total = through.usage.input_tokens + (through.usage.cache_read_input_tokens or 0)
    assert total == alone.usage.input_tokens + (alone.usage.cache_read_input_tokens or 0) >= THRESHOLD
    # The prefiller's cache view (nothing cached there), not the decoder's (which loaded the whole prompt).
    assert through.usage.cache_read_input_tokens == 0


async def test_a_long_message_streams_its_events_through_both_hops(router: str, cluster: SimCluster) -> None:
    request_id = rid()
    before = await metric(router, "dpd_router_time_to_first_token_seconds_count", {"path": "disaggregated"})
    async with client(router).messages.stream(
        model=MODEL,
        max_tokens=16,
        messages=[{"role": "user", "content": fresh(LONG_TEXT + " Stream it.")}],
        extra_headers={"X-Request-Id": request_id},
    ) as stream:
        events = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and "message_delta" in events
    assert final.content and final.content[0].type == "text" and final.content[0].text
    assert final.usage.output_tokens == 16 and final.stop_reason == "max_tokens"
    assert final.usage.cache_read_input_tokens == 0
    assert await kinds_seen(cluster.prefill_urls, request_id) == ["remote_prefill"]
    assert await kinds_seen(cluster.decode_urls, request_id) == ["kv_decode"]
    after = await metric(router, "dpd_router_time_to_first_token_seconds_count", {"path": "disaggregated"})
    assert after == before + 1, "the first text delta was seen as the stream's first token"


async def test_a_short_message_goes_straight_to_a_decoder(router: str, cluster: SimCluster) -> None:
    request_id = rid()
    answer = await client(router).messages.create(
        model=MODEL,
        max_tokens=6,
        messages=[{"role": "user", "content": SHORT_TEXT}],
        extra_headers={"X-Request-Id": request_id},
    )
    assert answer.content and answer.usage.output_tokens == 6
    assert await kinds_seen(cluster.prefill_urls, request_id) == []
    assert await kinds_seen(cluster.decode_urls, request_id) == ["local"]
    await settled(router)
    assert await metric(router, "dpd_router_requests_total", {"api": "messages", "outcome": "ok"}) >= 1


CONVERSATION: list[Any] = [
    {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": SHORT_TEXT},
]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": SHORT_TEXT}]},
        {"system": [{"type": "text", "text": "Be brief."}], "messages": [{"role": "user", "content": LONG_TEXT}]},
        {"system": "Use the tools.", "messages": CONVERSATION},
    ],
    ids=["one-message", "system-blocks", "tool-turns"],
)
async def test_count_tokens_is_the_count_the_engine_serves_with(
    router: str, cluster: SimCluster, body: dict[str, Any]
) -> None:
    counted = await client(router).messages.count_tokens(model=MODEL, **body)
    served = await client(cluster.decode_urls[0]).messages.create(model=MODEL, max_tokens=1, **body)
    assert counted.input_tokens == served.usage.input_tokens + (served.usage.cache_read_input_tokens or 0)


async def test_refusals_come_in_the_messages_api_shape(router: str) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await client(router, api_key="wrong-key").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": SHORT_TEXT}]
        )
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": refused.value.body["error"]["message"]},
    }  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await client(router).messages.create(
            model="another-model", max_tokens=4, messages=[{"role": "user", "content": SHORT_TEXT}]
        )
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]

    async with httpx.AsyncClient(base_url=router, headers={"x-api-key": "good-key"}) as raw:
        no_budget = await raw.post(
            "/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        bad_role = await raw.post(
            "/v1/messages", json={"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}
        )
        own_params = await raw.post(
            "/v1/messages",
            json={"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {}},
        )
        not_json = await raw.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    for answer, param in (
        (no_budget, "max_tokens"),
        (bad_role, "role"),
        (own_params, "kv_transfer_params"),
        (not_json, "JSON"),
    ):
        assert answer.status_code == 400
        assert answer.json()["type"] == "error"
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert param in answer.json()["error"]["message"]


async def test_failing_engines_are_retried_and_fallen_back_from_as_for_chat(tokenizer_dir: Path) -> None:
    """A prefiller answering 500 leaves the long message to the decoder alone; a decoder answering 500
    before its first event is replaced, streamed or not: the client sees answers, never the failures."""
    async with (
        SimCluster(in_process=True, prefill=1, decode=2, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            prefill_urls=cluster.prefill_urls,
            decode_urls=cluster.decode_urls,
            tokenizer=str(tokenizer_dir),
            routing_threshold=THRESHOLD,
            threshold_mode="static",
        ) as base_url,
        httpx.AsyncClient() as engines,
    ):
        messages: list[Any] = [{"role": "user", "content": LONG_TEXT}]
        await engines.post(f"{cluster.prefill_urls[0]}/sim/fault", json={"mode": "error_500", "count": 2})
        request_id = rid()
        answer = await client(base_url).messages.create(
            model=MODEL, max_tokens=5, messages=messages, extra_headers={"X-Request-Id": request_id}
        )
        assert answer.usage.output_tokens == 5
        assert await kinds_seen(cluster.decode_urls, request_id) == ["local"], "served by a decoder alone"
        assert await metric(base_url, "dpd_router_prefill_fallbacks_total") == 1

        failing = cluster.decode_urls[0]
        await engines.post(f"{failing}/sim/fault", json={"mode": "error_500"})
        for i in range(4):
            short = [{"role": "user", "content": f"{SHORT_TEXT} {i}"}]
            if i % 2:
                async with client(base_url).messages.stream(model=MODEL, max_tokens=4, messages=short) as events:
                    final = await events.get_final_message()
            else:
                final = await client(base_url).messages.create(model=MODEL, max_tokens=4, messages=short)
            assert final.usage.output_tokens == 4 and final.content
        assert (await engine_stats(failing))["requests_total"] >= 1, "some went to the failing decoder"
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "decode"}) >= 1
