from __future__ import annotations

import random
import statistics

import pytest

from dpd_router.gateway.deadlines import CostBound, DeadlinePolicy, HopDeadlines

POLICY = DeadlinePolicy(factor=4.0, floor=0.5, samples=3)


def test_a_hop_the_size_of_those_seen_is_expected_to_take_their_median_time() -> None:
    bound = CostBound()
    for seconds in (0.10, 0.12, 9.0):  # one odd hop does not move the median
        bound.learn((1000,), seconds)
    assert bound.expected((1000,)) == pytest.approx(0.12)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((100,), 0.2),  # a smaller hop is not expected to be faster than those seen: errs long
        ((2000,), 0.4),  # twice the tokens, twice the time
    ],
)
def test_a_hop_is_scaled_from_those_seen_by_its_size(size: tuple[int], expected: float) -> None:
    bound = CostBound()
    bound.learn((1000,), 0.2)
    assert bound.expected(size) == pytest.approx(expected)


def test_a_whole_answer_scales_by_its_largest_dimension_prompt_or_output() -> None:
    bound = CostBound()
    bound.learn((100, 10), 1.0)
    assert bound.expected((100, 1000)) == pytest.approx(100.0), "a hundred times the output"
    assert bound.expected((400, 10)) == pytest.approx(4.0)


def test_no_deadline_until_enough_hops_are_learned_nor_when_it_would_exceed_the_timeout() -> None:
    deadlines = HopDeadlines()
    for _ in range(2):
        deadlines.learn("prefill", (1000,), 0.2)
    assert deadlines.deadline("prefill", (1000,), POLICY, cap=120.0) is None
    deadlines.learn("prefill", (1000,), 0.2)
    assert deadlines.deadline("prefill", (1000,), POLICY, cap=120.0) == pytest.approx(0.8)
    assert deadlines.deadline("prefill", (1000,), POLICY, cap=0.5) is None, "the timeout, shorter, applies"
    assert deadlines.deadline("prefill", (10,), POLICY, cap=120.0) == pytest.approx(0.8)
    off = DeadlinePolicy(factor=0.0, floor=0.5, samples=3)
    assert deadlines.deadline("prefill", (1000,), off, cap=120.0) is None


def test_the_floor_holds_and_decode_calls_with_and_without_kv_are_learned_apart() -> None:
    deadlines = HopDeadlines()
    for _ in range(3):
        deadlines.learn("first_token", (1000,), 0.01, with_kv=True)
    assert deadlines.deadline("first_token", (1000,), POLICY, cap=120.0, with_kv=True) == pytest.approx(0.5)
    assert deadlines.deadline("first_token", (1000,), POLICY, cap=120.0) is None, "a prompt computed is slower"


@pytest.mark.parametrize("dimensions", [1, 2, 3])
def test_the_expected_time_is_the_median_of_every_seen_hops_scaled_bound(dimensions: int) -> None:
    """Each arity's fast path against the definition, over random windows and sizes."""
    rng = random.Random(dimensions)
    for _ in range(200):
        bound = CostBound(window=rng.randint(1, 64))
        seen = [(tuple(rng.randint(0, 5000) for _ in range(dimensions)), rng.random() * 3) for _ in range(80)]
        for size, seconds in seen:
            bound.learn(size, seconds)
        size = tuple(rng.randint(0, 8000) for _ in range(dimensions))
        kept = seen[-len(bound) :]
        scaled = [
            seconds * max([1.0] + [max(want, 1) / max(have, 1) for want, have in zip(size, sizes, strict=True)])
            for sizes, seconds in kept
        ]
        assert bound.expected(size) == pytest.approx(statistics.median(scaled), rel=1e-12)


def test_a_deadline_worked_out_later_is_the_one_its_hop_had_when_it_started() -> None:
    """Worked out at the hop's first look, from the hops learned when it started: hops learned meanwhile (a
    burst of slow ones) do not move it."""
    deadlines = HopDeadlines()
    for seconds in (0.2, 0.3, 0.25):
        deadlines.learn("prefill", (1000,), seconds)
    at_start = deadlines.deadline("prefill", (1500,), POLICY, cap=120.0)
    later = deadlines.deadline_later("prefill", (1500,), POLICY, cap=120.0)
    for _ in range(10):
        deadlines.learn("prefill", (1000,), 5.0)
    assert later is not None and later() == at_start == pytest.approx(4 * 0.25 * 1.5)
    assert deadlines.deadline("prefill", (1500,), POLICY, cap=120.0) == pytest.approx(4 * 5.0 * 1.5)
    capped = deadlines.deadline_later("prefill", (1500,), POLICY, cap=1.0)
    assert capped is not None and capped() is None, "the cap is judged when it is worked out"
    assert HopDeadlines().deadline_later("prefill", (1500,), POLICY, cap=120.0) is None, "nothing learned"
