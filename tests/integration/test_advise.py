"""`dpd-router advise` against live routers on loopback, in front of simulated engines.

The decoders prefill ten times slower per token than the prefillers, and the prefill hop costs a fixed
170 ms (the prefillers' `--prefill-overhead`): the direct path wins for short prompts, the
disaggregated one from about a thousand tokens, so a crossover exists. Two routers share the prefill
pool, each with a decoder of its own: the "main" one disaggregates prompts of 256 tokens or more,
the "canary" one serves every prompt direct (the A/B advise recommends for collecting evidence), and
the same mixed workload goes through both. advise then reads their live /metrics, as the CLI does.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpd_router.advise.plot import matplotlib_available
from dpd_router.record.metrics import PROMPT_LENGTH_BOUNDS
from dpd_sim.cluster import SimCluster
from dpd_sim.tokenizer_kit import VOCAB_SIZE
from tests.integration.conftest import MODEL, openai_client, running_router

MAIN_THRESHOLD = 256
CANARY_THRESHOLD = 1_000_000
# Prompt lengths (tokens): one per prompt-length bucket from 1-128 to 2049-4096.
LENGTHS = (90, 300, 700, 1500, 3000)
REPEATS = 4
DECODER_TIMING = ("--prefill-per-token", "0.0002")
PREFILLER_TIMING = ("--prefill-overhead", "0.17")


@dataclass
class Setup:
    main: str
    canary: str
    sent: dict[str, int]  # requests per router


async def _drive(base_url: str, seed: int) -> int:
    """The mixed workload through one router, one request at a time: streamed completions of exact token
    counts (unique from their first token, so no prefix cache helps) and a couple of chats."""
    client = openai_client(base_url, timeout=30)
    rng = random.Random(seed)
    sent = 0
    for _ in range(REPEATS):
        for length in LENGTHS:
            prompt = [rng.randrange(10, VOCAB_SIZE - 1) for _ in range(length)]
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True)
            async for _ in stream:
                pass
            sent += 1
    for content in ("Hello there!", "Summarise this. " + "The report shows steady growth in every region. " * 40):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4, stream=True
        )
        async for _ in stream:
            pass
        sent += 1
    return sent


@pytest.fixture(scope="module")
async def live(tokenizer_dir: Path) -> AsyncIterator[Setup]:
    engine_args = {"prefill-0": PREFILLER_TIMING, "prefill-1": PREFILLER_TIMING}
    engine_args |= {"decode-0": DECODER_TIMING, "decode-1": DECODER_TIMING}
    common: dict[str, Any] = {"tokenizer": str(tokenizer_dir), "model": MODEL}
    async with (
        SimCluster(
            in_process=True, prefill=2, decode=2, tokenizer=tokenizer_dir, model=MODEL, engine_args=engine_args
        ) as cluster,
        running_router(
            prefill_urls=cluster.prefill_urls,
            decode_urls=cluster.decode_urls[:1],
            routing_threshold=MAIN_THRESHOLD,
            **common,
        ) as main,
        running_router(
            prefill_urls=cluster.prefill_urls,
            decode_urls=cluster.decode_urls[1:],
            routing_threshold=CANARY_THRESHOLD,
            **common,
        ) as canary,
    ):
        counts = await asyncio.gather(_drive(main, 1), _drive(canary, 2))
        yield Setup(main, canary, {"main": counts[0], "canary": counts[1]})


async def advise(*args: str) -> tuple[int, str, str]:
    """`dpd-router advise ARGS` as a subprocess, as an operator runs it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dpd_router.cli",
        "advise",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import httpx

    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{base_url}/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
    )


def valid_thresholds() -> set[int]:
    return set(PROMPT_LENGTH_BOUNDS) | {1}


async def test_advise_reads_live_routers_and_finds_the_crossover(live: Setup, tmp_path: Path) -> None:
    plot = tmp_path / "ttft.png"
    plotting = matplotlib_available()  # --plot is exercised when the bench extra is installed
    code, out, err = await advise(
        "--metrics", live.main, "--metrics", f"{live.canary}/metrics", "--min-requests", "3", "--json",
        *(("--plot", str(plot)) if plotting else ()),
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    main, canary = await asyncio.gather(scrape(live.main), scrape(live.canary))

    # The counts add up: requests per path, in the TTFT table, in the prompt-token histogram.
    sent = sum(live.sent.values())
    for path in ("direct", "disaggregated"):
        exported = total(main, "dpd_router_requests_total", path=path) + total(
            canary, "dpd_router_requests_total", path=path
        )
        assert report["requests"][path] == exported
        assert sum(row[path]["requests"] for row in report["ttft"]) == exported
        assert report["prompt_tokens"]["by_path"][path]["requests"] == exported
    assert sum(report["requests"].values()) == sent == report["prompt_tokens"]["requests"]
    assert report["requests"]["disaggregated"] == total(main, "dpd_router_route_decisions_total", path="disaggregated")
    assert report["thresholds"] == [MAIN_THRESHOLD, CANARY_THRESHOLD]
    assert report["ratio"]["load"]["prefill"]["engines"] == 2 and report["ratio"]["load"]["decode"]["engines"] == 2

    # Every bucket from 257-512 up has both paths (the main router disaggregates, the canary does not).
    comparable = [row["label"] for row in report["ttft"] if row["comparable"]]
    assert comparable == ["512", "1024", "2048", "4096"], json.dumps(report["ttft"], indent=1)
    rec = report["recommendation"]
    assert rec["threshold"] in valid_thresholds(), rec
    detail = json.dumps({"recommendation": rec, "ttft": report["ttft"]}, indent=1)
    assert (rec["verdict"], rec["basis"]) == ("crossover", "measured"), detail
    assert rec["threshold"] in (512, 1024, 2048), detail  # about a thousand tokens, by construction
    faster = {row["label"]: row["faster"] for row in report["ttft"] if row["comparable"]}
    assert faster["512"] == "direct" and faster["4096"] == "disaggregated", detail
    if plotting:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_one_router_alone_has_no_comparable_bucket(live: Setup) -> None:
    code, out, err = await advise("--metrics", live.main, "--min-requests", "3")
    assert code == 0, err
    # Each prompt length took one path only on the main router: no verdict, and a reason with the way out.
    assert "not enough evidence" in out
    assert "Recommended threshold: none (not enough evidence)" in out
    assert "run a second router with another threshold" in out
    assert "TTFT by prompt length and path" in out and "Recommended prefill:decode ratio:" in out


async def test_window_without_traffic(live: Setup) -> None:
    code, out, err = await advise("--metrics", live.main, "--window", "0.3", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["prompt_tokens"]["requests"] == 0 and report["recommendation"]["threshold"] is None
    assert any("no requests" in warning for warning in report["warnings"])
