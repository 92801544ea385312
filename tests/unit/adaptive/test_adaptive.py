from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from dpd_router.record.observe import RequestTrace, outcome_of
from dpd_router.record.outcome import Outcome
from dpd_router.routing.adaptive import LEARNED_HOPS, AdaptiveModel, AdaptivePolicy, GapBudget, LinearCost


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


def hops_on_the_prior(m: AdaptiveModel, prefiller: str, calls: int = LEARNED_HOPS) -> None:
    """Calls that found the prefiller idle and took what its prior line says: learned, the same line."""
    line = m.hop_cost(prefiller)
    for i in range(calls):
        tokens = 1000 + 500 * i
        m.learn_prefill(prefiller, tokens, line.predict(tokens))


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
    hops_on_the_prior(m, "p")
    # Just below the boundary (at 4096 exactly, the refitted line's rounding decides the side).
    near = [m.estimate("d", "p", 4000, running_streams=1, prefiller_queue=0) for _ in range(4000)]
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
        fit.observe(tokens, 0.0004 * tokens)  # the engine was slow
    now[0] += 120.0  # two minutes later it is fast again
    for tokens in range(0, 8000, 40):
        fit.observe(tokens, 0.0001 * tokens)
    assert fit.per_token == pytest.approx(0.0001, rel=0.1)


def test_after_a_quiet_spell_one_odd_observation_does_not_replace_the_line() -> None:
    now = [0.0]
    fit = LinearCost(overhead=0.5, per_token=0.001, half_life_seconds=10.0, clock=lambda: now[0])
    for tokens in range(0, 8000, 40):
        now[0] += 0.1
        fit.observe(tokens, 0.004 + 0.0001 * tokens)
    now[0] += 3600.0  # an hour without a single observation: the line fades, but not below prior_weight
    fit.observe(1000, 0.3)  # then a hiccup, three times the line's 0.104 s
    assert fit.predict(1000) < 0.25  # pulled towards it, not through it
    assert fit.per_token == pytest.approx(0.0001, rel=0.3)
    assert fit.predict(4000) == pytest.approx(0.404, rel=0.2)


def trace(**fields: object) -> Outcome:
    """A finished streamed request, as the observer reports it to learners: decode started at t=10 s;
    `first_token` seconds later its first token."""
    first = fields.pop("first_token", 0.1)
    t = RequestTrace(request_id="r", kind="chat", stream=True)
    t.decode_started = 10.0
    t.first_token_at = 10.0 + float(first)  # type: ignore[arg-type]
    for name, value in fields.items():
        setattr(t, name, value)
    return outcome_of(t)


def hop_trace(tokens: int, queued: float, seconds: float) -> Outcome:
    return trace(
        path="disaggregated", prefiller="p", decoder="d", uncached_tokens=tokens, prefiller_queue=queued,
        prefill_seconds=seconds, first_token=0.02,
    )  # fmt: skip


def test_a_whole_answer_teaches_its_prefill_call_but_not_its_first_token() -> None:
    m = model()
    m.learn_from(replace(hop_trace(4000, 0, 0.3), stream=False))
    assert m.hop_observations("p") == 1 and m.slo_hop_cost("p").observations == 1
    assert m.handoff.observations == 0
    m.learn_from(hop_trace(4000, 0, 0.3))
    assert m.hop_observations("p") == 2 and m.handoff.observations == 1


