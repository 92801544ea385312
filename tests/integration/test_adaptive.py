"""Adaptive disaggregation on loopback: the effective threshold follows the decoder's load."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, chat_body, metric, running_router, settled

MEDIUM = "Each quarter the regional teams reported their numbers in the same format. " * 40
OTHER = "A river runs through the valley past the old mill and the village school every spring. " * 40
BUSY_DECODE = ["--decode-step-base", "0.01"]


@asynccontextmanager
async def adaptive_router(
    tokenizer_dir: Path, engine_args: list[str], **settings: Any
) -> AsyncIterator[tuple[SimCluster, str, httpx.AsyncClient]]:
    """One prefill and one decode engine behind an adaptive router (no exploration, admin key "ops")."""
    async with (
        SimCluster(
            in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL, extra_args=engine_args
        ) as cluster,
        running_router(
            prefill_urls=cluster.prefill_urls,
            decode_urls=cluster.decode_urls,
            tokenizer=str(tokenizer_dir),
            threshold_mode="adaptive",
            routing_threshold=2048,
            min_threshold=64,
            explore_share=0.0,
            admin_key_hashes=[hash_key("ops")],
            **settings,
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
    ):
        yield cluster, base_url, client


async def test_the_effective_threshold_falls_when_the_decoder_gets_busy(tokenizer_dir: Path) -> None:
    async with adaptive_router(tokenizer_dir, BUSY_DECODE, load_scrape_interval=0.2) as (cluster, base_url, client):
        decoder = {"decoder": cluster.decode_urls[0]}
        idle = await metric(base_url, "dpd_router_adaptive_threshold_tokens", decoder)
        assert math.isinf(idle), "an idle decoder keeps every prompt"
        quiet = await client.post("/v1/chat/completions", json=chat_body(MEDIUM, stream=True))
        assert quiet.status_code == 200

        async def long_stream(i: int) -> None:
            async with client.stream(
                "POST", "/v1/chat/completions", json=chat_body(f"{i} hello", max_tokens=300, stream=True)
            ) as r:
                await r.aread()

        background = [asyncio.create_task(long_stream(i)) for i in range(24)]
        async with asyncio.timeout(20):
            while (busy := await metric(base_url, "dpd_router_adaptive_threshold_tokens", decoder)) > 400:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert busy < 400
        loaded = await client.post("/v1/chat/completions", json=chat_body(OTHER, stream=True))
        assert loaded.status_code == 200
        routing = (await client.get("/admin/routing", headers={"Authorization": "Bearer ops"})).json()
        assert routing["threshold_mode"] == "adaptive"
        assert any("streams" in line for line in routing["summary"])
        await asyncio.gather(*background)
        await settled(base_url)

        decisions = {
            reason: await metric(base_url, "dpd_router_route_decisions_total", {"reason": reason})
            for reason in ("adaptive_cheaper_direct", "adaptive_interference")
        }
        assert decisions["adaptive_cheaper_direct"] >= 1, "quiet: the medium prompt stayed on the decoder"
        assert decisions["adaptive_interference"] >= 1, "busy: the medium prompt went to the prefill pool"
        learned = await metric(
            base_url, "dpd_router_adaptive_cost", {"model": "direct_prefill", "term": "observations"}
        )
        assert learned >= 1, "the direct path's timings were learned"


async def test_a_streamed_direct_prompt_counts_in_its_decoders_queue_until_its_first_token(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What the adaptive decision reads as the direct path's queue: prompts on the decoder without a first token.
    A request planned meanwhile carries that queue in its trace (its log line, and what its timings teach)."""
    caplog.set_level("INFO", logger="dpd_router.request")
    slow_prefill = ["--prefill-overhead", "1.5", "--decode-step-base", "0.05"]
    async with adaptive_router(tokenizer_dir, slow_prefill) as (_, base_url, client):
        ops = {"Authorization": "Bearer ops"}

        async def decoder_queue() -> float:
            (entry,) = (await client.get("/admin/routing", headers=ops)).json()["decoders"]
            return float(entry["decoder_queue"])

        assert await decoder_queue() == 0
        first_token = asyncio.Event()
        after_first_token: list[float] = []

        async def stream() -> None:
            body = chat_body(MEDIUM, max_tokens=40, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                async for line in lines:
                    if '"content"' in line and '"content":""' not in line:
                        break
                first_token.set()
                after_first_token.append(await decoder_queue())  # 40 tokens at 50 ms a step: still streaming
                async for _ in lines:
                    pass

        streaming = asyncio.create_task(stream())
        async with asyncio.timeout(10):
            while (queued := await decoder_queue()) == 0 and not first_token.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        summary = (await client.get("/admin/routing", headers=ops)).json()["summary"]
        behind = await client.post("/v1/chat/completions", json=chat_body(OTHER, max_tokens=4, stream=True))
        assert behind.status_code == 200
        await streaming
        assert queued > 400, "the direct prompt's tokens are queued for the decoder's prefill"
        assert any("prompt tokens await its prefill" in line for line in summary)
        assert after_first_token == [0]
        await settled(base_url)
        assert await decoder_queue() == 0
        logged = [r.fields for r in caplog.records if r.getMessage().startswith("Conditional routing")]  # type: ignore[attr-defined]
        first = next(f for f in logged if f["decoder_queue_tokens"] == 0)
        assert first["reason"] == "adaptive_cheaper_direct", "an idle decoder kept the prompt"
        assert [f["decoder_queue_tokens"] for f in logged if f is not first] == [queued]


async def test_the_itl_budget_counts_the_decoders_gaps_from_finished_streams(tokenizer_dir: Path) -> None:
    """With itl_slo_share the decoder's recent inter-token gaps are the budget's measure: each finished
    stream adds its gaps (output tokens - 1); /metrics and /admin/routing show them and the share spent."""
    slos = {"itl_slo": 0.25, "itl_slo_share": 0.005, "ttft_slo": 1.0, "ttft_slo_max_tokens": 4095}
    async with adaptive_router(tokenizer_dir, [], **slos) as (cluster, base_url, client):
        for i in range(3):
            async with client.stream(
                "POST", "/v1/chat/completions", json=chat_body(f"{i} hello", max_tokens=21, stream=True)
            ) as r:
                assert r.status_code == 200
                await r.aread()
        await settled(base_url)
        labels = {"model": "itl_budget", "endpoint": cluster.decode_urls[0]}
        gaps = await metric(base_url, "dpd_router_adaptive_cost", labels | {"term": "recent_gaps"})
        assert 0.8 * 60 <= gaps <= 60, "3 streams of 21 tokens: 60 gaps, fading with a 30 s half-life"
        assert await metric(base_url, "dpd_router_adaptive_cost", labels | {"term": "late_share"}) == 0
        summary = (await client.get("/admin/routing", headers={"Authorization": "Bearer ops"})).json()["summary"]
        assert any("0.00% of decoder" in line and "itl_slo_share allows 0.50%" in line for line in summary)
        scoped = "ttft_slo 1 s for prompts up to 4,095 uncached tokens (longer ones have none)"
        assert f"SLOs: {scoped}; itl_slo 0.25 s." in summary
