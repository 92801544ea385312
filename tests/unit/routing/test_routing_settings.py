"""Routing settings: validation, and the wiring Components.start builds from them."""

from __future__ import annotations

import socket

import httpx
import pytest

from dpd_router.config import Settings, SettingsError, load_settings
from dpd_router.pool.pool import Pool
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.kv_sources.lmcache_controller import LMCacheController
from dpd_router.routing.kv_sources.vllm_events import KVEventSubscriber, publishers_from_settings
from dpd_router.startup.components import Components

P, D = "http://10.0.0.1:8100", "http://10.0.0.2:8200"


def test_kv_event_publishers_accept_one_address_or_a_list_and_urls_are_normalised() -> None:
    settings = load_settings(
        prefill_urls=[P],
        decode_urls=[D],
        kv_events_endpoints={
            "10.0.0.1:8100/": "tcp://10.0.0.1:5557",
            D: ["tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558"],
        },
    )
    assert settings.kv_events_endpoints == {
        P: ["tcp://10.0.0.1:5557"],
        D: ["tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558"],
    }


def test_a_port_convention_covers_the_engines_not_listed() -> None:
    settings = load_settings(
        prefill_urls=[P], decode_urls=[D], kv_events_endpoints={P: "ipc:///tmp/p.sock"}, kv_events_port=5557
    )
    assert publishers_from_settings(settings, Pool(settings.prefill_urls, settings.decode_urls)) == {
        P: ["ipc:///tmp/p.sock"],
        D: ["tcp://10.0.0.2:5557"],
    }


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"kv_events_endpoints": {"http://10.0.0.9:1": "tcp://x:1"}}, "kv_events_endpoints"),
        ({"kv_events_endpoints": {P: "http://10.0.0.1:5557"}}, "kv_events_endpoints"),
        ({"lmcache_instance_ids": {"http://10.0.0.9:1": "i"}}, "lmcache_instance_ids"),
        ({"threshold_mode": "smart"}, "threshold_mode"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_bad_routing_settings_name_themselves(overrides: dict[str, object], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        load_settings(prefill_urls=[P], decode_urls=[D], **overrides)


def test_routing_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPD_DECODE_URLS", D)
    monkeypatch.setenv("DPD_PREFILL_URLS", P)
    monkeypatch.setenv("DPD_KV_EVENTS_ENDPOINTS", '{"http://10.0.0.1:8100": "tcp://10.0.0.1:5557"}')
    monkeypatch.setenv("DPD_SESSION_HEADER", "X-Conversation-Id")
    monkeypatch.setenv("DPD_PREFILL_STRATEGY", "kvaware")
    settings = load_settings()
    assert settings.kv_events_endpoints == {P: ["tcp://10.0.0.1:5557"]}
    assert settings.session_header == "x-conversation-id"


@pytest.mark.parametrize(("strategy", "subscribes"), [("prefixaware", False), ("kvaware", True)])
async def test_kv_sources_are_only_used_by_kvaware(strategy: str, subscribes: bool) -> None:
    settings = load_settings(
        prefill_urls=[P],
        decode_urls=[D],
        prefill_strategy=strategy,
        kv_events_endpoints={P: "tcp://10.0.0.1:5557"},
        lmcache_controller_url="10.0.0.5:9000",
    )
    assert settings.lmcache_controller_url == "http://10.0.0.5:9000"
    metrics = RouterMetrics()
    subscriber = KVEventSubscriber.from_settings(settings, Pool([P], [D]), metrics)
    assert (subscriber is not None) == subscribes
    async with httpx.AsyncClient() as client:
        assert (LMCacheController.from_settings(settings, client, metrics) is not None) == subscribes


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_the_router_starts_and_stops_its_scraper_and_kv_subscriber() -> None:
    prefill, decode = f"http://127.0.0.1:{unused_port()}", f"http://127.0.0.1:{unused_port()}"
    settings = Settings(
        prefill_urls=[prefill],
        decode_urls=[decode],
        prefill_strategy="kvaware",
        kv_events_port=unused_port(),
        lmcache_controller_url=f"http://127.0.0.1:{unused_port()}",
        health_timeout=0.5,
    )
    components = await Components.start(settings)
    routing = components.default.routing
    try:
        assert routing.kv_events is not None and isinstance(routing.lmcache, LMCacheController)
        assert routing.planner.prefill_strategy.name == "kvaware"
        assert routing.planner.decode_strategy.name == "kvaware"
        await components.upkeep.scraper.scrape_all()
        assert all(endpoint.load is None for endpoint in components.every_engine.endpoints())
    finally:
        await components.close()
