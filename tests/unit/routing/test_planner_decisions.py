"""The Planner built from settings: decoder affinity, the threshold modes, the busy gate, and reasons."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpd_router.config import Settings
from dpd_router.pool.endpoint import Endpoint, EngineLoad
from dpd_router.pool.pool import Pool
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.planner import Planner, build_planner
from dpd_router.routing.request import KVHint, RoutingRequest

SYSTEM_PROMPT = list(range(1000, 1000 + 4096))


def prompt(ids: list[int]) -> Prompt:
    return Prompt(token_ids=ids, num_tokens=len(ids), seconds=0.0)


def planner(prefillers: int = 2, decoders: int = 2, **overrides: Any) -> Planner:
    config = Settings(
        prefill_urls=[f"http://127.0.0.1:81{i:02d}" for i in range(prefillers)],
        decode_urls=[f"http://127.0.0.1:82{i:02d}" for i in range(decoders)],
        **{"routing_threshold": 1024, **overrides},
    )
    return build_planner(config, Pool(config.prefill_urls, config.decode_urls), RouterMetrics())


def queue(endpoint: Endpoint, waiting: float) -> None:
    endpoint.record_load(EngineLoad(0, waiting, None, None, scraped_at=time.monotonic()), fresh_for=6.0)


def test_a_long_new_prompt_is_disaggregated_with_every_token_uncached() -> None:
    plan = planner().plan(prompt(SYSTEM_PROMPT))
    assert (plan.path, plan.reason, plan.uncached_tokens) == ("disaggregated", "long_prompt", 4096)


def test_a_short_prompt_stays_below_threshold() -> None:
    plan = planner().plan(prompt(list(range(100))))
    assert (plan.path, plan.reason, plan.prefiller) == ("direct", "below_threshold", None)


def test_a_long_prompt_whose_prefix_sits_on_the_decoder_goes_direct() -> None:
    p = planner()
    first = p.plan(prompt(SYSTEM_PROMPT + [1] * 50))
    follow_up = p.plan(prompt(SYSTEM_PROMPT + [2] * 300))
    assert follow_up.decoder is first.decoder
    assert (follow_up.path, follow_up.reason) == ("direct", "cached_on_decoder")
    assert follow_up.uncached_tokens == 4396 - 4096


def test_cached_prefix_with_a_long_new_suffix_still_goes_to_a_prefiller() -> None:
    p = planner()
    p.plan(prompt(SYSTEM_PROMPT))
    plan = p.plan(prompt(SYSTEM_PROMPT + [3] * 2000))
    assert (plan.path, plan.reason, plan.uncached_tokens) == ("disaggregated", "long_prompt", 2000)


def test_static_mode_disaggregates_by_prompt_length_alone() -> None:
    p = planner(threshold_mode="static")
    p.plan(prompt(SYSTEM_PROMPT))
    plan = p.plan(prompt(SYSTEM_PROMPT + [2] * 300))
    assert (plan.path, plan.reason, plan.uncached_tokens) == ("disaggregated", "long_prompt", 4396)


def test_requests_sharing_a_long_prefix_land_on_the_same_prefiller() -> None:
    p = planner(prefillers=3, threshold_mode="static")
    first = p.plan(prompt(SYSTEM_PROMPT + [1] * 100))
    first.prefiller.in_flight = 1  # type: ignore[union-attr]  # still busy with the first one
    second = p.plan(prompt(SYSTEM_PROMPT + [2] * 100))
    assert second.prefiller is first.prefiller


def test_a_short_prompt_goes_to_the_decoder_holding_its_prefix() -> None:
    p = planner(decoders=3)
    chat = list(range(500))
    first = p.plan(prompt(chat))
    first.decoder.in_flight = 2  # busier than the others, but well within balance
    second = p.plan(prompt(chat + list(range(500, 600))))
    assert (second.decoder, second.reason) == (first.decoder, "below_threshold")


def test_decoders_without_any_prefix_are_chosen_by_load() -> None:
    p = planner(decoders=3)
    busy, idle, busier = p.pool.decoders
    busy.in_flight, idle.in_flight, busier.in_flight = 3, 0, 5
    queue(idle, waiting=4)  # 0 + 2*4 = 8 > 3
    assert p.plan(prompt(list(range(10)))).decoder is busy


def test_a_busy_prefill_pool_sends_mid_sized_prompts_direct() -> None:
    p = planner(prefill_busy_queue_depth=8, prefill_busy_max_tokens=16384)
    for prefiller in p.pool.prefillers:
        queue(prefiller, waiting=9)
    plan = p.plan(prompt(SYSTEM_PROMPT))
    assert (plan.path, plan.reason) == ("direct", "prefill_pool_busy")


def test_the_busy_gate_has_a_hard_ceiling() -> None:
    p = planner(prefill_busy_queue_depth=8, prefill_busy_max_tokens=4096)
    for prefiller in p.pool.prefillers:
        queue(prefiller, waiting=50)
    assert p.plan(prompt(SYSTEM_PROMPT)).reason == "long_prompt"
    assert p.plan(prompt(list(range(20_000, 20_000 + 4095)))).reason == "prefill_pool_busy"
    assert p.plan(prompt(list(range(9000, 9000 + 2000)))).reason == "prefill_pool_busy"


@pytest.mark.parametrize("second_queue", [8, None], ids=["one prefiller at the depth", "one prefiller unscraped"])
def test_the_busy_gate_stays_open_unless_every_prefiller_is_known_busy(second_queue: int | None) -> None:
    p = planner()
    first, second = p.pool.prefillers
    queue(first, waiting=30)
    if second_queue is not None:
        queue(second, waiting=second_queue)
    plan = p.plan(prompt(SYSTEM_PROMPT))
    assert (plan.reason, plan.prefiller) == ("long_prompt", second)


def test_no_healthy_prefiller_means_prefill_pool_down() -> None:
    p = planner()
    for prefiller in p.pool.prefillers:
        prefiller.healthy = False
    assert p.plan(prompt(SYSTEM_PROMPT)).reason == "prefill_pool_down"


def test_a_failed_prefill_keeps_the_plan_but_serves_it_direct() -> None:
    plan = planner().plan(prompt(SYSTEM_PROMPT))
    fallback = plan.direct("prefill_failed")
    assert (fallback.path, fallback.reason, fallback.prefiller) == ("direct", "prefill_failed", None)
    assert (fallback.decoder, fallback.uncached_tokens) == (plan.decoder, plan.uncached_tokens)


def test_the_session_strategy_reads_the_configured_header() -> None:
    p = planner(prefillers=4, prefill_strategy="session", session_header="X-Conversation", threshold_mode="static")
    key = p.session_key({"x-conversation": "c-1"}, {"user": "u-9"})
    assert key == "c-1"
    chosen = {p.plan(prompt(SYSTEM_PROMPT), session_key=key).prefiller for _ in range(5)}
    assert len(chosen) == 1


async def test_lookup_kv_is_free_unless_kvaware_has_a_controller() -> None:
    assert await planner().lookup_kv(prompt(SYSTEM_PROMPT)) is None

    class Controller:
        async def lookup(self, token_ids: Sequence[int]) -> KVHint | None:
            return {"http://127.0.0.1:8101": len(token_ids)}

    config = Settings(
        prefill_urls=["http://127.0.0.1:8100", "http://127.0.0.1:8101"],
        decode_urls=["http://127.0.0.1:8200"],
        prefill_strategy="kvaware",
        threshold_mode="static",
        routing_threshold=1024,
    )
    p = build_planner(config, Pool(config.prefill_urls, config.decode_urls), RouterMetrics(), kv_lookup=Controller())
    hint = await p.lookup_kv(prompt(SYSTEM_PROMPT))
    assert hint == {"http://127.0.0.1:8101": 4096}
    p.pool.prefillers[1].in_flight = 3
    assert p.plan(prompt(SYSTEM_PROMPT), kv_hint=hint).prefiller is p.pool.prefillers[1]


@settings(max_examples=200, deadline=None)
@given(
    strategy=st.sampled_from(["roundrobin", "session", "prefixaware", "kvaware", "leastloaded"]),
    mode=st.sampled_from(["static", "cache_aware"]),
    prefill_health=st.lists(st.booleans(), min_size=0, max_size=4),
    decode_health=st.lists(st.booleans(), min_size=1, max_size=4).filter(any),
    in_flight=st.lists(st.integers(0, 50), min_size=8, max_size=8),
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3000)), min_size=1, max_size=8),
    key=st.none() | st.text(max_size=8),
)
def test_decisions_never_choose_an_unhealthy_endpoint(
    strategy: str,
    mode: str,
    prefill_health: list[bool],
    decode_health: list[bool],
    in_flight: list[int],
    prompts: list[tuple[int, int]],
    key: str | None,
) -> None:
    p = planner(len(prefill_health), len(decode_health), prefill_strategy=strategy, threshold_mode=mode)
    for endpoint, healthy, flying in zip(p.pool.endpoints(), prefill_health + decode_health, in_flight, strict=False):
        endpoint.healthy = healthy
        endpoint.in_flight = flying
    for family, length in prompts:
        # Prompts of a few families share prefixes, so the indexes fill with placements.
        plan = p.plan(prompt([family] * 64 + list(range(length))), session_key=key)
        assert plan.decoder.healthy and plan.decoder.role == "decode"
        assert plan.prefiller is None or (plan.prefiller.healthy and plan.prefiller.role == "prefill")
        assert (plan.path == "disaggregated") == (plan.prefiller is not None)
        assert 0 <= plan.uncached_tokens <= 64 + length


def test_a_request_the_connector_cannot_disaggregate_is_direct_and_never_cached_on_a_prefiller() -> None:
    p = planner()
    plan = p.plan(prompt(SYSTEM_PROMPT), unsupported="the 'tools' field")
    assert (plan.path, plan.reason, plan.prefiller) == ("direct", "connector_unsupported", None)
    assert p.cache is not None
    request = RoutingRequest(prompt(SYSTEM_PROMPT))
    assert p.cache.cached_tokens(request, plan.decoder) == 4096
    assert all(p.cache.cached_tokens(request, prefiller) == 0 for prefiller in p.pool.prefillers)


def test_a_connector_whose_decoders_serve_nothing_alone_disaggregates_every_prompt() -> None:
    config = Settings(
        prefill_urls=["http://127.0.0.1:8100"],
        decode_urls=["http://127.0.0.1:8200"],
        routing_threshold=1024,
        prefill_busy_queue_depth=0,
    )
    pool = Pool(config.prefill_urls, config.decode_urls)
    p = build_planner(config, pool, RouterMetrics(), serves_direct=False)
    queue(pool.prefillers[0], waiting=50)  # a busy prefill pool does not send anything direct either
    short = p.plan(prompt(list(range(10))))
    assert (short.path, short.reason, short.prefiller) == (
        "disaggregated",
        "connector_requires_prefill",
        pool.prefillers[0],
    )
    pool.prefillers[0].healthy = False
    down = p.plan(prompt(SYSTEM_PROMPT))
    assert (down.path, down.reason) == ("direct", "prefill_pool_down"), "which the gateway refuses"
