from __future__ import annotations

import math
import random

import pytest

from dpd_router.routing.adaptive import AdaptiveModel, AdaptivePolicy, LinearCost


def test_a_fit_learns_a_known_line_from_noisy_observations() -> None:
    fit = LinearCost(overhead=0.5, per_token=0.001)  # a prior ten times too slow
    rng = random.Random(1)
    for _ in range(2000):
        tokens = rng.uniform(0, 8000)
        fit.observe(tokens, 0.02 + 0.0001 * tokens + rng.gauss(0, 0.002))
    assert fit.overhead == pytest.approx(0.02, abs=0.003)
    assert fit.per_token == pytest.approx(0.0001, rel=0.05)


def test_a_fit_forgets_old_observations() -> None:
    fit = LinearCost(overhead=0.0, per_token=0.0001, half_life=50)
    for tokens in range(0, 8000, 8):
        fit.observe(tokens, 0.0001 * tokens)
    for tokens in range(0, 8000, 8):
        fit.observe(tokens, 0.0004 * tokens)  # the engine got four times slower
    assert fit.per_token == pytest.approx(0.0004, rel=0.05)


def test_a_fit_ignores_nonsense_and_never_learns_a_negative_slope() -> None:
    fit = LinearCost(overhead=0.01, per_token=0.0001)
    fit.observe(100, math.nan)
    fit.observe(-5, 1.0)
    assert fit.observations == 0
    for tokens in range(0, 4000, 10):
        fit.observe(tokens, 1.0 - tokens * 0.0001)
    assert fit.per_token == 0.0


def model(**policy: object) -> AdaptiveModel:
    defaults = {"explore_share": 0.0, "min_threshold": 16, "max_threshold": 1_000_000}
    return AdaptiveModel(AdaptivePolicy(**{**defaults, **policy}), routing_threshold=4096)  # type: ignore[arg-type]


def test_unlearned_the_static_threshold_holds_at_one_running_stream() -> None:
    m = model()
    assert m.effective_threshold("d", "p", running_streams=1, prefiller_queue=0) == pytest.approx(4096, rel=0.01)
    assert not m.estimate("d", "p", 4000, running_streams=1, prefiller_queue=0).disaggregate
    assert m.estimate("d", "p", 4200, running_streams=1, prefiller_queue=0).disaggregate


def test_an_idle_decoder_keeps_long_prompts_and_a_busy_one_sends_medium_ones_away() -> None:
    m = model()
    idle = m.estimate("d", "p", 20_000, running_streams=0, prefiller_queue=0)
    assert not idle.disaggregate and idle.reason == "adaptive_cheaper_direct"
    busy = m.estimate("d", "p", 600, running_streams=32, prefiller_queue=0)
    assert busy.disaggregate and busy.reason == "adaptive_interference"
    assert m.effective_threshold("d", "p", 32, 0) < m.effective_threshold("d", "p", 4, 0)
    assert m.effective_threshold("d", "p", 0, 0) == math.inf


def test_a_queued_prefill_pool_raises_the_cost_of_disaggregating() -> None:
    m = model()
    assert m.estimate("d", "p", 1500, running_streams=4, prefiller_queue=0).disaggregate
    # 20k prompt tokens already queued on the prefiller come before this prompt's prefill.
    assert not m.estimate("d", "p", 1500, running_streams=4, prefiller_queue=20_000).disaggregate


def test_guard_rails_win_over_the_model() -> None:
    m = model(min_threshold=512, max_threshold=8192)
    assert m.estimate("d", "p", 100, running_streams=100, prefiller_queue=0).reason == "below_min_threshold"
    top = m.estimate("d", "p", 9000, running_streams=0, prefiller_queue=0)
    assert top.disaggregate and top.reason == "above_max_threshold"


def test_the_ttft_slo_decides_when_only_one_path_meets_it() -> None:
    m = model(ttft_slo=0.5)
    # Idle decoder, but a direct prefill of 20k tokens takes ~2 s against the prior: too slow.
    m.learn_prefill("p", 20_000, 0.3)
    for _ in range(50):
        m.learn_prefill("p", 20_000, 0.3)
        m.learn_prefill("p", 1000, 0.02)
    assert m.estimate("d", "p", 20_000, running_streams=0, prefiller_queue=0).reason == "ttft_slo"


def test_learning_moves_the_threshold() -> None:
    m = model()
    before = m.effective_threshold("d", "p", 4, 0)
    for tokens in range(100, 8000, 50):  # this prefiller turns out much faster than the prior
        m.learn_prefill("p", tokens, 0.001 + 0.00002 * tokens)
        m.learn_handoff(tokens, 0.002)
    assert m.effective_threshold("d", "p", 4, 0) < before


def test_exploration_flips_only_a_small_share_and_only_near_the_boundary() -> None:
    m = AdaptiveModel(
        AdaptivePolicy(explore_share=0.05, min_threshold=16, max_threshold=10**6),
        routing_threshold=4096,
        rng=random.Random(7).random,
    )
    near = [m.estimate("d", "p", 4096, running_streams=1, prefiller_queue=0) for _ in range(4000)]
    share = sum(e.reason == "explore" for e in near) / len(near)
    assert 0.03 < share < 0.07
    far = [m.estimate("d", "p", 300, running_streams=1, prefiller_queue=0) for _ in range(2000)]
    assert not any(e.reason == "explore" for e in far)


def test_memory_stays_bounded_with_many_endpoints() -> None:
    m = model()
    for i in range(5000):
        m.learn_direct(f"http://10.0.{i // 250}.{i % 250}:8000", 100, 0.01)
    assert len(m.describe()["direct_prefill"]) <= 1024  # type: ignore[arg-type]


def test_old_observations_also_fade_with_time() -> None:
    now = [0.0]
    fit = LinearCost(overhead=0.0, per_token=0.0001, half_life=10_000, half_life_seconds=10.0, clock=lambda: now[0])
    for tokens in range(0, 8000, 40):
        fit.observe(tokens, 0.0004 * tokens)  # a busy spell
    now[0] += 120.0  # two minutes later, the engine is quiet again
    for tokens in range(0, 8000, 400):
        fit.observe(tokens, 0.0001 * tokens)
    assert fit.per_token == pytest.approx(0.0001, rel=0.1)
