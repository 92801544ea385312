"""kv_connector: shared_storage in front of two real engines running vLLM's ExampleConnector on one directory."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dpd_sim.vllm_cpu import VllmPair
from tests.e2e_vllm.conftest import (
    THRESHOLD,
    EngineCounters,
    Engines,
    ask,
    eventually,
    long_text,
    metric_total,
    router_for,
)

CACHE_HIT = "External Cache Hit!"


@pytest.fixture(scope="module")
async def shared_pair(engines: Engines) -> VllmPair:
    """The shared-storage pair (the NIXL pair, if running, is stopped first: one pair fits at a time)."""
    return await engines.pair("shared_storage")


@pytest.fixture(scope="module")
async def shared_router(shared_pair: VllmPair) -> AsyncIterator[str]:
    async with router_for(shared_pair, kv_connector="shared_storage") as base_url:
        yield base_url


@pytest.mark.parametrize(("kind", "stream"), [("chat", False), ("chat", True), ("completion", True)])
async def test_long_prompt_is_saved_by_the_prefiller_and_loaded_by_the_decoder(
    shared_router: str, shared_pair: VllmPair, kind: str, stream: bool
) -> None:
    prompt = long_text(seed=f"shared-{kind}-{stream}")
    hits = shared_pair.decode.log_text().count(CACHE_HIT)
    before = await EngineCounters.read(shared_pair)

    text, usage = await ask(shared_router, kind, prompt, stream=stream)

    assert shared_pair.decode.log_text().count(CACHE_HIT) == hits + 1, "the decoder loaded the KV from disk"
    external = await metric_total(shared_pair.decode.url, "vllm:external_prefix_cache_hits_total")
    assert external > 0

    async def counted() -> bool:
        """both engines counted their hop"""
        now = await EngineCounters.read(shared_pair)
        return now.prefill_requests > before.prefill_requests and now.decode_requests > before.decode_requests

    await eventually(counted)
    after = await EngineCounters.read(shared_pair)
    assert (after.prefill_requests, after.decode_requests) == (before.prefill_requests + 1, before.decode_requests + 1)

    reference, reference_usage = await ask(shared_pair.prefill.url, kind, prompt, stream=False)
    assert text == reference
    assert usage is not None and usage.prompt_tokens == reference_usage.prompt_tokens > THRESHOLD
    assert usage.completion_tokens == reference_usage.completion_tokens


async def test_short_prompt_bypasses_the_prefiller(shared_router: str, shared_pair: VllmPair) -> None:
    before = await EngineCounters.read(shared_pair)
    text, _ = await ask(shared_router, "chat", "Hello, what is new?", stream=True)

    async def decoded() -> bool:
        """the decoder counted the request"""
        return (await EngineCounters.read(shared_pair)).decode_requests > before.decode_requests

    await eventually(decoded)
    after = await EngineCounters.read(shared_pair)
    assert (after.prefill_requests, after.prefill_prompt_tokens) == (
        before.prefill_requests,
        before.prefill_prompt_tokens,
    )
    reference, _ = await ask(shared_pair.decode.url, "chat", "Hello, what is new?", stream=False)
    assert text == reference
