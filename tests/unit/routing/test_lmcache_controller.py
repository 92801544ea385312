"""The LMCache controller source: the longest match wins, instances map to engines, and it never stalls a request."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from dpd_router.pool.pool import Pool
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.kv_sources.lmcache_controller import LMCacheController, parse_layout

A, B, C = "http://10.0.0.1:8100", "http://10.0.0.2:8100", "http://10.0.0.3:8100"


def controller(
    respond: httpx.MockTransport, instances: dict[str, str] | None = None
) -> tuple[LMCacheController, RouterMetrics]:
    metrics = RouterMetrics()
    client = httpx.AsyncClient(transport=respond)
    lookup = LMCacheController(
        client,
        "http://controller:9000",
        metrics,
        lookup_timeout=0.2,
        probe_timeout=1.0,
        instance_ids={A: "inst-a", B: "inst-b", C: "inst-c"} if instances is None else instances,
    )
    return lookup, metrics


def lookups(metrics: RouterMetrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("dpd_router_kv_lookups_total", {"outcome": outcome}) or 0.0


@pytest.mark.parametrize(
    "body",
    [
        {"event_id": "e1", "layout_info": {"inst-a": ["LocalCPUBackend", 256], "inst-b": ["LocalDiskBackend", 1024]}},
        {"event_id": "e1", "inst-a": ["LocalCPUBackend", 256], "inst-b": ["LocalCPUBackend", 1024]},
    ],
    ids=["layout_info", "older top-level instances"],
)
def test_every_instance_match_is_kept(body: dict[str, object]) -> None:
    assert parse_layout(body) == {"inst-a": 256, "inst-b": 1024}


def test_malformed_layouts_yield_nothing() -> None:
    assert parse_layout([1, 2]) == {}
    assert parse_layout({"layout_info": {"inst-a": ["LocalCPUBackend", "many"], "inst-b": 0}}) == {}


async def test_lookup_maps_every_matching_instance_to_its_engine() -> None:
    seen: list[object] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(orjson.loads(request.content))
        layout = {"inst-a": ["LocalCPUBackend", 16], "inst-c": ["LocalCPUBackend", 48], "stranger": ["x", 99]}
        return httpx.Response(200, json={"event_id": "e", "layout_info": layout})

    lookup, metrics = controller(httpx.MockTransport(respond))
    assert await lookup.lookup([1, 2, 3]) == {A: 16, C: 48}
    assert seen == [{"tokens": [1, 2, 3]}]
    assert lookups(metrics, "hit") == 1.0


async def test_a_slow_controller_gives_no_answer_in_time() -> None:
    async def respond(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(1.0)
        return httpx.Response(200, json={"layout_info": {}})

    lookup, metrics = controller(httpx.MockTransport(respond))
    started = asyncio.get_running_loop().time()
    assert await lookup.lookup([1, 2, 3]) is None
    assert asyncio.get_running_loop().time() - started < 0.5
    assert lookups(metrics, "timeout") == 1.0


async def test_a_failing_controller_gives_no_answer() -> None:
    lookup, metrics = controller(httpx.MockTransport(lambda request: httpx.Response(500)))
    assert await lookup.lookup([1]) is None
    assert lookups(metrics, "error") == 1.0


async def test_instances_are_learnt_by_host_for_engines_alone_on_theirs() -> None:
    def respond(request: httpx.Request) -> httpx.Response:
        ip = orjson.loads(request.content)["ip"]
        return httpx.Response(200, json={"res": f"inst-{ip}"})

    lookup, _ = controller(httpx.MockTransport(respond), {A: "configured-a"})
    pool = Pool([A, "http://10.0.0.9:8100", "http://10.0.0.9:8101"], [B])
    await lookup.learn_instances(pool.endpoints())
    assert lookup.instances == {"configured-a": A, "inst-10.0.0.2": B}
