"""Experiment arms on loopback: sticky per session, labelled in metrics and log lines, routed with the
arm's own settings, and changed live (admin PUT, config file) without a restart."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_router.api.auth import hash_key
from dpd_router.routing.experiments import arm_position
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import chat_body, cluster_settings, metric, running_router, settled

ADMIN = {"Authorization": "Bearer ops-secret"}
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
ARM_8192 = {"name": "t8192", "share": 0.5, "routing_threshold": 8192}


def long_prompt(seed: str) -> str:
    """About 3,000 tokens: over the live threshold (2048), under the arm's (8192)."""
    return f"Report {seed}: " + " ".join(WORDS[(len(seed) + i * 3) % len(WORDS)] for i in range(770))


def sessions(inside: bool, count: int) -> list[str]:
    """Session keys whose hash falls in the first half of [0, 1) (arm t8192 at share 0.5), or not."""
    keys = (f"session-{i}" for i in range(10_000))
    return [key for key in keys if (arm_position(key) < 0.5) == inside][:count]


def settings_for(cluster: SimCluster, tokenizer_dir: Path, **extra: Any) -> dict[str, Any]:
    return cluster_settings(cluster, tokenizer_dir, threshold=2048, admin_key_hashes=[hash_key("ops-secret")], **extra)


async def ask(client: httpx.AsyncClient, session: str | None, *, stream: bool = True, **body: Any) -> str:
    """Send a ~3k-token chat request in `session`; return its request id."""
    request_id = f"arms-{uuid.uuid4().hex[:10]}"
    headers = {"X-Request-Id": request_id} | ({"x-session-id": session} if session else {})
    payload = chat_body(long_prompt(request_id), max_tokens=4, stream=stream) | body
    async with client.stream("POST", "/v1/chat/completions", json=payload, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        await response.aread()
    return request_id


def logged(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    """The request log lines' fields, by request id."""
    return {
        record.fields["request_id"]: record.fields
        for record in caplog.records
        if record.name == "dpd_router.request" and hasattr(record, "fields")
    }


async def test_sessions_stick_to_their_arm_which_routes_with_its_own_threshold_and_labels_everything(
    cluster: SimCluster, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dpd_router.request")
    in_arm, in_live = sessions(True, 3), sessions(False, 3)
    settings = settings_for(cluster, tokenizer_dir, experiments={"arms": [ARM_8192]})
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        asked: dict[str, str] = {}
        for turn in range(2):
            for session in in_arm + in_live:
                asked[await ask(client, session, stream=turn == 0)] = session
        # No session header: the body's `user` field is the session key.
        by_user = await ask(client, None, user=in_arm[0])
        await settled(base_url)

        lines = logged(caplog)
        for request_id, session in asked.items():
            line = lines[request_id]
            assert 2048 < line["prompt_tokens"] < 8192
            if session in in_arm:
                assert (line["arm"], line["path"], line["threshold"]) == ("t8192", "direct", 8192), line
                assert line["prefiller"] is None
            else:
                assert (line["arm"], line["path"], line["threshold"]) == ("live", "disaggregated", 2048), line
        assert (lines[by_user]["arm"], lines[by_user]["path"]) == ("t8192", "direct")

        assert await metric(base_url, "dpd_router_requests_total", {"arm": "t8192", "outcome": "ok"}) == 7
        assert await metric(base_url, "dpd_router_requests_total", {"arm": "live", "outcome": "ok"}) == 6
        decisions = "dpd_router_route_decisions_total"
        assert await metric(base_url, decisions, {"arm": "t8192", "path": "direct", "reason": "below_threshold"}) == 7
        assert await metric(base_url, decisions, {"arm": "live", "path": "disaggregated"}) == 6
        assert await metric(base_url, decisions, {"arm": "t8192", "path": "disaggregated"}) == 0
        # Streamed requests' TTFT (the first turn's, and the one keyed by `user`) is labelled by arm too.
        ttft = "dpd_router_time_to_first_token_seconds_count"
        assert await metric(base_url, ttft, {"arm": "t8192", "path": "direct"}) == 4
        assert await metric(base_url, ttft, {"arm": "live", "path": "disaggregated"}) == 3

        routing = (await client.get("/admin/routing", headers=ADMIN)).json()
        assert [(arm["name"], arm["share"], arm["routing_threshold"]) for arm in routing["arms"]] == [
            ("t8192", 0.5, 8192)
        ]
        config = (await client.get("/admin/config", headers=ADMIN)).json()
        assert config["experiments"]["arms"][0]["name"] == "t8192"


async def test_an_arms_share_changes_live_by_admin_put_and_by_the_config_file(
    cluster: SimCluster, tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dpd_router.request")
    session = sessions(False, 1)[0]  # in the arm at share 1, out of it at share 0.5
    config = tmp_path / "router.yaml"
    config.write_text("routing_threshold: 2048\nthreshold_mode: static\n")
    settings = settings_for(cluster, tokenizer_dir, config=str(config), config_watch_interval=0.05)
    settings.pop("routing_threshold")
    settings.pop("threshold_mode")
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=60) as client:

        async def arm_of_next_request() -> tuple[str, str]:
            request_id = await ask(client, session)
            await settled(base_url)
            line = logged(caplog)[request_id]
            return line["arm"], line["path"]

        async def arms_in_force() -> list[tuple[str, float]]:
            routing = (await client.get("/admin/routing", headers=ADMIN)).json()
            return [(arm["name"], arm["share"]) for arm in routing["arms"]]

        assert await arm_of_next_request() == ("live", "disaggregated")

        everyone = {"experiments": {"arms": [ARM_8192 | {"share": 1.0}]}}
        answer = await client.put("/admin/config", json=everyone, headers=ADMIN)
        assert answer.status_code == 200, answer.text
        assert answer.json()["changed"]["experiments"]["to"]["arms"][0]["share"] == 1.0
        assert await arm_of_next_request() == ("t8192", "direct")

        refused = await client.put(
            "/admin/config",
            json={"experiments": {"arms": [ARM_8192, ARM_8192 | {"name": "live"}]}},
            headers=ADMIN,
        )
        assert refused.status_code == 400 and "experiments" in refused.json()["error"]["message"]
        assert await arms_in_force() == [("t8192", 1.0)]

        # The file now halves the arm: the session's key falls past it, in arm live again.
        config.write_text(
            "routing_threshold: 2048\nthreshold_mode: static\n"
            "experiments:\n  arms:\n    - {name: t8192, share: 0.5, routing_threshold: 8192}\n"
        )
        os.utime(config, (1, 1))
        async with asyncio.timeout(10):
            while await arms_in_force() != [("t8192", 0.5)]:  # noqa: ASYNC110 - polling the router over HTTP
                await asyncio.sleep(0.05)
        assert await arm_of_next_request() == ("live", "disaggregated")
        assert await metric(base_url, "dpd_router_config_reloads_total", {"source": "file", "outcome": "applied"}) == 1
        assert await metric(base_url, "dpd_router_requests_total", {"outcome": "ok"}) == 3
