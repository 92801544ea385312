"""The router is no stricter than, and no different from, the engine behind it (simulated engines that
answer as vLLM 0.32 does; tests/e2e_vllm holds the same against the real engines)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, cluster_settings, engine_stats, metric, running_router

CONTEXT = 512
THRESHOLD = 64


@pytest.fixture(scope="module")
async def small_context(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    """A prefiller and a decoder serving a model of CONTEXT tokens."""
    async with SimCluster(
        in_process=True,
        prefill=1,
        decode=1,
        tokenizer=tokenizer_dir,
        model=MODEL,
        extra_args=["--max-model-len", str(CONTEXT)],
    ) as engines:
        yield engines


@pytest.fixture(scope="module")
async def router(small_context: SimCluster, tokenizer_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = cluster_settings(small_context, tokenizer_dir, threshold=THRESHOLD, model=MODEL)
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        yield client


async def engine_requests(cluster: SimCluster) -> list[int]:
    return [(await engine_stats(url))["requests_total"] for url in cluster.prefill_urls + cluster.decode_urls]


async def test_a_long_prompt_asking_for_more_than_the_room_left_is_served_and_capped(
    router: httpx.AsyncClient,
) -> None:
    body = {"model": MODEL, "prompt": [7] * (CONTEXT - 32), "max_tokens": CONTEXT // 2, "min_tokens": 32}
    answer = await router.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 32, "the room the prompt leaves"
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert await metric(str(router.base_url), "dpd_router_route_decisions_total", {"path": "disaggregated"}) >= 1


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/completions",
            {"prompt": [7] * (CONTEXT + 10), "max_tokens": 4},
            "input_tokens",
            f"However, your prompt contains {CONTEXT + 10} input tokens, which exceeds this limit",
        ),
        (
            "/v1/completions",
            {"prompt": "every region grew " * CONTEXT, "max_tokens": 4},
            "input_tokens",
            f"However, your prompt contains at least {CONTEXT + 1} input tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "every region grew " * CONTEXT}]},
            "input_tokens",
            f"However, your prompt contains at least {CONTEXT + 1} input tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": CONTEXT + 1},
            "max_tokens",
            f"max_tokens={CONTEXT + 1} cannot be greater than max_model_len={CONTEXT}.",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": CONTEXT + 1},
            "max_completion_tokens",
            f"max_completion_tokens={CONTEXT + 1} cannot be greater than max_model_len={CONTEXT}.",
        ),
    ],
)
async def test_what_the_engine_refuses_is_refused_before_any_engine_in_the_engines_words(
    router: httpx.AsyncClient, small_context: SimCluster, path: str, body: dict[str, object], param: str, message: str
) -> None:
    before = await engine_requests(small_context)
    refused = await router.post(path, json={"model": MODEL, **body})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert message in error["message"]
    assert await engine_requests(small_context) == before


@pytest.mark.parametrize("value", ["lots", [1], {"n": 1}, CONTEXT * 2])
async def test_text_completions_ignore_max_completion_tokens_as_the_engine_does(
    router: httpx.AsyncClient, value: object
) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "max_completion_tokens": value}
    answer = await router.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text


async def test_continuous_usage_chunks_reach_the_client_as_the_engine_wrote_them(
    router: httpx.AsyncClient, small_context: SimCluster
) -> None:
    body = {
        "model": MODEL,
        "prompt": [7] * 200,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    through_router = (await router.post("/v1/completions", json=body)).content
    async with httpx.AsyncClient(timeout=30) as direct:
        from_engine = (await direct.post(f"{small_context.decode_urls[0]}/v1/completions", json=body)).content

    def usage_keys(stream: bytes) -> list[list[str]]:
        events = [e.removeprefix(b"data: ") for e in stream.split(b"\n\n") if e.startswith(b"data: {")]
        return [sorted(orjson.loads(e).get("usage") or {}) for e in events]

    assert usage_keys(through_router) == usage_keys(from_engine)


async def test_healthcheck_answers_as_health(router: httpx.AsyncClient) -> None:
    health, healthcheck = await router.get("/health"), await router.get("/healthcheck")
    assert healthcheck.status_code == health.status_code == 200
    assert healthcheck.json() == health.json()
