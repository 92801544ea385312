from __future__ import annotations

from dpd_router.config import load_settings
from dpd_router.metrics import RouterMetrics
from dpd_router.pool.pool import Pool
from dpd_router.routing.adaptive import AdaptiveModel
from dpd_router.routing.planner import Planner, adaptive_policy, build_planner
from dpd_router.tokenizer import Prompt


def planner(**overrides: object) -> Planner:
    settings = load_settings(
        prefill_urls=["http://127.0.0.1:8101", "http://127.0.0.1:8102"],
        decode_urls=["http://127.0.0.1:8201"],
        threshold_mode="adaptive",
        routing_threshold=4096,
        explore_share=0.0,
        **overrides,
    )
    pool = Pool(settings.prefill_urls, settings.decode_urls)
    adaptive = AdaptiveModel(adaptive_policy(settings), settings.routing_threshold)
    return build_planner(settings, pool, RouterMetrics(), adaptive=adaptive)


def prompt(tokens: int, seed: int = 0) -> Prompt:
    return Prompt(token_ids=[seed * 100_000 + i for i in range(tokens)], num_tokens=tokens, seconds=0.0)


def test_an_idle_decoder_serves_even_long_prompts_itself() -> None:
    p = planner()
    plan = p.plan(prompt(20_000))
    assert (plan.path, plan.reason) == ("direct", "adaptive_cheaper_direct")


def test_a_saturated_decoder_sends_medium_prompts_to_the_prefill_pool() -> None:
    p = planner()
    p.pool.decoders[0].in_flight = 64
    plan = p.plan(prompt(1000, seed=1))
    assert (plan.path, plan.reason) == ("disaggregated", "adaptive_interference")
    assert plan.prefiller is not None


def test_a_prefill_pool_that_is_down_wins_over_the_model() -> None:
    p = planner()
    p.pool.decoders[0].in_flight = 64
    for prefiller in p.pool.prefillers:
        prefiller.healthy = False
    assert p.plan(prompt(20_000, seed=2)).reason == "prefill_pool_down"


def test_short_prompts_stay_below_the_minimum_whatever_the_load() -> None:
    p = planner(min_threshold=512)
    p.pool.decoders[0].in_flight = 500
    plan = p.plan(prompt(300, seed=3))
    assert (plan.path, plan.reason) == ("direct", "below_threshold")


def test_the_view_reports_a_threshold_that_falls_with_load() -> None:
    p = planner()
    decoder = p.pool.decoders[0]
    decoder.in_flight = 2
    light = p.adaptive_view()[0]["threshold_tokens"]
    decoder.in_flight = 32
    heavy = p.adaptive_view()[0]["threshold_tokens"]
    assert heavy < light


def test_requests_still_in_their_prefill_hop_are_not_streams_on_the_decoder() -> None:
    p = planner()
    decoder = p.pool.decoders[0]
    decoder.in_flight, decoder.staging = 12, 12  # all twelve are waiting for a prefiller
    plan = p.plan(prompt(20_000, seed=4))
    assert plan.decoder_streams == 0
    assert (plan.path, plan.reason) == ("direct", "adaptive_cheaper_direct")
    decoder.staging = 0  # now they all run here
    busy = p.plan(prompt(20_000, seed=5))
    assert busy.decoder_streams == 12 and busy.path == "disaggregated"


def test_a_disaggregated_adaptive_plan_carries_the_queue_its_prefill_waits_for() -> None:
    p = planner()
    p.pool.decoders[0].in_flight = 64
    for prefiller in p.pool.prefillers:
        prefiller.in_flight, prefiller.queued_tokens = 1, 3000
    plan = p.plan(prompt(8000, seed=6))
    assert plan.path == "disaggregated"
    assert plan.prefiller_queue == 3000
