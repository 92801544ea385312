"""dpd-router in front of two real vLLM engines that move the KV cache over NIXL."""

from __future__ import annotations

import pytest

from dpd_sim.vllm_cpu import VllmPair
from tests.e2e_vllm.conftest import EngineCounters, ask, eventually, long_text, metric_total
from tests.integration.conftest import settled


async def routed(router: str, path: str, reason: str) -> float:
    return await metric_total(router, "dpd_router_route_decisions_total", path=path, reason=reason)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_long_prompt_is_prefilled_on_one_engine_and_decoded_on_the_other_with_nixl(
    router: str, nixl_pair: VllmPair, kind: str, stream: bool
) -> None:
    prompt = long_text(seed=f"long-{kind}-{stream}")
    before = await EngineCounters.read(nixl_pair)
    disaggregated = await routed(router, "disaggregated", "long_prompt")

    text, usage = await ask(router, kind, prompt, stream=stream)

    async def transferred() -> bool:
        """the decoder's vllm:nixl_xfer_time_seconds_count grew"""
        return (await EngineCounters.read(nixl_pair)).nixl_transfers > before.nixl_transfers

    await eventually(transferred)
    after = await EngineCounters.read(nixl_pair)
    assert after.prefill_requests == before.prefill_requests + 1, "the prefiller ran the prefill hop"
    assert after.decode_requests == before.decode_requests + 1
    assert await routed(router, "disaggregated", "long_prompt") == disaggregated + 1

    # The same request on one engine, no transfer: greedy decoding gives the same tokens.
    reference, reference_usage = await ask(nixl_pair.prefill.url, kind, prompt, stream=False)
    assert text == reference
    assert usage is not None and reference_usage is not None
    assert usage.prompt_tokens == reference_usage.prompt_tokens > 256
    assert usage.completion_tokens == reference_usage.completion_tokens


@pytest.mark.parametrize(("kind", "stream"), [("chat", True), ("completion", False)])
async def test_short_prompt_bypasses_the_prefiller(router: str, nixl_pair: VllmPair, kind: str, stream: bool) -> None:
    before = await EngineCounters.read(nixl_pair)
    direct = await routed(router, "direct", "below_threshold")

    prompt = f"Hello, say something about {kind} {stream}."
    text, usage = await ask(router, kind, prompt, stream=stream)

    async def decoded() -> bool:
        """the decoder counted the request"""
        return (await EngineCounters.read(nixl_pair)).decode_requests > before.decode_requests

    await eventually(decoded)
    after = await EngineCounters.read(nixl_pair)
    assert after.prefill_requests == before.prefill_requests, "the prefiller must not see a short prompt"
    assert after.prefill_prompt_tokens == before.prefill_prompt_tokens
    assert after.nixl_transfers == before.nixl_transfers
    assert after.decode_requests == before.decode_requests + 1
    assert await routed(router, "direct", "below_threshold") == direct + 1
    reference, reference_usage = await ask(
        nixl_pair.decode.url, kind, f"Hello, say something about {kind} {stream}.", stream=False
    )
    assert text == reference
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        reference_usage.prompt_tokens,
        reference_usage.completion_tokens,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_usage_reports_the_prefillers_cached_tokens(router: str, nixl_pair: VllmPair, stream: bool) -> None:
    """The decoder counts the transferred tokens as cached; the client is told what the prefiller reused."""
    prompt = long_text(seed=f"cached-{stream}")
    prefill_hits = await metric_total(nixl_pair.prefill.url, "vllm:prefix_cache_hits_total")
    _, first = await ask(router, "chat", prompt, stream=stream)
    assert first is not None and first.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0, "a prompt the prefiller never saw: nothing was reused"
    assert await metric_total(nixl_pair.prefill.url, "vllm:prefix_cache_hits_total") == prefill_hits

    # The same prompt again: the prefiller reuses its own prefix cache, in whole blocks.
    _, second = await ask(router, "chat", prompt, stream=stream)
    reused = await metric_total(nixl_pair.prefill.url, "vllm:prefix_cache_hits_total") - prefill_hits
    assert second is not None and second.prompt_tokens_details is not None
    assert 0 < second.prompt_tokens_details.cached_tokens == reused < second.prompt_tokens
    assert (second.prompt_tokens, second.completion_tokens) == (first.prompt_tokens, first.completion_tokens)


async def test_a_working_transfer_is_not_reported_ineffective(router: str, nixl_pair: VllmPair) -> None:
    before = await EngineCounters.read(nixl_pair)
    ineffective = await metric_total(router, "dpd_router_kv_transfer_ineffective_total")

    await ask(router, "chat", long_text(seed="effective"), stream=False)

    async def transferred() -> bool:
        """the decoder's vllm:nixl_xfer_time_seconds_count grew"""
        return (await EngineCounters.read(nixl_pair)).nixl_transfers > before.nixl_transfers

    await eventually(transferred)
    await settled(router)
    assert await metric_total(router, "dpd_router_kv_transfer_ineffective_total") == ineffective
