"""Two experiment arms end to end: one router splits a mixed workload 50/50 by session between arm t2048
and arm t8192, and `dpd-router advise` reads its /metrics (saved before and after, as an operator does
with curl) and puts the arms side by side, per prompt-length class and path, with each arm routing as its
threshold says. Sixteen requests an arm are far too few for a percentile comparison: advise must say so,
with the hours still needed, and name no winner."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_router.config import Settings
from dpd_router.routing.experiments import arm_position
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import chat_body, cluster_settings, running_router, settled
from tests.integration.test_advise import advise

ARMS = [
    {"name": "t2048", "share": 0.5, "routing_threshold": 2048},
    {"name": "t8192", "share": 0.5, "routing_threshold": 8192},
]
SESSION_HEADER = Settings.model_fields["session_header"].default
SESSIONS_PER_ARM = 4
TURNS = 2  # each turn: a short chat and a long one
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
HOURS = 0.25  # what the scrape is said to span (--hours), for the hours advise says are still needed


def long_prompt(seed: int) -> str:
    """About 3,000 tokens: over arm t2048's threshold, under arm t8192's."""
    return f"Report {seed}: " + " ".join(WORDS[(seed + i * 3) % len(WORDS)] for i in range(770))


def sessions_of(arm_index: int, count: int) -> list[str]:
    """Session keys whose hash falls in this arm's half of [0, 1) (the arms' slices follow their order)."""
    keys = (f"user-{i}" for i in range(10_000))
    return [key for key in keys if int(arm_position(key) * 2) == arm_index][:count]


@dataclass
class Experiment:
    before: Path  # the scrape saved before any traffic
    after: Path  # and after it
    sent: dict[tuple[str, str], int]  # (arm, "short" | "long") -> requests


async def save_scrape(base_url: str, path: Path) -> Path:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{base_url}/metrics")
    response.raise_for_status()
    await asyncio.to_thread(path.write_text, response.text)
    return path


@pytest.fixture(scope="module")
async def experiment(
    cluster: SimCluster, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Experiment]:
    folder = tmp_path_factory.mktemp("arms")
    settings = cluster_settings(cluster, tokenizer_dir, threshold=2048, experiments={"arms": ARMS})
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        before = await save_scrape(base_url, folder / "before.prom")
        sent: dict[tuple[str, str], int] = {}

        async def converse(arm: str, session: str, seed: int) -> None:
            for turn in range(TURNS):
                for kind, content in (("short", f"Hello, turn {turn} of {session}."), ("long", long_prompt(seed))):
                    payload = chat_body(content, max_tokens=4, stream=True)
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=payload, headers={SESSION_HEADER: session}
                    ) as response:
                        assert response.status_code == 200, await response.aread()
                        await response.aread()
                    sent[(arm, kind)] = sent.get((arm, kind), 0) + 1
                    seed += 100

        await asyncio.gather(
            *(
                converse(str(arm["name"]), session, seed=10 * index + k)
                for index, arm in enumerate(ARMS)
                for k, session in enumerate(sessions_of(index, SESSIONS_PER_ARM))
            )
        )
        await settled(base_url)
        after = await save_scrape(base_url, folder / "after.prom")
        yield Experiment(before, after, sent)


async def advise_on(experiment: Experiment, *extra: str) -> str:
    """advise on the experiment's traffic: the scrape after it, less the one before, said to span HOURS."""
    code, out, err = await advise(
        "--file", str(experiment.after), "--since", str(experiment.before), "--hours", str(HOURS), *extra
    )
    assert code == 0, err
    return out


def report_of(out: str) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(out)
    return report


async def test_advise_lists_both_arms_per_class_on_the_path_each_arms_threshold_chose(experiment: Experiment) -> None:
    report = report_of(await advise_on(experiment, "--json"))

    arms = report["arms"]
    assert arms["arms"] == ["t2048", "t8192"]  # no request fell past the arms, into arm live
    assert arms["classes"] == ["1-2048", ">2048"]
    rows = {(row["arm"], row["path"], row["request_class"]): row for row in arms["stats"]}
    sent = experiment.sent
    # Short prompts go direct in both arms; the ~3k-token ones take the prefill hop in t2048 only.
    assert {key: row["requests"] for key, row in rows.items()} == {
        ("t2048", "direct", "1-2048"): sent[("t2048", "short")],
        ("t2048", "disaggregated", ">2048"): sent[("t2048", "long")],
        ("t8192", "direct", "1-2048"): sent[("t8192", "short")],
        ("t8192", "direct", ">2048"): sent[("t8192", "long")],
    }
    for row in rows.values():
        assert set(row["metrics"]) == {"ttft_p50", "ttft_p95", "itl_p99", "e2e_p95"}
        assert row["metrics"]["ttft_p95"]["count"] == row["requests"]  # every request streamed a first token
        assert row["metrics"]["ttft_p50"]["value"] is not None
    assert "promotion" in report and "verdict" in report
    assert report["requests"] == {"direct": 24, "disaggregated": 8}


async def test_too_little_traffic_names_no_winner_and_says_how_many_hours_more(experiment: Experiment) -> None:
    report = report_of(await advise_on(experiment, "--json"))

    comparisons = report["arms"]["comparisons"]
    assert {(c["request_class"], c["metric"]) for c in comparisons} == {
        (span, metric) for span in ("1-2048", ">2048") for metric in ("ttft_p50", "ttft_p95", "itl_p99", "e2e_p95")
    }
    assert all(c["winner"] is None for c in comparisons), json.dumps(comparisons, indent=1)
    assert {c["best"] for c in comparisons} | {c["runner_up"] for c in comparisons} == {"t2048", "t8192"}
    # Eight requests an arm and class: fewer than the 20 a median needs, let alone the 100 a p95 needs (and the
    # 500 gaps an ITL p99 needs); the traffic still needed grows with the quantile.
    needed = {"ttft_p50": 20, "ttft_p95": 100, "e2e_p95": 100}
    for c in comparisons:
        assert c["status"] == "not_enough_data", c
        assert c["difference"] is None
        assert c["more_hours"] == pytest.approx(HOURS * (c["traffic_factor"] - 1)) and c["more_hours"] > 0
        assert "not enough data" in c["note"] and "more hours" in c["note"]
        if c["metric"] in needed:
            assert c["traffic_factor"] == pytest.approx(needed[c["metric"]] / (SESSIONS_PER_ARM * TURNS))
    assert report["verdict"]["decision"] == "undecided", report["verdict"]["summary"]
    assert report["promotion"]["status"] == "not_enough_data", report["promotion"]["summary"]

    text = await advise_on(experiment)
    assert "Arms side by side" in text and "t2048" in text and "t8192" in text
    assert "not enough data" in text
    assert " wins, " not in text