def test_the_prefill_hop_is_learned_from_calls_that_found_the_prefiller_idle() -> None:
    m = model()
    rng = random.Random(3)
    per_token = 1 / 12000  # the prefiller's real speed; the prior says 1/10000
    for _ in range(400):
        tokens, queued = rng.randint(200, 16000), rng.choice([0, 0, 5000, 20_000, 60_000])
        # Behind a queue, the call in service has done part of its work already (the router cannot see how much).
        done = rng.uniform(0, min(queued, 8192))
        m.learn_from(hop_trace(tokens, queued, 0.004 + per_token * (queued - done + tokens)))
    hop = m.hop_cost("p")
    # Calls that waited behind a queue make the prefiller look neither slower nor faster per token...
    assert hop.per_token == pytest.approx(per_token, rel=0.05)
    assert hop.overhead == pytest.approx(0.004, abs=0.01)
    # ...and a queue is costed at that speed: 24k tokens ahead add 2 s to the hop.
    idle = m.estimate("d", "p", 1000, running_streams=4, prefiller_queue=0)
    queued = m.estimate("d", "p", 1000, running_streams=4, prefiller_queue=24_000)
    assert queued.hop - idle.hop == pytest.approx(2.0, rel=0.05)


def test_calls_behind_a_queue_teach_the_hop_until_enough_calls_found_the_prefiller_idle() -> None:
    m = model()  # its prior: 0.41 s (4096 tokens' worth) + 100 us per token
    per_token = 1 / 12000
    for tokens in range(1000, 9000, 500):  # a prefiller never idle: the queued calls still fade the prior
        m.learn_from(hop_trace(tokens, 20_000, per_token * (20_000 + tokens)))
    hop = m.hop_cost("p")
    assert hop.observations == 16 and hop.idle_observations == 0
    assert hop.predict(25_000) == pytest.approx(per_token * 25_000, rel=0.1)
    # Calls that found it idle take over once there are enough of them; their line starts from the
    # one learned so far, not from the prior.
    slower = 1 / 8000
    for tokens in (1000, 3000):
        m.learn_from(hop_trace(tokens, 0, slower * tokens))
    assert hop.predict(25_000) == pytest.approx(per_token * 25_000, rel=0.1)
    for tokens in range(500, 8000, 500):
        m.learn_from(hop_trace(tokens, 0, slower * tokens))
    assert hop.idle_observations == 17
    assert hop.per_token == pytest.approx(slower, rel=0.1)
    # A queued call no longer moves the line.
    m.learn_from(hop_trace(4000, 50_000, 30.0))
    assert hop.per_token == pytest.approx(slower, rel=0.1)


def test_a_hop_that_was_retried_or_planned_without_a_queue_teaches_nothing() -> None:
    m = model()
    base = {"path": "disaggregated", "prefiller": "p", "decoder": "d", "uncached_tokens": 4000, "prefill_seconds": 9.0}
    m.learn_from(trace(**base, prefiller_queue=0.0, prefill_error="p: timeout"))
    m.learn_from(trace(**base, prefiller_queue=None))
    assert m.hop_cost("p").observations == 0


def test_a_concurrent_hand_off_teaches_the_hop_but_not_the_hand_off_twice() -> None:
    """SGLang's decode call runs beside its prefill: its first token already contains the prefill time."""
    m = model()
    handoff = (m.handoff.overhead, m.handoff.per_token, m.handoff.observations)
    base = {"path": "disaggregated", "prefiller": "p", "decoder": "d", "uncached_tokens": 4000}
    m.learn_from(trace(**base, prefiller_queue=0.0, prefill_seconds=0.5, first_token=0.6, prefill_overlaps_decode=True))
    assert m.hop_cost("p").observations == 1
    assert (m.handoff.overhead, m.handoff.per_token, m.handoff.observations) == handoff
    m.learn_from(trace(**base, prefiller_queue=0.0, prefill_seconds=0.5, first_token=0.02))
    assert m.handoff.observations == handoff[2] + 1


def test_only_a_quiet_decoder_teaches_its_prefill_speed_but_every_direct_request_its_wait() -> None:
    m = model()
    d = m.direct_cost("d")
    before = (d.overhead, d.per_token)
    # A busy decoder: the first token also waited behind other prefills and decode steps.
    for _ in range(20):
        m.learn_from(trace(path="direct", decoder="d", uncached_tokens=1000, decoder_streams=8, first_token=1.5))
    assert (d.overhead, d.per_token) == before
    assert m.direct_wait("d").mean == pytest.approx(1.5 - d.predict(1000), rel=0.01)
    # A quiet one: its first token is the prefill.
    for tokens in range(250, 8000, 250):
        m.learn_from(
            trace(path="direct", decoder="d", uncached_tokens=tokens, decoder_streams=0, first_token=tokens / 12000)
        )
    assert d.per_token < before[1]
    assert m.direct_wait("d").mean < 0.5  # the wait fades fast once direct requests stop waiting


