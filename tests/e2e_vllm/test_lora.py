"""A LoRA adapter through both hops of real vLLM engines: built on the spot for the tiny model, loaded on
both engines at runtime, found by the router in their /v1/models, its long prompt prefilled with the
adapter on one engine and decoded with it on the other over NIXL, answering as the decoder alone does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dpd_sim.vllm_cpu import MODEL_NAME, VllmPair, write_lora_adapter
from tests.e2e_vllm.conftest import (
    REQUEST_TIMEOUT,
    EngineCounters,
    counters_after_a_transfer,
    long_text,
    openai_client,
    router_for,
)
from tests.integration.conftest import local_client

ADAPTER = "tiny-sql"


@pytest.fixture(scope="module")
async def adapter(nixl_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """The adapter loaded on both engines for this module's tests, unloaded after."""
    path = write_lora_adapter(tmp_path_factory.mktemp("lora") / ADAPTER, nixl_pair.model_dir)
    async with local_client(timeout=REQUEST_TIMEOUT) as client:
        for engine in nixl_pair.engines:
            loaded = await client.post(
                f"{engine.url}/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(path)}
            )
            assert loaded.status_code == 200, f"{engine.role}: {loaded.text[:500]}"
        try:
            yield ADAPTER
        finally:
            for engine in nixl_pair.engines:
                await client.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": ADAPTER})


async def greedy(base_url: str, model: str, content: str) -> tuple[str, int]:
    async with openai_client(base_url) as client:
        answer = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=16, temperature=0
        )
    assert answer.usage is not None
    return answer.choices[0].message.content or "", answer.usage.prompt_tokens


async def test_an_adapters_long_prompt_transfers_kv_over_nixl_and_answers_as_the_decoder_alone(
    nixl_pair: VllmPair, adapter: str
) -> None:
    async with router_for(nixl_pair) as router, openai_client(router) as client:
        async with asyncio.timeout(30):
            while adapter not in [model.id for model in (await client.models.list()).data]:  # noqa: ASYNC110
                await asyncio.sleep(0.25)
        listed = {model.id: getattr(model, "parent", None) for model in (await client.models.list()).data}
        assert listed == {MODEL_NAME: None, adapter: MODEL_NAME}

        content = long_text(seed="lora-long")
        before = await EngineCounters.read(nixl_pair)
        text, prompt_tokens = await greedy(router, adapter, content)
        after = await counters_after_a_transfer(nixl_pair, before)
        assert after.prefill_requests == before.prefill_requests + 1, "the prefiller ran the adapter's prefill"
        assert after.decode_requests == before.decode_requests + 1
        assert prompt_tokens > 256

    alone, _ = await greedy(nixl_pair.decode.url, adapter, content)
    assert text == alone, "greedy: the adapter's answer, as the decoder alone gives it"
    base, _ = await greedy(nixl_pair.decode.url, MODEL_NAME, content)
    assert text != base, "the adapter changed the answer: both hops ran with it"
