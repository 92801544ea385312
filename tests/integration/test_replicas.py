"""Router replicas as separate processes in front of the same engines: one behaviour, no shared state."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, router_process
from tests.integration.test_routing import ask, document, prefiller_of

THRESHOLD = 256
# Longer than prefixaware's hashed key (1024 tokens), so every question about one document shares it.
DOCUMENT_WORDS = 400
QUESTIONS = ("What is the first word?", "Summarise it.", "How many words are there?")


@asynccontextmanager
async def replica(cluster: SimCluster, tokenizer_dir: Path, log: Path, hash_seed: int) -> AsyncIterator[str]:
    """`dpd-router serve` in its own process (its own PYTHONHASHSEED); yields its base URL once ready."""
    args = ["--tokenizer", str(tokenizer_dir), "--routing-threshold", str(THRESHOLD), "--threshold-mode", "static"]
    args += ["--prefill-strategy", "prefixaware", "--model", MODEL, "--log-level", "warning"]
    for url in cluster.prefill_urls:
        args += ["--prefill", url]
    for url in cluster.decode_urls:
        args += ["--decode", url]
    async with router_process(log, *args, env={"PYTHONHASHSEED": str(hash_seed)}) as base_url:
        yield base_url


async def test_two_router_processes_prefill_each_prefix_on_one_prefiller(tokenizer_dir: Path, tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(
            SimCluster(in_process=True, prefill=3, decode=2, tokenizer=tokenizer_dir, model=MODEL)
        )
        routers = [
            await stack.enter_async_context(replica(cluster, tokenizer_dir, tmp_path / f"router-{i}.log", seed))
            for i, seed in enumerate((1, 2))
        ]
        rng = random.Random(22)
        # Every prefix reaches both replicas; the third send goes to either.
        senders = {seed: rng.sample([*routers, rng.choice(routers)], 3) for seed in range(12)}
        sent: dict[int, list[str]] = {seed: [] for seed in senders}

        async def send(seed: int, turn: int) -> None:
            request_id = f"replica-{seed}-{turn}-{uuid.uuid4().hex[:8]}"
            content = f"{document(seed, words=DOCUMENT_WORDS)}\n\n{QUESTIONS[turn]}"
            await ask(senders[seed][turn], content, request_id=request_id)
            sent[seed].append(request_id)

        for turn in range(3):  # each round in parallel: the replicas' in-flight counts differ as they place
            await asyncio.gather(*(send(seed, turn) for seed in senders))

        placed = {seed: {await prefiller_of(cluster, request_id) for request_id in ids} for seed, ids in sent.items()}
        assert all(len(prefillers) == 1 and None not in prefillers for prefillers in placed.values()), placed
        used = set().union(*placed.values())
        assert len(used) >= 2, "distinct prefixes spread over the prefillers"
