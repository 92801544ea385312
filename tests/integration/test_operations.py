"""Operations on loopback: metrics that add up, live configuration, admin endpoints."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, chat_body, cluster_settings, metric, running_router, settled
from tests.integration.slow_link import SlowLink

THRESHOLD = 64
LONG = "Every region reported steady growth while costs stayed flat across the whole year. " * 10
SHORT = "Hi there."
ADMIN = {"Authorization": "Bearer ops-secret"}


def chat(content: str, *, stream: bool = False, max_tokens: int = 6) -> dict[str, Any]:
    return chat_body(content, stream=stream, max_tokens=max_tokens)


def settings_for(cluster: SimCluster, tokenizer_dir: Path, **extra: Any) -> dict[str, Any]:
    return cluster_settings(
        cluster, tokenizer_dir, threshold=THRESHOLD, admin_key_hashes=[hash_key("ops-secret")], **extra
    )


async def scrape(base_url: str) -> dict[str, list[Any]]:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{base_url}/metrics")).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def total(samples: list[Any], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def run_mixed(base_url: str, count: int = 24) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:

        async def one(i: int) -> None:
            content = f"{i} {LONG}" if i % 2 else f"{i} {SHORT}"
            if i % 3:
                async with client.stream("POST", "/v1/chat/completions", json=chat(content, stream=True)) as r:
                    assert r.status_code == 200
                    await r.aread()
            else:
                assert (await client.post("/v1/chat/completions", json=chat(content))).status_code == 200

        await asyncio.gather(*(one(i) for i in range(count)))


async def test_metric_names_labels_and_the_ttft_breakdown_adds_up(cluster: SimCluster, tokenizer_dir: Path) -> None:
    async with running_router(**settings_for(cluster, tokenizer_dir)) as base_url:
        await run_mixed(base_url)
        await settled(base_url)
        families = await scrape(base_url)

    expected_labels = {
        "dpd_router_requests": {"model", "arm", "api", "path", "outcome"},
        "dpd_router_route_decisions": {"model", "arm", "path", "reason"},
        "dpd_router_time_to_first_token_seconds": {"model", "arm", "path", "prompt_tokens"},
        "dpd_router_inter_token_latency_seconds": {"model", "arm", "path", "prompt_tokens"},
        "dpd_router_e2e_latency_seconds": {"model", "arm", "path", "prompt_tokens"},
        "dpd_router_phase_seconds": {"model", "arm", "path", "phase"},
        "dpd_router_prompt_tokens": {"model", "arm", "path"},
        "dpd_router_output_tokens": {"model", "arm", "path"},
        "dpd_router_prefill_seconds": {"model", "outcome"},
        "dpd_router_routing_threshold_tokens": {"model"},
        "dpd_router_endpoint_in_flight_requests": {"endpoint", "role"},
        "dpd_router_endpoint_healthy": {"endpoint", "role"},
        "dpd_router_endpoint_circuit_open": {"endpoint", "role"},
    }
    for name, labels in expected_labels.items():
        assert name in families, name
        sample_labels = {key for sample in families[name] for key in sample.labels if key != "le"}
        assert sample_labels == labels, name
        arms = {sample.labels["arm"] for sample in families[name] if "arm" in sample.labels}
        assert arms <= {"live"}, (name, arms)  # no experiments configured: every request is arm "live"
        models = {sample.labels["model"] for sample in families[name] if "model" in sample.labels}
        assert models <= {MODEL}, (name, models)  # the served model, learnt from the decoders

    for path in ("direct", "disaggregated"):
        requests = total(
            families["dpd_router_time_to_first_token_seconds"],
            "dpd_router_time_to_first_token_seconds_count",
            path=path,
        )
        assert requests > 0, path
        ttft = total(
            families["dpd_router_time_to_first_token_seconds"], "dpd_router_time_to_first_token_seconds_sum", path=path
        )
        phases = families["dpd_router_phase_seconds"]
        parts = {
            phase: total(phases, "dpd_router_phase_seconds_sum", path=path, phase=phase)
            for phase in ("queue", "tokenize", "prefill", "first_token", "router")
        }
        counts = {
            phase: total(phases, "dpd_router_phase_seconds_count", path=path, phase=phase)
            for phase in ("queue", "tokenize", "first_token", "router")
        }
        assert set(counts.values()) == {requests}, "every request records every phase"
        assert abs(sum(parts.values()) - ttft) < 1e-6 * requests + 1e-9, (path, parts, ttft)
        assert parts["first_token"] > 0 and parts["tokenize"] > 0
        if path == "disaggregated":
            assert parts["prefill"] > 0
        outputs = total(families["dpd_router_output_tokens"], "dpd_router_output_tokens_count", path=path)
        served = total(families["dpd_router_requests"], "dpd_router_requests_total", path=path)
        assert served > requests, "whole answers are served but have no TTFT"
        assert outputs == served, "every request's output tokens are known, streamed or not"


async def test_what_startup_built_is_left_out_of_the_collectors_passes_until_shutdown(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    """The startup heap (tokenizer, templates, libraries) is frozen while the router serves: each collection a
    request's allocations set off would walk it again. Shutdown gives it back to the collector."""
    async with running_router(**settings_for(cluster, tokenizer_dir)) as base_url, httpx.AsyncClient() as client:
        assert gc.get_freeze_count() > 10_000
        answer = await client.post(f"{base_url}/v1/chat/completions", json=chat_body("frozen", max_tokens=4))
        assert answer.status_code == 200
    assert gc.get_freeze_count() == 0


