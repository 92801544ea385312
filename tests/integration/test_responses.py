"""The OpenAI Responses API through the router, driven by the official openai client: a long input through
both hops, streamed and not, a short one straight to a decoder; responses stored by the router, retrieved,
continued by `previous_response_id` (the whole history sent to both hops), listed, deleted, each its API
key's own; kept across a restart in the default SQLite store and shared by two routers through Redis."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster
from tests.redis_server import redis_server

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
    assert through.store is True, "the router kept it (the API's default), though no engine stored it"


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
    assert await metric(router, "dpd_router_requests_total", {"api": "responses", "outcome": "ok"}) >= 1


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


async def test_what_cannot_be_served_is_refused_naming_the_field(router: str) -> None:
    async with httpx.AsyncClient(base_url=router) as raw:
        background = await raw.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True})
        no_input = await raw.post("/v1/responses", json={"model": MODEL})
        budget = await raw.post("/v1/responses", json={"input": "hi", "max_output_tokens": 0})
    for answer, param in ((background, "background"), (no_input, "input"), (budget, "max_output_tokens")):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param


def as_input(output: list[Any]) -> list[dict[str, Any]]:
    """A response's output items as a client sends them back as input (the openai client's own dump)."""
    return [item.model_dump(exclude_none=True) for item in output]


async def test_a_stored_response_is_retrieved_continued_listed_and_deleted(router: str, cluster: SimCluster) -> None:
    client = openai_client(router)
    opening = fresh(LONG_TEXT)
    first = await client.responses.create(model=MODEL, instructions="Be brief.", input=opening, max_output_tokens=8)
    assert first.store is True
    assert re.fullmatch(r"resp_[0-9a-f]{32}", first.id), "the router's own id, not one an engine chose"
    kept = await client.responses.retrieve(first.id)
    assert kept.id == first.id and kept.output_text == first.output_text and kept.status == first.status

    request_id = rid()
    follow = await client.responses.create(
        model=MODEL,
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=6,
        extra_headers={"X-Request-Id": request_id},
    )
    assert follow.previous_response_id == first.id and follow.store is True
    # The history is long: both hops, each sent the whole conversation (no engine knows the id).
    assert await kinds_seen(cluster.prefill_urls, request_id) == ["remote_prefill"]
    assert await kinds_seen(cluster.decode_urls, request_id) == ["kv_decode"]
    # What a client keeping the history itself would send (instructions are not carried over, as the API says).
    explicit = [{"type": "message", "role": "user", "content": opening}, *as_input(first.output)]
    explicit.append({"type": "message", "role": "user", "content": "And then?"})
    alone = await openai_client(cluster.decode_urls[0]).responses.create(
        model=MODEL, input=explicit, max_output_tokens=6, store=False
    )
    assert follow.usage is not None and alone.usage is not None
    assert follow.usage.input_tokens == alone.usage.input_tokens
    assert follow.output_text == alone.output_text

    listed = await client.responses.input_items.list(follow.id, order="asc")
    assert [(item.type, getattr(item, "role", None)) for item in listed.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert listed.data[1].id == first.output[0].id, "an output item keeps the id its response gave it"
    newest_first = await client.responses.input_items.list(follow.id, limit=1)
    assert [item.id for item in newest_first.data] == [listed.data[-1].id] and newest_first.has_more

    async with httpx.AsyncClient(base_url=router) as raw:
        deleted = await raw.delete(f"/v1/responses/{follow.id}")
    assert deleted.json() == {"id": follow.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(follow.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL, input="More?", previous_response_id=follow.id)
    assert (await client.responses.retrieve(first.id)).id == first.id, "its predecessor is still kept"


async def test_a_streamed_response_is_kept_before_its_end_reaches_the_client(router: str) -> None:
    client = openai_client(router)
    async with client.responses.stream(model=MODEL, input=fresh(SHORT_TEXT), max_output_tokens=5) as stream:
        first = await stream.get_final_response()
    # Asked for the moment the stream ended: it is there.
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    async with client.responses.stream(
        model=MODEL, input="Go on.", previous_response_id=first.id, max_output_tokens=5
    ) as stream:
        created = [event async for event in stream if event.type == "response.created"]
        follow = await stream.get_final_response()
    assert created[0].response.previous_response_id == first.id and created[0].response.store is True
    assert follow.previous_response_id == first.id
    assert (await client.responses.retrieve(follow.id)).previous_response_id == first.id


async def test_what_is_not_stored_cannot_be_continued(router: str) -> None:
    client = openai_client(router)
    unkept = await client.responses.create(model=MODEL, input=SHORT_TEXT, max_output_tokens=3, store=False)
    assert unkept.store is False
    for ask in (
        client.responses.retrieve(unkept.id),
        client.responses.delete(unkept.id),
        client.responses.create(model=MODEL, input="Then?", previous_response_id=unkept.id),
        client.responses.create(model=MODEL, input="Then?", previous_response_id="resp_never"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            await ask
        assert "not found" in missing.value.message
    kept = await client.responses.create(model=MODEL, input=SHORT_TEXT, max_output_tokens=3)
    async with httpx.AsyncClient(base_url=router) as raw:
        cancel = await raw.post(f"/v1/responses/{kept.id}/cancel")
        unknown_cancel = await raw.post("/v1/responses/resp_never/cancel")
        bad_limit = await raw.get(f"/v1/responses/{kept.id}/input_items", params={"limit": 0})
        other = await raw.get(f"/v1/responses/{kept.id}/elsewhere")
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    assert unknown_cancel.status_code == 404
    assert bad_limit.status_code == 400 and bad_limit.json()["error"]["param"] == "limit"
    assert other.status_code == 404


async def test_a_stored_response_is_its_api_keys_alone(cluster: SimCluster, tokenizer_dir: Path) -> None:
    keys = [hash_key("alice-key"), hash_key("bob-key")]
    async with running_router(
        decode_urls=cluster.decode_urls, tokenizer=str(tokenizer_dir), api_key_hashes=keys
    ) as base_url:
        alice = openai_client(base_url, api_key="alice-key")
        bob = openai_client(base_url, api_key="bob-key")
        hers = await alice.responses.create(model=MODEL, input=SHORT_TEXT, max_output_tokens=3)
        for ask in (
            bob.responses.retrieve(hers.id),
            bob.responses.delete(hers.id),
            bob.responses.input_items.list(hers.id),
            bob.responses.create(model=MODEL, input="Then?", previous_response_id=hers.id),
        ):
            with pytest.raises(openai.NotFoundError):
                await ask
        assert (await alice.responses.retrieve(hers.id)).id == hers.id
        await alice.responses.create(model=MODEL, input="Then?", previous_response_id=hers.id, max_output_tokens=3)


async def test_the_default_store_keeps_responses_across_a_restart(cluster: SimCluster, tokenizer_dir: Path) -> None:
    settings = {"decode_urls": cluster.decode_urls, "tokenizer": str(tokenizer_dir)}
    async with running_router(**settings) as base_url:
        first = await openai_client(base_url).responses.create(model=MODEL, input=SHORT_TEXT, max_output_tokens=4)
    async with running_router(**settings) as base_url:
        client = openai_client(base_url)
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        follow = await client.responses.create(
            model=MODEL, input="Then?", previous_response_id=first.id, max_output_tokens=4
        )
        assert follow.previous_response_id == first.id


async def test_with_the_store_off_nothing_is_kept(cluster: SimCluster, tokenizer_dir: Path) -> None:
    async with running_router(
        decode_urls=cluster.decode_urls, tokenizer=str(tokenizer_dir), responses_store="off"
    ) as base_url:
        client = openai_client(base_url)
        answer = await client.responses.create(model=MODEL, input=SHORT_TEXT, max_output_tokens=3)
        assert answer.store is False, "the response says what was done"
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(answer.id)


async def test_two_routers_sharing_one_redis_continue_each_others_conversations(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    async with redis_server() as redis:
        settings = {"decode_urls": cluster.decode_urls, "tokenizer": str(tokenizer_dir), "responses_store": redis.url}
        async with running_router(**settings) as one, running_router(**settings) as other:
            first = await openai_client(one).responses.create(model=MODEL, input=SHORT_TEXT, max_output_tokens=4)
            there = openai_client(other)
            assert (await there.responses.retrieve(first.id)).output_text == first.output_text
            follow = await there.responses.create(
                model=MODEL, input="Then?", previous_response_id=first.id, max_output_tokens=4
            )
            back = await openai_client(one).responses.input_items.list(follow.id, order="asc")
            assert [getattr(item, "role", None) for item in back.data] == ["user", "assistant", "user"]
            await there.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await openai_client(one).responses.create(model=MODEL, input="More?", previous_response_id=follow.id)


async def test_a_store_that_fails_costs_the_history_never_the_answer(cluster: SimCluster, tokenizer_dir: Path) -> None:
    async with redis_server() as redis:
        settings = {"decode_urls": cluster.decode_urls, "tokenizer": str(tokenizer_dir), "responses_store": redis.url}
        async with running_router(**settings) as base_url:
            client = openai_client(base_url)
            first = await client.responses.create(model=MODEL, input=SHORT_TEXT, max_output_tokens=3)
            await redis.kill()
            answered = await client.responses.create(model=MODEL, input=SHORT_TEXT, max_output_tokens=3)
            assert answered.output_text, "served, though it could not be kept"
            for ask in (
                client.responses.create(model=MODEL, input="Then?", previous_response_id=first.id),
                client.responses.retrieve(first.id),
            ):
                with pytest.raises(openai.InternalServerError) as unavailable:
                    await ask
                assert unavailable.value.status_code == 503, "a history not read is not taken for none"
            assert await metric(base_url, "dpd_router_responses_store_errors_total") >= 3