def test_a_waiting_decoder_makes_the_hop_relatively_cheaper() -> None:
    m = model()
    kept = m.estimate("d", "p", 3000, running_streams=1, prefiller_queue=0)
    assert not kept.disaggregate
    for _ in range(30):  # direct requests on this decoder wait ~1 s for their first token
        m.learn_from(trace(path="direct", decoder="d", uncached_tokens=500, decoder_streams=6, first_token=1.0))
    moved = m.estimate("d", "p", 3000, running_streams=1, prefiller_queue=0)
    assert moved.disaggregate and moved.extra_cost < kept.extra_cost
    assert m.effective_threshold("d", "p", 1, 0) < 3000


def test_the_ttft_slo_compares_first_token_times_queues_included() -> None:
    m = model(ttft_slo=1.0)
    # The prefiller has 30k tokens queued (about 3 s): only the direct path meets the SLO...
    slo = m.estimate("d", "p", 6000, running_streams=1, prefiller_queue=30_000)
    assert (slo.disaggregate, slo.reason) == (False, "ttft_slo")
    # ...until direct requests on this decoder are seen waiting 2 s for their first token too:
    # then neither path meets it, and the model decides.
    for _ in range(30):
        m.learn_from(trace(path="direct", decoder="d", uncached_tokens=500, decoder_streams=20, first_token=2.0))
    both_late = m.estimate("d", "p", 6000, running_streams=1, prefiller_queue=30_000)
    assert both_late.reason == "adaptive_cheaper_direct"


def test_the_ttft_slo_keeps_no_prompt_direct_whose_stall_would_make_a_full_decoder_late() -> None:
    m = model(ttft_slo=1.0)
    # Direct: 0.6 s to its own first token, on time; but 20 streams each wait those 0.6 s for their
    # next token (12 s of stall in all), and every request behind it for its first: the model decides.
    full = m.estimate("d", "p", 6000, running_streams=20, prefiller_queue=30_000)
    assert (full.disaggregate, full.reason) == (True, "adaptive_interference")
    # With a short stall in all the SLO still keeps the prompt direct...
    assert m.estimate("d", "p", 6000, running_streams=1, prefiller_queue=30_000).reason == "ttft_slo"
    # ...and the hop, which stalls no stream, is taken for the SLO whatever the decoder's load.
    m = model(ttft_slo=1.0)
    for _ in range(30):
        m.learn_from(trace(path="direct", decoder="d", uncached_tokens=500, decoder_streams=20, first_token=2.0))
    late_direct = m.estimate("d", "p", 3000, running_streams=0, prefiller_queue=0)
    assert (late_direct.disaggregate, late_direct.reason) == (True, "ttft_slo")


def test_the_itl_slo_sends_away_a_prompt_whose_prefill_would_freeze_the_streams() -> None:
    # A 10 s prefill queue: by the linear costs a 6k-token prompt (0.6 s on the decoder, 4 streams:
    # 2.4 s of stall in all) is cheaper direct than 10 s in the queue...
    plain = model().estimate("d", "p", 6000, running_streams=4, prefiller_queue=100_000)
    assert (plain.disaggregate, plain.reason) == (False, "adaptive_cheaper_direct")
    # ...but each stream would freeze for 0.6 s, over a 0.25 s ITL SLO: the prompt takes the hop.
    m = model(itl_slo=0.25)
    frozen = m.estimate("d", "p", 6000, running_streams=4, prefiller_queue=100_000)
    assert (frozen.disaggregate, frozen.reason) == (True, "itl_slo")
    # A 2k-token prompt pauses them 0.2 s, within the SLO: the model keeps it direct...
    within = m.estimate("d", "p", 2000, running_streams=4, prefiller_queue=100_000)
    assert (within.disaggregate, within.reason) == (False, "adaptive_cheaper_direct")
    # ...also behind prompts queued on the decoder: they pause the streams whichever path it takes, and
    # the prefill pool's 10 s queue would buy nothing.
    queued = m.estimate("d", "p", 2000, running_streams=4, prefiller_queue=100_000, decoder_queue=5000)
    assert (queued.disaggregate, queued.reason) == (False, "adaptive_cheaper_direct")
    # An idle decoder has no stream to pause: the model decides.
    assert m.estimate("d", "p", 6000, running_streams=0, prefiller_queue=100_000).reason == "adaptive_cheaper_direct"


