from __future__ import annotations

import time

from dpd_router.config import load_settings
from dpd_router.pool.endpoint import EngineLoad
from dpd_router.pool.pool import Pool
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.adaptive import AdaptiveModel
from dpd_router.routing.planner import Planner, adaptive_policy, build_planner

BASE: dict[str, object] = {
    "prefill_urls": ["http://127.0.0.1:8101", "http://127.0.0.1:8102"],
    "decode_urls": ["http://127.0.0.1:8201"],
    "threshold_mode": "adaptive",
    "routing_threshold": 4096,
    "explore_share": 0.0,
}


def planner(**overrides: object) -> Planner:
    settings = load_settings(**{**BASE, **overrides})
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


def busy_prefillers(p: Planner, *, waiting: float, queued_tokens: int) -> None:
    """Every prefiller: `waiting` requests in its scraped engine queue, one router call holding
    `queued_tokens` prompt tokens."""
    for prefiller in p.pool.prefillers:
        prefiller.record_load(EngineLoad(0, waiting, None, None, scraped_at=time.monotonic()), fresh_for=6.0)
        prefiller.in_flight, prefiller.queued_tokens = 1, queued_tokens


def test_many_short_prompts_waiting_on_the_prefillers_do_not_close_the_adaptive_busy_gate() -> None:
    # Adaptive mode sent a burst of short prompts to idle prefillers: 12 waiting requests, 6k tokens.
    # The request-count gate (depth 8) would now send the next long prompt onto a decoder full of
    # streams; in adaptive mode the gate counts tokens, and the model prices the 6k-token queue.
    p = planner(prefill_busy_queue_depth=8)
    p.pool.decoders[0].in_flight = 24
    busy_prefillers(p, waiting=12, queued_tokens=6000)
    plan = p.plan(prompt(8000, seed=7))
    assert (plan.path, plan.reason) == ("disaggregated", "adaptive_interference")


def test_prefillers_holding_more_queued_tokens_than_the_cap_close_the_adaptive_busy_gate() -> None:
    p = planner(prefill_busy_queue_tokens=100_000, prefill_busy_max_tokens=16384)
    p.pool.decoders[0].in_flight = 1
    busy_prefillers(p, waiting=0, queued_tokens=120_000)
    assert p.plan(prompt(8000, seed=8)).reason == "prefill_pool_busy"
    # The ceiling still holds: prompts of prefill_busy_max_tokens and more are left to the model (which,
    # with one stream to stall and a 12 s queue, keeps this one direct).
    ceiling = p.plan(prompt(20_000, seed=9))
    assert (ceiling.path, ceiling.reason) == ("direct", "adaptive_cheaper_direct")
    # One prefiller below the cap keeps the gate open.
    p.pool.prefillers[1].queued_tokens = 50_000
    assert p.plan(prompt(8000, seed=11)).reason != "prefill_pool_busy"


def test_the_adaptive_busy_gate_diverts_only_what_the_decoders_streams_can_absorb() -> None:
    # A saturated prefill pool, and a decoder with 24 streams: an 8k-token prompt would stall each of
    # them for its whole prefill (8000 x 24 tokens, over the 16384 ceiling), so the model decides it;
    # a 600-token prompt (600 x 24 = 14400) is diverted.
    p = planner(prefill_busy_queue_tokens=100_000, prefill_busy_max_tokens=16384)
    p.pool.decoders[0].in_flight = 24
    busy_prefillers(p, waiting=0, queued_tokens=120_000)
    long = p.plan(prompt(8000, seed=13))
    assert (long.path, long.reason) == ("disaggregated", "adaptive_interference")
    assert (p.plan(prompt(600, seed=14)).path, p.plan(prompt(600, seed=15)).reason) == ("direct", "prefill_pool_busy")
    # The same 8k-token prompt on a decoder with one stream is diverted.
    p.pool.decoders[0].in_flight = 1
    assert p.plan(prompt(8000, seed=16)).reason == "prefill_pool_busy"


def test_a_token_cap_of_zero_turns_the_adaptive_busy_gate_off() -> None:
    p = planner(prefill_busy_queue_tokens=0)
    p.pool.decoders[0].in_flight = 64
    busy_prefillers(p, waiting=100, queued_tokens=10**7)
    assert p.plan(prompt(8000, seed=12)).reason != "prefill_pool_busy"


def test_a_prompt_beyond_ttft_slo_max_tokens_answers_to_the_itl_slo_alone() -> None:
    # 4 streams on the decoder, a 10 s queue on both prefillers (at the prior 100 us per token): the hop
    # misses the 1 s TTFT SLO and a 5000-token direct prefill would pause the streams 0.5 s, over the
    # ITL SLO. With the TTFT SLO on every prompt neither path meets both and the model keeps it; with
    # the TTFT SLO only up to 4095 tokens, it answers to the ITL SLO and takes the hop.
    slos = {"ttft_slo": 1.0, "itl_slo": 0.25, "prefill_busy_queue_tokens": 0}
    every = planner(**slos)
    scoped = planner(**slos, ttft_slo_max_tokens=4095)
    for p in (every, scoped):
        p.pool.decoders[0].in_flight = 4
        busy_prefillers(p, waiting=0, queued_tokens=100_000)
    assert (every.plan(prompt(5000, seed=17)).path, every.plan(prompt(5000, seed=18)).reason) == (
        "direct",
        "adaptive_cheaper_direct",
    )
    long = scoped.plan(prompt(5000, seed=19))
    assert (long.path, long.reason) == ("disaggregated", "itl_slo")
    medium = scoped.plan(prompt(3000, seed=20))
    assert (medium.path, medium.reason) == ("direct", "adaptive_cheaper_direct")
    # A live change of the setting reaches the model.
    scoped.reconfigure(load_settings(**{**BASE, **slos}))
    assert scoped.plan(prompt(5000, seed=21)).path == "direct"
