"""The gateway end to end on loopback: real engine processes, the router on a socket, the openai client."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from dpd_sim.cluster import SimCluster

from .conftest import MODEL, engine_stats, metric, openai_client, requests_seen, rid, running_router

THRESHOLD = 64
LONG_TEXT = "The quarterly report shows steady growth across every region and product line. " * 12
SHORT_TEXT = "Hello there!"


async def seen_on(urls: list[str], request_id: str) -> list[dict[str, object]]:
    found: list[dict[str, object]] = []
    for url in urls:
        found += [{**entry, "engine": url} for entry in await requests_seen(url, request_id)]
    return found


@pytest.fixture(scope="module")
async def router(cluster: SimCluster, tokenizer_dir: Path):
    async with running_router(
        prefill_urls=cluster.prefill_urls,
        decode_urls=cluster.decode_urls,
        tokenizer=str(tokenizer_dir),
        routing_threshold=THRESHOLD,
    ) as base_url:
        yield base_url


async def test_long_chat_prompt_streams_through_prefiller_then_decoder(router: str, cluster: SimCluster) -> None:
    request_id = rid()
    client = openai_client(router)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG_TEXT}],
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text
    assert usage is not None and usage.completion_tokens == 24
    assert usage.prompt_tokens >= THRESHOLD

    prefills = await seen_on(cluster.prefill_urls, request_id)
    decodes = await seen_on(cluster.decode_urls, request_id)
    assert [entry["kind"] for entry in prefills] == ["remote_prefill"]
    assert [entry["kind"] for entry in decodes] == ["kv_decode"]
    assert decodes[0]["status"] == "ok"
    assert decodes[0]["cached_tokens"] == usage.prompt_tokens, "the decoder consumed the transferred KV"
    # The client is told the prefiller's cache view (nothing was cached there), not the decoder's.
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0

    assert await metric(router, "dpd_router_route_decisions_total", {"path": "disaggregated"}) >= 1
    assert await metric(router, "dpd_router_time_to_first_token_seconds_count", {"path": "disaggregated"}) >= 1


async def test_disaggregated_output_equals_the_decoder_serving_alone(router: str, cluster: SimCluster) -> None:
    messages = [{"role": "user", "content": LONG_TEXT + " Twice."}]
    through_router = await openai_client(router).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, seed=3
    )
    alone = await openai_client(cluster.decode_urls[0]).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, seed=3
    )
    assert through_router.choices[0].message.content == alone.choices[0].message.content
    assert through_router.usage is not None and alone.usage is not None
    assert through_router.usage.prompt_tokens == alone.usage.prompt_tokens, "router counts tokens like the engine"


async def test_short_prompt_reaches_only_the_decoder(router: str, cluster: SimCluster) -> None:
    request_id = rid()
    answer = await openai_client(router).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": SHORT_TEXT}],
        max_tokens=8,
        extra_headers={"X-Request-Id": request_id},
    )
    assert answer.choices[0].message.content
    assert await seen_on(cluster.prefill_urls, request_id) == []
    decodes = await seen_on(cluster.decode_urls, request_id)
    assert [entry["kind"] for entry in decodes] == ["local"]


async def test_text_completion_with_a_list_prompt(router: str, cluster: SimCluster) -> None:
    request_id = rid()
    answer = await openai_client(router).completions.create(
        model=MODEL,
        prompt=["first prompt", LONG_TEXT],
        max_tokens=5,
        extra_headers={"X-Request-Id": request_id},
    )
    assert sorted(choice.index for choice in answer.choices) == [0, 1]
    assert all(choice.text for choice in answer.choices)
    assert await seen_on(cluster.prefill_urls, request_id) == [], "a batch cannot hand over one set of KV"


async def test_long_text_completion_streams_disaggregated(router: str, cluster: SimCluster) -> None:
    request_id = rid()
    stream = await openai_client(router).completions.create(
        model=MODEL, prompt=LONG_TEXT, max_tokens=10, stream=True, extra_headers={"X-Request-Id": request_id}
    )
    pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert "".join(pieces)
    assert [e["kind"] for e in await seen_on(cluster.prefill_urls, request_id)] == ["remote_prefill"]
    assert [e["kind"] for e in await seen_on(cluster.decode_urls, request_id)] == ["kv_decode"]


async def test_request_id_is_echoed_and_forwarded(router: str) -> None:
    async with httpx.AsyncClient() as client:
        given = await client.post(
            f"{router}/v1/completions",
            json={"model": MODEL, "prompt": SHORT_TEXT, "max_tokens": 2},
            headers={"X-Request-Id": "client-chosen-id"},
        )
        made = await client.post(f"{router}/v1/completions", json={"prompt": SHORT_TEXT, "max_tokens": 2})
    assert given.headers["x-request-id"] == "client-chosen-id"
    assert made.status_code == 200, "a request without a model gets the served one"
    assert made.headers["x-request-id"].startswith("dpd-")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b'{"model": "sim-model"}', "messages"),
        (
            b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
            "max_tokens",
        ),
    ],
)
async def test_bad_requests_get_openai_400s(router: str, body: bytes, param: str | None) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{router}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
    assert error["param"] == param


async def test_openai_client_sees_bad_request_and_unknown_model(router: str) -> None:
    client = openai_client(router)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="other-model", messages=[{"role": "user", "content": "x"}])


async def test_operator_endpoints(router: str, cluster: SimCluster) -> None:
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{router}/health")).status_code == 200
        ready = await client.get(f"{router}/ready")
        models = (await client.get(f"{router}/v1/models")).json()
        metrics = (await client.get(f"{router}/metrics")).text
    assert ready.status_code == 200
    assert {e["url"] for e in ready.json()["endpoints"]} == set(cluster.prefill_urls + cluster.decode_urls)
    assert models["data"][0]["id"] == MODEL
    for name in (
        "dpd_router_requests_total",
        "dpd_router_time_to_first_token_seconds",
        "dpd_router_prompt_tokens",
    ):
        assert name in metrics
    # prometheus-client's `_created` series (a third of the exposition) are left out, as vLLM leaves them out.
    assert "_created" not in metrics


async def test_a_dead_prefill_pool_still_answers_every_request(tokenizer_dir: Path) -> None:
    async with (
        SimCluster(prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as small,
        running_router(
            prefill_urls=small.prefill_urls,
            decode_urls=small.decode_urls,
            tokenizer=str(tokenizer_dir),
            routing_threshold=THRESHOLD,
        ) as base_url,
    ):
        client = openai_client(base_url)
        first = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=4
        )
        assert first.choices[0].message.content
        await small.kill(small.engines[0])  # SIGKILL the only prefiller
        for i in range(4):
            answer = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{i} {LONG_TEXT}"}], max_tokens=4
            )
            assert answer.choices[0].message.content
        stats = await engine_stats(small.decode_urls[0])
        assert stats["local_prefills"] >= 4, "the decoder served the prompts itself"
        fallbacks = await metric(base_url, "dpd_router_prefill_fallbacks_total", {"reason": "connect_error"})
        down = await metric(
            base_url,
            "dpd_router_route_decisions_total",
            {"path": "direct", "reason": "prefill_pool_down"},
        )
        assert fallbacks >= 1
        assert fallbacks + down >= 4


async def test_prefill_answer_without_kv_params_falls_back(tokenizer_dir: Path) -> None:
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as small,
        running_router(
            prefill_urls=small.prefill_urls,
            decode_urls=small.decode_urls,
            tokenizer=str(tokenizer_dir),
            routing_threshold=THRESHOLD,
        ) as base_url,
        httpx.AsyncClient() as http,
    ):
        await http.post(f"{small.prefill_urls[0]}/sim/fault", json={"mode": "no_kv_params"})
        answer = await openai_client(base_url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=4
        )
        assert answer.choices[0].message.content
        assert await metric(base_url, "dpd_router_prefill_fallbacks_total", {"reason": "no_kv_params"}) == 1


async def test_engine_tokenize_is_used_without_a_local_tokenizer(cluster: SimCluster) -> None:
    async with running_router(
        prefill_urls=cluster.prefill_urls, decode_urls=cluster.decode_urls, routing_threshold=THRESHOLD
    ) as base_url:
        request_id = rid()
        answer = await openai_client(base_url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": LONG_TEXT}],
            max_tokens=4,
            extra_headers={"X-Request-Id": request_id},
        )
        assert answer.choices[0].message.content
        assert [e["kind"] for e in await seen_on(cluster.decode_urls, request_id)] == ["kv_decode"]