def test_the_effective_threshold_shows_where_the_itl_slo_sends_prompts_away() -> None:
    # 4 streams behind a 10 s prefill queue: by the linear costs only prompts past about 20k tokens
    # would leave the decoder; with a 0.25 s ITL SLO those past 2450 do (0.005 s + 100 us per token).
    plain = model().effective_threshold("d", "p", running_streams=4, prefiller_queue=100_000)
    capped = model(itl_slo=0.25).effective_threshold("d", "p", running_streams=4, prefiller_queue=100_000)
    assert plain > 15_000
    assert capped == pytest.approx(2450, rel=0.01)
    m = model(itl_slo=0.25)
    assert not m.estimate("d", "p", 2400, running_streams=4, prefiller_queue=100_000).disaggregate
    assert m.estimate("d", "p", 2500, running_streams=4, prefiller_queue=100_000).disaggregate
    # No stream to pause, or a hop that would miss the TTFT SLO: the model's threshold stands.
    assert math.isinf(m.effective_threshold("d", "p", running_streams=0, prefiller_queue=100_000))
    late = model(itl_slo=0.25, ttft_slo=1.0).effective_threshold("d", "p", running_streams=4, prefiller_queue=100_000)
    assert late == pytest.approx(plain)


def test_with_both_slos_the_itl_slo_decides_only_while_the_hop_is_on_time() -> None:
    m = model(itl_slo=0.25, ttft_slo=1.0)
    # No prefill queue: the hop's first token comes in about 0.9 s, on time, and the direct prefill
    # would pause 4 streams 0.5 s: the hop.
    on_time = m.estimate("d", "p", 5000, running_streams=4, prefiller_queue=0)
    assert (on_time.disaggregate, on_time.reason) == (True, "itl_slo")
    # Behind a 10 s queue the hop is late and the direct path too rough: neither meets the SLOs.
    neither = m.estimate("d", "p", 5000, running_streams=4, prefiller_queue=100_000)
    assert neither.reason == "adaptive_cheaper_direct"


def test_a_prompt_beyond_ttft_slo_max_tokens_has_no_ttft_slo() -> None:
    # The same late hop and rough direct path: a 5000-token prompt past the TTFT SLO's 4095 tokens
    # answers to the ITL SLO alone and takes the hop; a 3000-token one is within it, and neither path
    # meets both SLOs, so the model keeps it.
    m = model(itl_slo=0.25, ttft_slo=1.0, ttft_slo_max_tokens=4095)
    long = m.estimate("d", "p", 5000, running_streams=4, prefiller_queue=100_000)
    assert (long.disaggregate, long.reason) == (True, "itl_slo")
    medium = m.estimate("d", "p", 3000, running_streams=4, prefiller_queue=100_000)
    assert (medium.disaggregate, medium.reason) == (False, "adaptive_cheaper_direct")
    # Only a prompt within it may be kept direct on time: beyond it the TTFT SLO does not pick the path.
    on_time = model(ttft_slo=1.0, ttft_slo_max_tokens=4095)
    assert on_time.estimate("d", "p", 4000, running_streams=1, prefiller_queue=100_000).reason == "ttft_slo"
    assert on_time.estimate("d", "p", 4200, running_streams=1, prefiller_queue=100_000).reason != "ttft_slo"
    # The effective threshold: the ITL SLO's 2450 tokens are within the TTFT SLO, whose late hop leaves
    # those prompts to the model (its threshold is past 15k here), so prompts leave from 4096 tokens, where
    # the TTFT SLO ends; when the ITL crossing lies beyond the TTFT SLO's reach, the ITL SLO's stands.
    within = model(itl_slo=0.25, ttft_slo=1.0, ttft_slo_max_tokens=4095)
    assert within.effective_threshold("d", "p", running_streams=4, prefiller_queue=100_000) == 4096
    assert within.estimate("d", "p", 4096, running_streams=4, prefiller_queue=100_000).disaggregate
    assert not within.estimate("d", "p", 4095, running_streams=4, prefiller_queue=100_000).disaggregate
    beyond = model(itl_slo=0.25, ttft_slo=1.0, ttft_slo_max_tokens=2000)
    assert beyond.effective_threshold("d", "p", 4, 100_000) == pytest.approx(2450, rel=0.01)


