"""No prefilled KV waits out its lease on the prefiller: the simulated engines hold NIXL blocks as vLLM does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, chat_body, cluster_settings, engine_stats, metric, running_router
from tests.integration.slow_link import SlowLink

THRESHOLD = 64
LONG = "Every region reported steady growth while costs stayed flat across the whole year. " * 10


async def wait_until_no_lease(prefiller: str, *, within: float = 5.0) -> None:
    """Within a few seconds, far inside the 30 s lease: the blocks were freed, not left to expire."""
    async with asyncio.timeout(within):
        while (await engine_stats(prefiller))["leases_active"]:  # noqa: ASYNC110 - another process's state
            await asyncio.sleep(0.05)


async def leave_and_find_released(request: asyncio.Task[Any], prefiller: str, router: str, *, orphaned: int) -> None:
    """The client leaves while the prefiller holds its request's blocks: within seconds the router has had them
    released, counted once (as an orphaned prefill `orphaned` times), and the client's leaving counted."""
    assert (await engine_stats(prefiller))["leases_active"] == 1
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request

    await wait_until_no_lease(prefiller)
    assert (await engine_stats(prefiller))["leases_released"] == 1
    assert await metric(router, "dpd_router_kv_released_total", {"connector": "nixl"}) == 1
    assert await metric(router, "dpd_router_orphaned_prefills_total", {"outcome": "released"}) == orphaned
    assert await metric(router, "dpd_router_client_disconnects_total") == 1


async def test_n_above_one_is_served_by_a_decoder_alone_and_leaves_no_lease(tokenizer_dir: Path) -> None:
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        prefiller = cluster.prefill_urls[0]
        for stream in (False, True):
            response = await client.post("/v1/chat/completions", json={**chat_body(LONG, stream=stream), "n": 3})
            assert response.status_code == 200, response.text
            assert b'"index":2' in response.content.replace(b" ", b"")
            assert b"error" not in response.content
        assert (
            await metric(
                base_url, "dpd_router_route_decisions_total", {"path": "direct", "reason": "connector_unsupported"}
            )
            == 2
        )
        stats = await engine_stats(prefiller)
        assert stats["leases_active"] == 0 and stats["recent"] == []

        # n = 1 still takes the prefill hop, and its lease ends when the decoder reads it.
        response = await client.post("/v1/chat/completions", json=chat_body(LONG))
        assert response.status_code == 200
        assert await metric(base_url, "dpd_router_route_decisions_total", {"path": "disaggregated"}) == 1
        await wait_until_no_lease(prefiller)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_as_the_prefill_answers_has_its_blocks_released(
    tokenizer_dir: Path, stream: bool
) -> None:
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        SlowLink(cluster.prefill_urls[0], hold=2.0) as link,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, prefill_urls=[link.url])) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        prefiller, decoder = cluster.prefill_urls[0], cluster.decode_urls[0]
        request = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(LONG, stream=stream)))
        await asyncio.wait_for(link.answering.wait(), 10)
        # The prefiller has finished the call and holds its blocks; the router has not read the answer yet.
        await leave_and_find_released(request, prefiller, url, orphaned=1)
        assert await metric(url, "dpd_router_orphaned_prefills_total", {"outcome": "cut"}) == 0
        # The decoder only refused the release call: it decoded nothing.
        assert [entry["kind"] for entry in (await engine_stats(decoder))["recent"]] == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_before_the_decoder_answered_has_its_blocks_released(
    tokenizer_dir: Path, stream: bool
) -> None:
    """The decode call reached a decoder that has not read the blocks yet (here: one that never will);
    the client leaves. vLLM's decoder frees them only for a request its engine admitted: the router
    cannot tell, so it releases them."""
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        prefiller, decoder = cluster.prefill_urls[0], cluster.decode_urls[0]
        await client.post(f"{decoder}/sim/fault", json={"mode": "hang", "count": 1})
        request = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(LONG, stream=stream)))
        async with asyncio.timeout(10):
            while (await engine_stats(decoder))["in_flight"] != 1:  # noqa: ASYNC110 - another engine's state
                await asyncio.sleep(0.02)
        await leave_and_find_released(request, prefiller, url, orphaned=0)
