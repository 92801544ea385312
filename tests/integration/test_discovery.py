"""Kubernetes discovery end to end: a stand-in API server names simulated engines as pods, the router
watches it, and traffic follows the pods in, out, and through watch restarts without failing a request."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, chat_body, metric, requests_seen, running_router
from tests.unit.discovery.kube_api import FakeKubernetes

THRESHOLD = 64
LONG = "Every region reported steady growth while costs stayed flat across the whole year. " * 10
SHORT = "Hi there."
TOKEN = "stand-in-token"


@pytest.fixture(scope="module")
async def engines(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    """One prefiller and two decoders, decoding slowly enough to drain one mid-stream."""
    slow = ["--decode-step-base", "0.01"]
    async with SimCluster(
        in_process=True, prefill=1, decode=2, tokenizer=tokenizer_dir, model=MODEL, extra_args=slow
    ) as cluster:
        yield cluster


@asynccontextmanager
async def discovered_router(
    kube: FakeKubernetes, tokenizer_dir: Path, tmp_path: Path, **settings: Any
) -> AsyncIterator[str]:
    """The stand-in API server, and a router discovering both pools through it (`settings` on top of the
    defaults here); yields the router's URL."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    async with (
        kube.serve() as api_url,
        running_router(
            discovery="kubernetes",
            kubernetes_api_url=api_url,
            kubernetes_namespace="engines",
            kubernetes_token_file=str(token),
            tokenizer=str(tokenizer_dir),
            routing_threshold=THRESHOLD,
            threshold_mode="static",
            drain_timeout=30,
            **settings,
        ) as base_url,
    ):
        yield base_url


def port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


async def served_by(client: httpx.AsyncClient, cluster: SimCluster, content: str) -> list[str]:
    """Send one request; the engines that saw it, prefillers first."""
    request_id = f"disc-{uuid.uuid4().hex[:8]}"
    answer = await client.post("/v1/chat/completions", json=chat_body(content), headers={"X-Request-Id": request_id})
    assert answer.status_code == 200, answer.text
    return [url for url in [*cluster.prefill_urls, *cluster.decode_urls] if await requests_seen(url, request_id)]


async def discovery_events(base_url: str, role: str, event: str) -> float:
    return await metric(base_url, "dpd_router_discovery_events_total", {"role": role, "event": event})


