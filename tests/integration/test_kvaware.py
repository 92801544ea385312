"""`kvaware` routing on loopback: the engines publish vLLM KV events over ZMQ, the router indexes them.

Prompts are warmed by sending them straight to an engine, never through the router, so the router
can only learn where their KV is from the engines' events. prefill-1 and decode-1 publish the
positional event encoding (vLLM 0.23 and earlier), the others the current map encoding; prefill-0 has a
small prefix cache so that it evicts.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from dpd_sim.cluster import SimCluster
from dpd_sim.lmcache_controller import Controller
from dpd_sim.lmcache_controller import create_app as create_controller_app
from tests.integration.conftest import (
    MODEL,
    cluster_settings,
    metric,
    openai_client,
    requests_seen,
    running_router,
    serving,
)

THRESHOLD = 64
BLOCK = 16
SMALL_CACHE_BLOCKS = 128
KV_EVENTS = "dpd_router_kv_events_total"
WORDS = ("kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra")
QUESTIONS = ("What is the first word?", "Which word comes up most?", "Summarise it.", "Is it long?")


def document(seed: int, words: int = 160) -> str:
    """A long text (about 500 tokens) sharing no prefix with other seeds' documents."""
    return f"Record {seed}: " + " ".join(WORDS[(seed * 5 + i * 4) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
async def kv_cluster(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    array = ["--kv-events-format", "array"]
    engine_args = {
        "prefill-0": ["--prefix-cache-blocks", str(SMALL_CACHE_BLOCKS)],
        "prefill-1": array,
        "decode-1": array,
    }
    async with SimCluster(
        in_process=True,
        prefill=2,
        decode=2,
        tokenizer=tokenizer_dir,
        model=MODEL,
        kv_events=True,
        engine_args=engine_args,
    ) as engines:
        yield engines


def kvaware_settings(cluster: SimCluster, tokenizer_dir: Path, threshold_mode: str) -> dict[str, Any]:
    return cluster_settings(
        cluster,
        tokenizer_dir,
        threshold=THRESHOLD,
        prefill_strategy="kvaware",
        threshold_mode=threshold_mode,
        kv_events_endpoints=cluster.kv_events_endpoints,
    )


async def kv_events(base_url: str, url: str, kind: str) -> float:
    return await metric(base_url, KV_EVENTS, {"endpoint": url, "kind": kind})


async def reported(base_url: str, url: str, kind: str, at_least: float) -> None:
    """Wait (at most 5 s) until the router has counted `at_least` blocks of this kind from the engine."""
    deadline = time.monotonic() + 5
    while (seen := await kv_events(base_url, url, kind)) < at_least:
        assert time.monotonic() < deadline, f"the router counted {seen} {kind} blocks from {url}, not {at_least}"
        await asyncio.sleep(0.02)


async def subscribed(base_url: str, cluster: SimCluster) -> None:
    """The router's SUB sockets join after it starts and miss what comes before: reset each engine's
    prefix cache (AllBlocksCleared) until the router has heard from every engine."""

    async def join(url: str) -> None:
        deadline = time.monotonic() + 10
        async with httpx.AsyncClient() as http:
            while await kv_events(base_url, url, "cleared") < 1:
                assert time.monotonic() < deadline, f"the router never heard {url}'s KV events"
                (await http.post(f"{url}/sim/reset_prefix_cache")).raise_for_status()
                for _ in range(10):
                    if await kv_events(base_url, url, "cleared") >= 1:
                        return
                    await asyncio.sleep(0.03)

    await asyncio.gather(*(join(engine.url) for engine in cluster.engines))


async def warm(url: str, text: str, *, remote_decode: bool = False) -> int:
    """Compute the prompt's KV on one engine directly; returns its full blocks (all new to a fresh prompt)."""
    body: dict[str, Any] = {"model": MODEL, "prompt": text, "max_tokens": 1}
    if remote_decode:
        body["kv_transfer_params"] = {"do_remote_decode": True}
    async with httpx.AsyncClient(timeout=10) as http:
        answer = await http.post(f"{url}/v1/completions", json=body)
    answer.raise_for_status()
    return int(answer.json()["usage"]["prompt_tokens"]) // BLOCK


async def warmed(base_url: str, url: str, text: str, *, remote_decode: bool = False) -> None:
    """Warm the prompt on the engine and wait until the router has indexed its blocks."""
    before = await kv_events(base_url, url, "stored")
    blocks = await warm(url, text, remote_decode=remote_decode)
    await reported(base_url, url, "stored", before + blocks)


async def route(base_url: str, text: str) -> str:
    request_id = f"kv-{uuid.uuid4().hex[:12]}"
    answer = await openai_client(base_url).completions.create(
        model=MODEL, prompt=text, max_tokens=4, extra_headers={"X-Request-Id": request_id}
    )
    assert answer.choices[0].finish_reason == "length"
    return request_id


async def served_by(urls: list[str], request_id: str) -> list[str]:
    return [url for url in urls if await requests_seen(url, request_id)]


async def test_a_prompt_goes_to_the_prefiller_whose_engine_reports_its_prefix(
    kv_cluster: SimCluster, tokenizer_dir: Path
) -> None:
    async with running_router(**kvaware_settings(kv_cluster, tokenizer_dir, "static")) as base_url:
        await subscribed(base_url, kv_cluster)
        # Each prefiller in turn, each format: where the engines' events say, not a lucky default.
        for seed, prefiller in enumerate([*kv_cluster.prefill_urls, *reversed(kv_cluster.prefill_urls)]):
            context = document(seed)
            await warmed(base_url, prefiller, context, remote_decode=True)
            decoders_stored = {url: await kv_events(base_url, url, "stored") for url in kv_cluster.decode_urls}
            request_id = await route(base_url, f"{context} {QUESTIONS[seed]}")
            assert await served_by(kv_cluster.prefill_urls, request_id) == [prefiller], f"round {seed}"
            (decoder,) = await served_by(kv_cluster.decode_urls, request_id)
            (decoded,) = await requests_seen(decoder, request_id)
            assert decoded["kind"] == "kv_decode"
            # The decoder now holds the prompt's KV too, and says so.
            await reported(base_url, decoder, "stored", decoders_stored[decoder] + decoded["prompt_tokens"] // BLOCK)
        for engine in kv_cluster.engines:
            assert await kv_events(base_url, engine.url, "undecodable") == 0
            assert await kv_events(base_url, engine.url, "skipped") == 0


async def test_a_prefix_the_decoders_engine_reports_sends_a_long_prompt_straight_to_it(
    kv_cluster: SimCluster, tokenizer_dir: Path
) -> None:
    async with running_router(**kvaware_settings(kv_cluster, tokenizer_dir, "cache_aware")) as base_url:
        await subscribed(base_url, kv_cluster)
        for seed, decoder in enumerate(reversed(kv_cluster.decode_urls), start=10):
            context = document(seed)
            await warmed(base_url, decoder, context)
            request_id = await route(base_url, f"{context} {QUESTIONS[seed % len(QUESTIONS)]}")
            assert await served_by(kv_cluster.prefill_urls, request_id) == []
            assert await served_by(kv_cluster.decode_urls, request_id) == [decoder]
            (served,) = await requests_seen(decoder, request_id)
            assert served["kind"] == "local" and served["cached_tokens"] > THRESHOLD
        decisions = {"path": "direct", "reason": "cached_on_decoder"}
        assert await metric(base_url, "dpd_router_route_decisions_total", decisions) == 2


async def test_a_prefiller_that_clears_or_evicts_a_prefix_is_no_longer_preferred(
    kv_cluster: SimCluster, tokenizer_dir: Path
) -> None:
    small, other = kv_cluster.engine("prefill-0").url, kv_cluster.engine("prefill-1").url
    async with running_router(**kvaware_settings(kv_cluster, tokenizer_dir, "static")) as base_url:
        await subscribed(base_url, kv_cluster)
        context = document(20)
        longer = f"{context} {document(21, words=40)}"
        # `small` holds the longer prefix, `other` only its start: the longest match is `small`.
        await warmed(base_url, other, context, remote_decode=True)
        await warmed(base_url, small, longer, remote_decode=True)
        assert await served_by(kv_cluster.prefill_urls, await route(base_url, f"{longer} {QUESTIONS[0]}")) == [small]

        # AllBlocksCleared: `small` holds nothing now.
        cleared = await kv_events(base_url, small, "cleared")
        async with httpx.AsyncClient() as http:
            (await http.post(f"{small}/sim/reset_prefix_cache")).raise_for_status()
        await reported(base_url, small, "cleared", cleared + 1)
        assert await served_by(kv_cluster.prefill_urls, await route(base_url, f"{longer} {QUESTIONS[1]}")) == [other]

        # BlockRemoved: a new prefix (routing put the last one on `other` too) is pushed out of the small cache.
        context, longer = document(22), f"{document(22)} {document(23, words=40)}"
        await warmed(base_url, other, context, remote_decode=True)
        await warmed(base_url, small, longer, remote_decode=True)
        assert await served_by(kv_cluster.prefill_urls, await route(base_url, f"{longer} {QUESTIONS[2]}")) == [small]
        removed = await kv_events(base_url, small, "removed")
        stored = await kv_events(base_url, small, "stored")
        pushed = 0
        for seed in range(30, 35):  # more blocks than the small cache holds
            pushed += await warm(small, document(seed), remote_decode=True)
        assert pushed > SMALL_CACHE_BLOCKS
        await reported(base_url, small, "stored", stored + pushed)
        assert await kv_events(base_url, small, "removed") >= removed + pushed - SMALL_CACHE_BLOCKS
        assert await served_by(kv_cluster.prefill_urls, await route(base_url, f"{longer} {QUESTIONS[3]}")) == [other]


@asynccontextmanager
async def running_controller(cluster: SimCluster) -> AsyncIterator[str]:
    """The LMCache controller stand-in, subscribed to every engine's KV events, on a free port."""
    publishers = {engine.name: address for engine in cluster.engines if (address := engine.kv_events_address)}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: asyncio turns Nagle off
    sock.bind(("127.0.0.1", 0))
    app = create_controller_app(Controller(publishers))
    server = uvicorn.Server(uvicorn.Config(app, loop="none", log_level="warning", lifespan="on"))
    async with serving(server, sock, within=10):
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


async def controller_heard(http: httpx.AsyncClient, controller_url: str, cluster: SimCluster) -> None:
    """Reset every engine's prefix cache until the controller has a batch from each (its SUBs join late)."""
    deadline = time.monotonic() + 10
    while True:
        heard = (await http.get(f"{controller_url}/sim/instances")).json()
        silent = [engine for engine in cluster.engines if heard[engine.name]["batches"] == 0]
        if not silent:
            return
        assert time.monotonic() < deadline, f"the controller never heard {[engine.name for engine in silent]}"
        for engine in silent:
            (await http.post(f"{engine.url}/sim/reset_prefix_cache")).raise_for_status()
        await asyncio.sleep(0.05)


async def placed(http: httpx.AsyncClient, controller_url: str, tokens: list[int], instance: str) -> None:
    """Wait (at most 5 s) until the controller's lookup places the tokens on the instance."""
    deadline = time.monotonic() + 5
    while True:
        layout = (await http.post(f"{controller_url}/lookup", json={"tokens": tokens})).json()["layout_info"]
        if instance in layout:
            return
        assert time.monotonic() < deadline, f"the controller never placed the prompt on {instance}"
        await asyncio.sleep(0.02)


async def test_kvaware_follows_an_lmcache_controller_fed_by_the_engines_events(
    kv_cluster: SimCluster, tokenizer_dir: Path
) -> None:
    settings = {
        **kvaware_settings(kv_cluster, tokenizer_dir, "static"),
        "kv_events_endpoints": {},
        "lmcache_instance_ids": {engine.url: engine.name for engine in kv_cluster.engines},
        "kv_lookup_timeout": 2.0,
    }
    async with (
        running_controller(kv_cluster) as controller_url,
        httpx.AsyncClient(timeout=5) as http,
        running_router(**settings, lmcache_controller_url=controller_url) as base_url,
    ):
        await controller_heard(http, controller_url, kv_cluster)
        # prefill-1 first: a fallback that prefers the first prefiller cannot pass by luck.
        for seed, engine in enumerate([kv_cluster.engine("prefill-1"), kv_cluster.engine("prefill-0")], start=40):
            context = document(seed)
            await warm(engine.url, context, remote_decode=True)
            tokens = (await http.post(f"{engine.url}/tokenize", json={"prompt": context})).json()["tokens"]
            await placed(http, controller_url, tokens, engine.name)
            request_id = await route(base_url, f"{context} {QUESTIONS[seed % len(QUESTIONS)]}")
            assert await served_by(kv_cluster.prefill_urls, request_id) == [engine.url]
        assert await metric(base_url, "dpd_router_kv_lookups_total", {"outcome": "hit"}) >= 2