def finished_streams(m: AdaptiveModel, decoder: str, streams: int, tokens: int) -> None:
    """`streams` finished streamed requests on `decoder`, `tokens` output tokens (chunks) each; their
    prompts unknown, so they teach only the gaps."""
    for _ in range(streams):
        m.learn_from(trace(path="disaggregated", decoder=decoder, token_chunks=tokens))


def test_the_itl_budget_lets_late_pauses_through_up_to_its_share_of_the_decoders_gaps() -> None:
    # The case of the itl_slo test above: a 6k prompt (0.6 s) would pause 4 streams behind a 10 s
    # prefill queue. With a 1% share and no gaps seen yet there is no budget: the hop.
    m = model(itl_slo=0.25, itl_slo_share=0.01)
    for decoder in ("d", "d2"):
        m.gap_budget(decoder).clock = lambda: 0.0  # no time passes here: a slow machine fades nothing
    assert m.estimate("d", "p", 6000, running_streams=4, prefiller_queue=100_000).reason == "itl_slo"
    assert m.gap_budget("d").spent == 0  # a prompt sent to the hop pauses nothing
    # 10 finished streams of 102 tokens: 1010 gaps, room for 10 late ones, two prompts of 4 pauses each.
    finished_streams(m, "d", streams=10, tokens=102)
    first = m.estimate("d", "p", 6000, running_streams=4, prefiller_queue=100_000)
    second = m.estimate("d", "p", 6000, running_streams=4, prefiller_queue=100_000)
    assert [(e.disaggregate, e.reason) for e in (first, second)] == [(False, "adaptive_cheaper_direct")] * 2
    assert m.gap_budget("d").spent == pytest.approx(8, rel=1e-3)
    spent = m.estimate("d", "p", 6000, running_streams=4, prefiller_queue=100_000)
    assert (spent.disaggregate, spent.reason) == (True, "itl_slo")
    # Two late pauses still fit: a prompt meeting a decoder with 2 streams goes direct on the model's word.
    assert m.estimate("d", "p", 6000, running_streams=2, prefiller_queue=100_000).reason == "adaptive_cheaper_direct"
    # Another decoder's gaps are its own; pauses within the SLO spend nothing.
    assert m.estimate("d2", "p", 6000, running_streams=4, prefiller_queue=100_000).reason == "itl_slo"
    m.estimate("d", "p", 2000, running_streams=4, prefiller_queue=100_000)
    assert m.gap_budget("d").spent == pytest.approx(10, rel=1e-3)
    assert m.describe()["itl_budget"]["d"]["late_share"] == pytest.approx(10 / 1010, rel=1e-3)  # type: ignore[index]
    assert ("itl_budget", "d", "late_gaps", pytest.approx(10, rel=1e-3)) in m.cost_rows()


