from __future__ import annotations

import pytest

from dpd_router.deadlines import CostBound, DeadlinePolicy, HopDeadlines

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
