"""The real engines speak the NIXL protocol docs/connectors.md describes (no router involved)."""

from __future__ import annotations

import orjson
import pytest

from dpd_router.prompt.tokenizer import LocalTokenizer
from dpd_router.request.client_request import parse_request
from dpd_router.transfer.base import prefill_prompt_ids
from dpd_sim.vllm_cpu import VllmPair
from tests.e2e_vllm.conftest import (
    ANSWER_TOKENS,
    MODEL_NAME,
    chat,
    completion,
    eventually,
    long_text,
    metric_total,
    post,
)

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_prefill_answer_carries_top_level_kv_transfer_params_the_decoder_accepts(
    nixl_pair: VllmPair, kind: str
) -> None:
    path, body = (
        ("/v1/chat/completions", chat(long_text(seed=f"protocol-{kind}")))
        if kind == "chat"
        else ("/v1/completions", completion(long_text(seed=f"protocol-{kind}")))
    )
    staged = await post(
        nixl_pair.prefill.url,
        path,
        {**body, "max_tokens": 1, "stream": False, "return_token_ids": True, "kv_transfer_params": PREFILL_KV_PARAMS},
    )
    assert staged["choices"][0]["finish_reason"] == "length"
    # The prompt's ids, where the router reads them, and what the router's own tokenizer makes of the prompt.
    ids = prefill_prompt_ids(staged, staged["usage"]["prompt_tokens"])
    local = LocalTokenizer.load(nixl_pair.tokenizer_dir, inline_max_chars=1 << 20, threads=1)
    try:
        request = parse_request("chat" if kind == "chat" else "completion", orjson.dumps(body))
        assert ids is not None and ids == list((await local.tokenize(request)).token_ids)
    finally:
        await local.aclose()
    params = staged["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == int(nixl_pair.prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert params["remote_engine_id"] and params["remote_block_ids"]
    prompt_tokens = staged["usage"]["prompt_tokens"]

    external_hits = await metric_total(nixl_pair.decode.url, "vllm:external_prefix_cache_hits_total")
    transfers = await metric_total(nixl_pair.decode.url, "vllm:nixl_xfer_time_seconds_count")
    decoded = await post(nixl_pair.decode.url, path, {**body, "kv_transfer_params": params})
    assert decoded["model"] == MODEL_NAME
    assert decoded["usage"]["prompt_tokens"] == prompt_tokens
    assert decoded["usage"]["completion_tokens"] == ANSWER_TOKENS or decoded["choices"][0]["finish_reason"] == "stop"
    # vLLM 0.32 reconciles usage itself: the prefiller passes its own cache hit on as
    # remote_prefill_cached_tokens, and the decoder reports that instead of the transferred tokens.
    cached_on_prefiller = staged["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert params["remote_prefill_cached_tokens"] == cached_on_prefiller
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_on_prefiller == 0

    async def pulled() -> bool:
        """the decoder pulled the whole prompt over NIXL (external prefix-cache hits)"""
        hits = await metric_total(nixl_pair.decode.url, "vllm:external_prefix_cache_hits_total")
        return hits - external_hits == prompt_tokens

    await eventually(pulled)
    assert await metric_total(nixl_pair.decode.url, "vllm:nixl_xfer_time_seconds_count") > transfers
