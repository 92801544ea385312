"""A prefill engine that goes away costs speed, not answers; when it comes back, so does disaggregation."""

from __future__ import annotations

import asyncio
import time

from dpd_sim.vllm_cpu import VllmPair
from tests.e2e_vllm.conftest import EngineCounters, ask, long_text, metric_total, warm_up_engine

FALLBACK_REASONS = ("prefill_pool_down", "prefill_failed")


async def fallbacks(router: str) -> float:
    return sum(
        [
            await metric_total(router, "dpd_router_route_decisions_total", path="direct", reason=reason)
            for reason in FALLBACK_REASONS
        ]
    )


async def test_requests_fall_back_to_the_decoder_while_the_prefiller_is_down_then_disaggregate_again(
    router: str, nixl_pair: VllmPair
) -> None:
    await nixl_pair.stop_engine("prefill")
    try:
        for stream in (False, True):
            prompt = long_text(seed=f"fallback-{stream}")
            fell_back = await fallbacks(router)
            text, usage = await ask(router, "chat", prompt, stream=stream)
            assert await fallbacks(router) == fell_back + 1, "a long prompt is served by the decoder alone"
            reference, reference_usage = await ask(nixl_pair.decode.url, "chat", prompt, stream=False)
            assert text == reference
            assert usage is not None and usage.prompt_tokens == reference_usage.prompt_tokens > 256
    finally:
        await nixl_pair.start_engine("prefill")
    await warm_up_engine(nixl_pair.prefill)

    # The router sees the prefiller healthy again within a few probes (and any open breaker's cool-down).
    deadline = time.monotonic() + 120
    attempt = 0
    while True:
        attempt += 1
        before = await EngineCounters.read(nixl_pair)
        retried = await metric_total(router, "dpd_router_retries_total", hop="decode")
        disaggregated = await metric_total(router, "dpd_router_route_decisions_total", path="disaggregated")
        text, _ = await ask(router, "chat", long_text(seed=f"resumed-{attempt}"), stream=True)
        assert text
        if await metric_total(router, "dpd_router_route_decisions_total", path="disaggregated") > disaggregated:
            break
        assert time.monotonic() < deadline, "the router never sent a long prompt to the restarted prefiller"
        await asyncio.sleep(3)
    await asyncio.sleep(1)
    after = await EngineCounters.read(nixl_pair)
    # One prefill per decode attempt: a decoder whose first NIXL handshake with the new engine fails (seen
    # in CI: it timed out, and the decoder answered 500) is retried by the router, which stages the prompt
    # again, since the failed call may have consumed its blocks.
    decode_retries = await metric_total(router, "dpd_router_retries_total", hop="decode") - retried
    assert after.prefill_requests == before.prefill_requests + 1 + decode_retries
    assert after.nixl_transfers > before.nixl_transfers, "the decoder pulled the KV from the new prefill engine"