async def test_admin_endpoints_need_an_admin_key_and_redact_secrets(cluster: SimCluster, tokenizer_dir: Path) -> None:
    settings = settings_for(cluster, tokenizer_dir, api_key_hashes=[hash_key("user-key")], engine_api_key="engine-pw")
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url) as client:
        assert (await client.get("/admin/config")).status_code == 401
        user = await client.get("/admin/config", headers={"Authorization": "Bearer user-key"})
        assert user.status_code == 403 and user.json()["error"]["type"] == "PermissionDeniedError"
        config = (await client.get("/admin/config", headers=ADMIN)).json()
        assert config["routing_threshold"] == THRESHOLD
        assert config["engine_api_key"] == "<redacted>"
        assert "engine-pw" not in str(config) and hash_key("user-key") not in str(config)
        refused = await client.put("/admin/config", json={"decode_urls": ["http://127.0.0.1:1"]}, headers=ADMIN)
        assert refused.status_code == 400 and "restart" in refused.json()["error"]["message"]
        invalid = await client.put("/admin/config", json={"routing_threshold": -5}, headers=ADMIN)
        assert invalid.status_code == 400 and "routing_threshold" in invalid.json()["error"]["message"]


async def test_the_threshold_changes_under_load_without_a_failed_request(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    async with running_router(**settings_for(cluster, tokenizer_dir)) as base_url:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:

            async def flip() -> None:
                for threshold in (100_000, THRESHOLD, 100_000, THRESHOLD, 100_000):
                    answer = await client.put("/admin/config", json={"routing_threshold": threshold}, headers=ADMIN)
                    assert answer.status_code == 200
                    await asyncio.sleep(0.05)

            await asyncio.gather(run_mixed(base_url, count=120), flip())
            await settled(base_url)
            families = await scrape(base_url)
            outcomes: dict[str, float] = {}
            for sample in families["dpd_router_requests"]:
                if sample.name.endswith("_total"):
                    outcomes[sample.labels["outcome"]] = outcomes.get(sample.labels["outcome"], 0) + sample.value
            assert outcomes.get("ok") == 120, outcomes
            assert await metric(base_url, "dpd_router_routing_threshold_tokens") == 100_000

            request_id = f"after-{uuid.uuid4().hex[:8]}"
            answer = await client.post("/v1/chat/completions", json=chat(LONG), headers={"X-Request-Id": request_id})
            assert answer.status_code == 200
            before = await metric(base_url, "dpd_router_route_decisions_total", {"path": "disaggregated"})
            await client.post("/v1/chat/completions", json=chat(LONG + " again"))
            assert await metric(base_url, "dpd_router_route_decisions_total", {"path": "disaggregated"}) == before
        assert await metric(base_url, "dpd_router_config_reloads_total", {"source": "admin", "outcome": "applied"}) == 5


async def test_the_config_file_is_watched_and_sighup_rereads_it(
    cluster: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(f"routing_threshold: {THRESHOLD}\nthreshold_mode: static\n")
    settings = settings_for(cluster, tokenizer_dir, config=str(config), config_watch_interval=0.05)
    settings.pop("routing_threshold")
    settings.pop("threshold_mode")
    async with running_router(**settings) as base_url:

        async def threshold_is(value: int) -> None:
            async with asyncio.timeout(10):
                while await metric(base_url, "dpd_router_routing_threshold_tokens") != value:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)

        await threshold_is(THRESHOLD)
        config.write_text("routing_threshold: 2048\nthreshold_mode: static\nhealth_timeout: 3\n")  # needs a restart
        os.utime(config, (1, 1))
        await threshold_is(2048)
        assert await metric(base_url, "dpd_router_config_reloads_total", {"source": "file", "outcome": "applied"}) == 1

        if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
            pytest.skip("the router could not install its SIGHUP handler here")
        config.write_text("routing_threshold: 4000\nthreshold_mode: static\n")
        os.utime(config, (1, 1))  # same mtime as before: only SIGHUP can notice the change
        os.kill(os.getpid(), signal.SIGHUP)
        await threshold_is(4000)
        assert (
            await metric(base_url, "dpd_router_config_reloads_total", {"source": "sighup", "outcome": "applied"}) == 1
        )


async def test_a_decoder_that_recomputes_the_prompt_is_flagged_as_an_ineffective_transfer(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as small,
        running_router(**settings_for(small, tokenizer_dir)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        healthy = await client.post("/v1/chat/completions", json=chat(LONG, stream=True))
        assert healthy.status_code == 200
        await client.post(f"{small.decode_urls[0]}/sim/fault", json={"mode": "ignore_kv", "count": 1})
        with caplog.at_level("WARNING", logger="dpd_router.request"):
            fresh = "A different document entirely, about rivers and mountains and evening music. " * 10
            answer = await client.post("/v1/chat/completions", json=chat(fresh, stream=True))
        assert answer.status_code == 200 and b'"usage"' not in answer.content, "the client did not ask for usage"
        await settled(base_url)
        assert await metric(base_url, "dpd_router_kv_transfer_ineffective_total") == 1
        assert any("KV transfer ineffective" in record.getMessage() for record in caplog.records)


async def test_a_prefill_timeout_raised_while_serving_is_the_prefill_calls_whole_limit(tokenizer_dir: Path) -> None:
    """Started with a prefill timeout of 1 s, the router is given 20 s while it serves; a prefill whose answer the
    link holds 1.5 s is then waited for and the request goes through both hops. The prefill call has no limit of
    its own from startup under the hop's (which capped a raised timeout at the value the router started with)."""
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        SlowLink(cluster.prefill_urls[0], hold=1.5) as link,
        running_router(**settings_for(cluster, tokenizer_dir, prefill_urls=[link.url], prefill_timeout=1.0)) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        held = await client.post("/v1/chat/completions", json=chat_body(f"held {LONG}", max_tokens=4))
        assert held.status_code == 200  # the prefill past its 1 s: served by the decoder alone
        assert await metric(url, "dpd_router_prefill_fallbacks_total") == 1
        raised = await client.put("/admin/config", json={"prefill_timeout": 20.0}, headers=ADMIN)
        assert raised.status_code == 200
        waited = await client.post("/v1/chat/completions", json=chat_body(f"waited {LONG}", max_tokens=4))
        assert waited.status_code == 200
        await settled(url)
        assert await metric(url, "dpd_router_prefill_fallbacks_total") == 1, "the raised timeout waited for it"
        assert await metric(url, "dpd_router_prefill_seconds_count", {"outcome": "timeout"}) == 1
        assert await metric(url, "dpd_router_prefill_seconds_count", {"outcome": "ok"}) == 1
