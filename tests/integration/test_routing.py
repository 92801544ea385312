"""Routing decisions on loopback: prefix affinity, cache-aware thresholds, sessions."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, metric, openai_client, requests_seen, running_router

THRESHOLD = 64
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


def document(seed: int, words: int = 160) -> str:
    """A long, distinct text per seed (shares no prefix with other seeds' documents)."""
    return f"Document {seed}: " + " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


async def prefiller_of(cluster: SimCluster, request_id: str) -> str | None:
    for url in cluster.prefill_urls:
        if await requests_seen(url, request_id):
            return url
    return None


async def ask(base_url: str, content: str, *, request_id: str, **headers: str) -> object:
    return await openai_client(base_url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        extra_headers={"X-Request-Id": request_id, **headers},
    )


async def test_requests_sharing_a_long_prefix_land_on_the_same_prefiller(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    async with running_router(
        prefill_urls=cluster.prefill_urls,
        decode_urls=cluster.decode_urls,
        tokenizer=str(tokenizer_dir),
        routing_threshold=THRESHOLD,
        prefill_strategy="prefixaware",
        threshold_mode="static",
    ) as base_url:
        chosen: dict[int, set[str | None]] = {}
        # New prefixes are placed by hash: enough of them that all landing on one prefiller is a 1 in 30,000 chance.
        for seed in range(16):
            for question in ("What is the first word?", "Summarise it."):
                request_id = f"prefix-{seed}-{uuid.uuid4().hex[:8]}"
                await ask(base_url, f"{document(seed)}\n\n{question}", request_id=request_id)
                chosen.setdefault(seed, set()).add(await prefiller_of(cluster, request_id))
        assert all(len(prefillers) == 1 and None not in prefillers for prefillers in chosen.values()), chosen
        used = set().union(*chosen.values())
        assert used == set(cluster.prefill_urls), "distinct prefixes still spread over the pool"


async def test_a_prefix_already_on_the_decoder_makes_a_long_prompt_go_direct(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    async with running_router(
        prefill_urls=cluster.prefill_urls,
        decode_urls=cluster.decode_urls,
        tokenizer=str(tokenizer_dir),
        routing_threshold=THRESHOLD,
        threshold_mode="cache_aware",
    ) as base_url:
        context = document(99, words=200)
        first_id, follow_up_id = f"turn1-{uuid.uuid4().hex[:8]}", f"turn2-{uuid.uuid4().hex[:8]}"
        await ask(base_url, context, request_id=first_id)
        assert await prefiller_of(cluster, first_id) is not None, "the first turn is long and uncached"

        answer = await ask(base_url, context + " And one more short question?", request_id=follow_up_id)
        assert await prefiller_of(cluster, follow_up_id) is None, "the follow-up's prefix sits on the decoder"
        decoded = [entry for url in cluster.decode_urls for entry in await requests_seen(url, follow_up_id)]
        assert [entry["kind"] for entry in decoded] == ["local"]
        assert decoded[0]["cached_tokens"] > THRESHOLD, "the decoder really had the prefix cached"
        assert answer.usage is not None and answer.usage.prompt_tokens >= THRESHOLD
        reasons = {"path": "direct", "reason": "cached_on_decoder"}
        assert await metric(base_url, "dpd_router_route_decisions_total", reasons) == 1


@pytest.mark.parametrize("strategy", ["session"])
async def test_a_session_sticks_to_one_prefiller(cluster: SimCluster, tokenizer_dir: Path, strategy: str) -> None:
    async with running_router(
        prefill_urls=cluster.prefill_urls,
        decode_urls=cluster.decode_urls,
        tokenizer=str(tokenizer_dir),
        routing_threshold=THRESHOLD,
        prefill_strategy=strategy,
        threshold_mode="static",
    ) as base_url:
        sessions: dict[str, set[str | None]] = {}
        for session in ("alice", "bob", "carol", "dave"):
            for turn in range(3):
                request_id = f"{session}-{turn}-{uuid.uuid4().hex[:8]}"
                await ask(
                    base_url, document(turn * 13 + len(session)), request_id=request_id, **{"x-session-id": session}
                )
                sessions.setdefault(session, set()).add(await prefiller_of(cluster, request_id))
        assert all(len(chosen) == 1 and None not in chosen for chosen in sessions.values()), sessions