def test_without_a_share_the_itl_slo_spends_no_budget_but_counts_the_late_pauses_it_could_not_avoid() -> None:
    m = model(itl_slo=0.25, ttft_slo=1.0)
    finished_streams(m, "d", streams=10, tokens=101)
    # Behind a 10 s queue the hop misses the TTFT SLO and the model keeps the 5k prompt direct: 4 late gaps.
    neither = m.estimate("d", "p", 5000, running_streams=4, prefiller_queue=100_000)
    assert (neither.disaggregate, neither.reason) == (False, "adaptive_cheaper_direct")
    assert m.gap_budget("d").share == pytest.approx(0.004, rel=1e-3)
    # With the hop on time, the ITL SLO still sends it there: no share, no room.
    assert m.estimate("d", "p", 5000, running_streams=4, prefiller_queue=0).reason == "itl_slo"


def test_the_itl_budget_fades_with_time_and_the_effective_threshold_follows_it() -> None:
    now = [0.0]
    budget = GapBudget(half_life_seconds=30.0, clock=lambda: now[0])
    budget.count_gaps(1000)
    budget.spend(10)
    now[0] = 30.0
    assert (budget.gaps, budget.spent) == (500.0, 5.0)
    assert budget.share == pytest.approx(0.01)
    assert budget.allows(5, 0.02) and not budget.allows(6, 0.02) and not budget.allows(1, 0.0)
    # The effective threshold: capped by the ITL SLO while the budget has no room for the pause...
    m = model(itl_slo=0.25, itl_slo_share=0.01)
    plain = model().effective_threshold("d", "p", running_streams=4, prefiller_queue=100_000)
    assert m.effective_threshold("d", "p", running_streams=4, prefiller_queue=100_000) == pytest.approx(2450, rel=0.01)
    # ...the model's own where it has room.
    finished_streams(m, "d", streams=10, tokens=101)
    assert m.effective_threshold("d", "p", running_streams=4, prefiller_queue=100_000) == pytest.approx(plain)
    assert m.effective_threshold("d", "p", running_streams=20, prefiller_queue=100_000) < 2500


def test_exploration_only_ever_sends_prompts_to_the_prefill_pool() -> None:
    m = AdaptiveModel(
        AdaptivePolicy(explore_share=0.2, min_threshold=16, max_threshold=10**6),
        routing_threshold=4096,
        rng=random.Random(9).random,
    )
    hops_on_the_prior(m, "p")
    # Just above the boundary the model disaggregates: exploration never keeps such a prompt direct.
    above = [m.estimate("d", "p", 4300, running_streams=1, prefiller_queue=0) for _ in range(2000)]
    assert all(e.disaggregate and e.reason == "adaptive_interference" for e in above)
    # Just below it, a share goes to the prefill pool, marked as exploration.
    below = [m.estimate("d", "p", 3900, running_streams=1, prefiller_queue=0) for _ in range(2000)]
    explored = [e for e in below if e.reason == "explore"]
    assert explored and all(e.disaggregate for e in explored)
    assert 0.15 < len(explored) / len(below) < 0.25


def test_until_its_hop_is_learned_a_prefiller_is_explored_more_and_then_a_few_percent() -> None:
    m = AdaptiveModel(
        AdaptivePolicy(explore_share=0.03, min_threshold=16, max_threshold=10**6),
        routing_threshold=4096,
        rng=random.Random(3).random,
    )
    near = [m.estimate("d", "p", 3900, running_streams=1, prefiller_queue=0) for _ in range(2000)]
    assert 0.2 < sum(e.reason == "explore" for e in near) / len(near) < 0.3
    # Never far from the boundary, even unlearned: an idle decoder keeps its prompts.
    assert not any(m.estimate("d", "p", 3900, running_streams=0, prefiller_queue=0).disaggregate for _ in range(500))
    hops_on_the_prior(m, "p", LEARNED_HOPS - 1)
    assert not m.hop_learned("p")
    hops_on_the_prior(m, "p", 1)
    assert m.hop_learned("p")
    near = [m.estimate("d", "p", 3900, running_streams=1, prefiller_queue=0) for _ in range(4000)]
    assert 0.015 < sum(e.reason == "explore" for e in near) / len(near) < 0.045
    off = model(explore_share=0.0)  # 0 still means no exploration, learned or not
    assert not any(off.estimate("d", "p", 3900, running_streams=1, prefiller_queue=0).disaggregate for _ in range(500))


