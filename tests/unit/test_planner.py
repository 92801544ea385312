from __future__ import annotations

import pytest

from dpd_router.pool.pool import Pool
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.errors import NoHealthyDecoder
from dpd_router.routing.planner import Planner
from dpd_router.routing.strategies import LeastLoaded, RoundRobin


def prompt(tokens: int) -> Prompt:
    return Prompt(token_ids=list(range(tokens)), num_tokens=tokens, seconds=0.0)


def planner(prefillers: int = 2, decoders: int = 2, threshold: int = 100) -> Planner:
    pool = Pool(
        [f"http://127.0.0.1:81{i:02d}" for i in range(prefillers)],
        [f"http://127.0.0.1:82{i:02d}" for i in range(decoders)],
    )
    return Planner(pool, threshold=threshold, prefill=RoundRobin(), decode=LeastLoaded())


@pytest.mark.parametrize(
    ("tokens", "path", "reason"),
    [
        (1, "direct", "below_threshold"),
        (99, "direct", "below_threshold"),
        (100, "disaggregated", "long_prompt"),
    ],
)
def test_threshold_is_inclusive(tokens: int, path: str, reason: str) -> None:
    plan = planner().plan(prompt(tokens))
    assert (plan.path, plan.reason) == (path, reason)
    assert (plan.prefiller is not None) == (path == "disaggregated")


def test_no_prefillers_at_all_sends_long_prompts_direct() -> None:
    plan = planner(prefillers=0).plan(prompt(500))
    assert (plan.path, plan.reason) == ("direct", "prefill_pool_down")


def test_unhealthy_prefill_pool_sends_long_prompts_direct() -> None:
    p = planner()
    for endpoint in p.pool.prefillers:
        endpoint.healthy = False
    assert p.plan(prompt(500)).reason == "prefill_pool_down"


def test_batched_long_prompt_goes_direct() -> None:
    assert planner().plan(prompt(500), batch_size=3).reason == "batched_prompt"


def test_prefillers_take_turns_and_skip_unhealthy_ones() -> None:
    p = planner(prefillers=3)
    chosen = [p.plan(prompt(500)).prefiller for _ in range(6)]
    assert [e.url for e in chosen if e] == [e.url for e in p.pool.prefillers] * 2
    p.pool.prefillers[1].healthy = False
    urls = {p.plan(prompt(500)).prefiller.url for _ in range(6)}  # type: ignore[union-attr]
    assert urls == {p.pool.prefillers[0].url, p.pool.prefillers[2].url}


def test_decoder_with_fewest_in_flight_wins() -> None:
    p = planner(decoders=3)
    busy, idle, busier = p.pool.decoders
    busy.in_flight, idle.in_flight, busier.in_flight = 3, 1, 5
    assert p.plan(prompt(5)).decoder is idle


def test_unhealthy_decoders_are_never_chosen_and_none_left_is_an_error() -> None:
    p = planner(decoders=2)
    p.pool.decoders[0].healthy = False
    assert all(p.plan(prompt(5)).decoder is p.pool.decoders[1] for _ in range(4))
    p.pool.decoders[1].healthy = False
    with pytest.raises(NoHealthyDecoder):
        p.plan(prompt(5))