async def exported(base_url: str, endpoint: str) -> bool:
    """Whether /metrics still has the endpoint's in-flight series."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{base_url}/metrics")).text
    return any(
        sample.labels.get("endpoint") == endpoint
        for family in text_string_to_metric_families(text)
        if family.name == "dpd_router_endpoint_in_flight_requests"
        for sample in family.samples
    )


async def eventually(check: Callable[[], Awaitable[bool]], *, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not await check():  # noqa: ASYNC110 - the state lives in the router: polling its /metrics
            await asyncio.sleep(0.05)


async def test_traffic_follows_pods_that_become_ready_and_stop_being_ready(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    (prefiller,), (decoder_0, decoder_1) = engines.prefill_urls, engines.decode_urls
    kube = FakeKubernetes(token=TOKEN)
    kube.put_pod("prefill-0", role="prefill", port=port(prefiller))
    kube.put_pod("decode-0", role="decode", port=port(decoder_0))
    kube.put_pod("decode-1", role="decode", port=port(decoder_1), ready=False)
    async with (
        discovered_router(kube, tokenizer_dir, tmp_path) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        assert await served_by(client, engines, LONG) == [prefiller, decoder_0]

        kube.set_ready("decode-1", True)
        kube.set_ready("decode-0", False)
        await eventually(lambda: _removed(base_url, "decode", 1))
        assert not await exported(base_url, decoder_0)
        assert await exported(base_url, decoder_1)
        for content in (LONG, SHORT, LONG + " Again?"):
            assert (await served_by(client, engines, content))[-1] == decoder_1

        kube.set_ready("decode-0", True)
        await eventually(lambda: _events_at_least(base_url, "decode", "added", 3))
        assert await exported(base_url, decoder_0), "back, with a probe and metrics"


async def _removed(base_url: str, role: str, count: int) -> bool:
    return await discovery_events(base_url, role, "removed") >= count


async def _events_at_least(base_url: str, role: str, event: str, count: int) -> bool:
    return await discovery_events(base_url, role, event) >= count


async def test_a_decoder_deleted_mid_stream_finishes_the_stream_then_leaves(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    (prefiller,), (decoder_0, decoder_1) = engines.prefill_urls, engines.decode_urls
    kube = FakeKubernetes(token=TOKEN)
    kube.put_pod("prefill-0", role="prefill", port=port(prefiller))
    kube.put_pod("decode-0", role="decode", port=port(decoder_0))
    async with (
        discovered_router(kube, tokenizer_dir, tmp_path) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=chat_body(LONG, max_tokens=200, stream=True)) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        received: list[str] = []
        async for line in lines:
            if line:
                received.append(line)
                break
        kube.put_pod("decode-1", role="decode", port=port(decoder_1))
        kube.terminate("decode-0")  # the rolling update deletes the pod the stream is on
        await eventually(lambda: _events_at_least(base_url, "decode", "draining", 1))
        kube.delete("decode-0")

        assert (await served_by(client, engines, SHORT))[-1] == decoder_1, "new requests avoid the draining one"
        assert await exported(base_url, decoder_0), "still in the pool while its stream runs"
        assert await discovery_events(base_url, "decode", "removed") == 0

        received += [line async for line in lines if line]
        assert received[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in received), "the in-flight stream was not failed"
        assert sum('"content"' in line for line in received) >= 150, "it streamed to the end"
        await eventually(lambda: _removed(base_url, "decode", 1))
        assert not await exported(base_url, decoder_0)
        assert await metric(base_url, "dpd_router_requests_total", {"outcome": "error"}) == 0


async def test_the_router_follows_pods_across_watch_restarts_and_410_relists(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    (prefiller,), (decoder_0, decoder_1) = engines.prefill_urls, engines.decode_urls
    kube = FakeKubernetes(token=TOKEN)
    kube.put_pod("prefill-0", role="prefill", port=port(prefiller))
    kube.put_pod("decode-0", role="decode", port=port(decoder_0))
    async with (
        discovered_router(kube, tokenizer_dir, tmp_path) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        await eventually(lambda: _watching(kube, 2))
        kube.close_watches()  # the API server ends the watches (timeoutSeconds, restart, load balancer)
        await eventually(lambda: _watching(kube, 4))
        kube.put_pod("decode-1", role="decode", port=port(decoder_1))
        await eventually(lambda: _events_at_least(base_url, "decode", "added", 2))

        kube.delete("decode-1", unseen=True)  # a deletion the watch never hears of ...
        kube.expire()  # ... because the history is gone: 410, and the router lists again
        await eventually(lambda: _removed(base_url, "decode", 1))
        assert await discovery_events(base_url, "decode", "watch_gone") == 1
        assert (await served_by(client, engines, LONG)) == [prefiller, decoder_0]


async def _watching(kube: FakeKubernetes, count: int) -> bool:
    return len(kube.watches()) >= count


async def test_each_model_discovers_its_own_pods_and_an_engine_serves_one_model(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Two models found by their pods' labels: each model's requests reach its own pods only, and a pod the
    second model's selector also matches stays the first model's (a conflict counted, not shared)."""
    alpha_name, beta_name = "alpha-7b", "beta-70b"
    kube = FakeKubernetes(token=TOKEN)
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=alpha_name) as alpha,
        SimCluster(in_process=True, prefill=0, decode=1, tokenizer=tokenizer_dir, model=beta_name) as beta,
    ):
        kube.put_pod("alpha-prefill-0", role="prefill", port=port(alpha.prefill_urls[0]), labels={"model": "alpha"})
        # Labelled for beta's selector too: it stays alpha's, which found it first.
        kube.put_pod(
            "alpha-decode-0", role="decode", port=port(alpha.decode_urls[0]), labels={"model": "alpha", "tier": "big"}
        )
        kube.put_pod("beta-decode-0", role="decode", port=port(beta.decode_urls[0]), labels={"tier": "big"})
        async with (
            discovered_router(
                kube,
                tokenizer_dir,
                tmp_path,
                models={
                    alpha_name: {"kubernetes_selector": "model=alpha"},
                    beta_name: {"kubernetes_selector": "tier=big"},
                },
            ) as base_url,
            httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        ):
            for model, cluster in ((alpha_name, alpha), (beta_name, beta)):
                for content in (LONG, SHORT):
                    request_id = f"disc-{uuid.uuid4().hex[:8]}"
                    answer = await client.post(
                        "/v1/chat/completions",
                        json={**chat_body(content), "model": model},
                        headers={"X-Request-Id": request_id},
                    )
                    assert answer.status_code == 200, answer.text
                    every = [*alpha.prefill_urls, *alpha.decode_urls, *beta.decode_urls]
                    seen = [url for url in every if await requests_seen(url, request_id)]
                    expected = [*cluster.prefill_urls, *cluster.decode_urls] if content == LONG else cluster.decode_urls
                    assert seen == expected, (model, content)
            assert await discovery_events(base_url, "decode", "conflict") >= 1
            state = (await client.get("/admin/state")).json()
            pools = {pool["name"]: sorted(e["url"] for e in pool["endpoints"]) for pool in state["pools"]}
            assert pools == {
                alpha_name: sorted([*alpha.prefill_urls, *alpha.decode_urls]),
                beta_name: beta.decode_urls,
            }