def test_a_router_started_high_does_not_call_an_unlearned_hop_late_on_its_prior() -> None:
    # Started at 32768, the prior prices the hop at about 3.7 s for a 4k prompt: late for a 2 s TTFT SLO
    # on the prior's word alone. The SLOs judge an unlearned hop by the neutral prior instead, so the ITL
    # SLO sends the prompt (a 0.4 s pause of 7 streams) to the hop, and the hop gets measured.
    policy = AdaptivePolicy(explore_share=0.0, ttft_slo=2.0, itl_slo=0.25, min_threshold=16, max_threshold=10**6)
    m = AdaptiveModel(policy, routing_threshold=32768)
    assert m.hop_cost("p").predict(4096) > 3.5
    first = m.estimate("d", "p", 4096, running_streams=7, prefiller_queue=0)
    assert first.disaggregate and first.reason == "itl_slo"
    assert m.effective_threshold("d", "p", running_streams=7, prefiller_queue=0) < 4096
    # A learned hop that is really late is judged late: neither path meets both SLOs, the model decides.
    for i in range(LEARNED_HOPS):
        m.learn_prefill("p", 2000 + 300 * i, 2.5 + 0.0001 * (2000 + 300 * i))
    assert m.hop_learned("p")
    late = m.estimate("d", "p", 4096, running_streams=7, prefiller_queue=0)
    assert late.hop > 2.0 and late.reason == "adaptive_interference"


def test_the_slos_judge_the_hop_by_what_it_measured_not_by_the_fading_threshold_prior() -> None:
    # Started at 32768 with a 1 s TTFT SLO on every prompt: the hops take 0.37 s for a 4k prompt, most behind
    # a queue. The model's own line still carries the 3.3 s prior after 8 calls; the SLOs' line does not,
    # so the prompt keeps taking the hop on the ITL SLO after the eighth call as before it.
    policy = AdaptivePolicy(explore_share=0.0, ttft_slo=1.0, itl_slo=0.25, min_threshold=16, max_threshold=10**6)
    m = AdaptiveModel(policy, routing_threshold=32768)
    for i in range(3 * LEARNED_HOPS):
        queued = 1500.0 * (i % 9)
        m.learn_prefill("p", 4096, 0.005 + 0.00009 * (queued + 4096), queued_tokens=queued)
        m.learn_handoff(4096, 0.02)
        decision = m.estimate("d", "p", 4096, running_streams=2, prefiller_queue=0)
        assert decision.disaggregate and decision.reason == "itl_slo", f"after {i + 1} calls: {decision}"
    assert m.slo_hop_cost("p").predict(4096) == pytest.approx(0.005 + 0.00009 * 4096, rel=0.25)


def test_two_routers_started_from_opposite_thresholds_learn_the_same_decision() -> None:
    low, high = (AdaptiveModel(AdaptivePolicy(explore_share=0.0), routing_threshold=t) for t in (512, 32768))
    assert high.effective_threshold("d", "p", 8, 0) > 4 * low.effective_threshold("d", "p", 8, 0)
    rng = random.Random(5)
    for _ in range(60):  # a busy prefiller: every call waited behind 10k-100k queued tokens
        tokens, queued = rng.randint(4000, 16000), rng.randint(10_000, 100_000)
        seconds = 0.004 + (queued + tokens) / 12000
        for m in (low, high):
            m.learn_prefill("p", tokens, seconds, queued_tokens=queued)
            m.learn_handoff(tokens, 0.01 + tokens * 2.6e-6)
    # The prior's fixed cost (routing_threshold tokens' worth) is gone, though no call ran on an empty queue.
    for m in (low, high):
        assert m.hop_cost("p").overhead < 0.05
    for load in (2, 8):
        assert high.effective_threshold("d", "p", load, 0) == pytest.approx(
            low.effective_threshold("d", "p", load, 0), rel=0.1
        )


def test_a_router_started_at_a_huge_threshold_learns_the_hop_from_a_prefiller_seldom_idle() -> None:
    m = AdaptiveModel(AdaptivePolicy(explore_share=0.0), routing_threshold=32768)  # prior: a 3.3 s hop
    rng = random.Random(5)
    per_token = 1 / 12000
    for i in range(40):
        tokens = rng.randint(4096, 16384)
        if i % 5 == 4:  # one call in five finds the prefiller idle
            m.learn_from(hop_trace(tokens, 0, 0.01 + per_token * tokens))
        else:
            queued = rng.randint(5000, 60_000)
            m.learn_from(hop_trace(tokens, queued, 0.01 + per_token * (queued - rng.uniform(0, 8192) + tokens)))
    hop = m.hop_cost("p")
    assert hop.idle_observations == 8
    assert hop.overhead < 0.1
    assert hop.per_token == pytest.approx(per_token, rel=0.1)


def test_prompts_queued_for_the_decoders_prefill_make_the_direct_path_wait() -> None:
    """Both paths' first tokens count their queues: a burst of direct prompts is a queue on the decoder."""
    m = model()
    idle = m.estimate("d", "p", 3000, running_streams=1, prefiller_queue=0)
    behind = m.estimate("d", "p", 3000, running_streams=1, prefiller_queue=0, decoder_queue=20_000)
    assert not idle.disaggregate
    assert behind.disaggregate and behind.reason == "adaptive_interference"
    # The direct path's first token waits for the queued prompts' prefill, at the decoder's speed.
    assert idle.extra_cost - behind.extra_cost == pytest.approx(20_000 * m.direct_cost("d").per_token)
    assert m.effective_threshold("d", "p", 1, 0, decoder_queue=20_000) < m.effective_threshold("d", "p", 1, 0)


def test_the_direct_wait_learns_only_what_the_queued_prefills_do_not_explain() -> None:
    m = model()
    d = m.direct_cost("d")

    def direct(queued: int, beyond_the_queue: float) -> Outcome:
        """A direct request on a busy decoder: `queued` prompt tokens were ahead of it when it was planned."""
        first = d.predict(1000) + d.per_token * queued + beyond_the_queue
        return trace(
            path="direct", decoder="d", uncached_tokens=1000, decoder_streams=4, decoder_queue=queued, first_token=first
        )

    # Every direct request waited exactly for the prompts queued ahead of it and its own prefill.
    for queued in range(0, 40_000, 2000):
        m.learn_from(direct(queued, 0.0))
    assert m.direct_wait("d").mean == pytest.approx(0.0, abs=1e-9)
    # Waiting longer than that (decode steps, prompts the router cannot see) is the wait.
    for _ in range(200):
        m.learn_from(direct(8000, 0.3))
    assert m.direct_wait("d").mean == pytest.approx(0.3, rel=0.01)


def test_admin_routing_names_the_prefillers_still_explored_more() -> None:
    from dpd_router.api.admin import _unlearned_summary
    from dpd_router.config import Settings

    m = model(explore_share=0.03)
    hops_on_the_prior(m, "http://p2", LEARNED_HOPS)
    hops_on_the_prior(m, "http://p1", 3)
    exploring = Settings(decode_urls=["http://d"], threshold_mode="adaptive", explore_share=0.03)
    assert _unlearned_summary(m, ["http://p1", "http://p2", "http://p1"], exploring) == [
        "Prefiller http://p1 has served 3 of 8 prefill calls: until then exploration sends it at least 25% of "
        "the prompts near the boundary that the model would keep direct."
    ]
    quiet = Settings(decode_urls=["http://d"], threshold_mode="adaptive", explore_share=0.0)
    assert _unlearned_summary(m, ["http://p1"], quiet) == []
