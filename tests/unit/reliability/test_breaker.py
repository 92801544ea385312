from __future__ import annotations

from dpd_router.pool.breaker import CLOSED, HALF_OPEN, OPEN, BreakerPolicy, CircuitBreaker
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock) -> CircuitBreaker:
    return CircuitBreaker(BreakerPolicy(failures=3, cooldown=5.0, max_cooldown=12.0), clock=clock)


def test_consecutive_failures_open_it_and_a_success_in_between_resets_the_count() -> None:
    clock = Clock()
    b = breaker(clock)
    b.on_failure()
    b.on_failure()
    b.on_success()
    b.on_failure()
    b.on_failure()
    assert b.state == CLOSED and b.allows()
    assert b.on_failure() is True
    assert b.state == OPEN and not b.allows()


def test_after_the_cooldown_one_trial_goes_through_and_its_success_closes_it() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.on_failure()
    clock.now += 5.0
    assert b.state == HALF_OPEN and b.allows()
    b.on_start()
    assert not b.allows(), "only one trial at a time"
    b.on_success()
    assert b.state == CLOSED and b.allows()


def test_a_failed_trial_reopens_it_for_longer_up_to_the_cap() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.on_failure()
    cooldowns = []
    for _ in range(3):
        clock.now += b.cooldown
        b.on_start()
        assert b.on_failure() is True
        cooldowns.append(b.cooldown)
    assert cooldowns == [10.0, 12.0, 12.0]
    assert b.times_opened == 4


def test_a_trial_that_never_reports_back_expires() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.on_failure()
    clock.now += 5.0
    b.on_start()
    assert not b.allows()
    clock.now += 5.0
    assert b.allows()


def test_endpoint_is_available_only_when_probes_pass_and_breaker_allows() -> None:
    endpoint = Endpoint("http://127.0.0.1:1", "decode", breaker=CircuitBreaker(BreakerPolicy(failures=1)))
    assert endpoint.available and endpoint.state == "healthy"
    endpoint.record_failure("boom")
    assert not endpoint.available and endpoint.state == "open"
    endpoint.record_success()
    assert endpoint.available
    assert endpoint.record_probe(False, "down", unhealthy_after=2, healthy_after=2) is False
    assert endpoint.record_probe(False, "down", unhealthy_after=2, healthy_after=2) is True
    assert endpoint.state == "unhealthy" and not endpoint.available
    endpoint.record_probe(True, None, unhealthy_after=2, healthy_after=2)
    assert not endpoint.available, "needs two passing probes"
    endpoint.record_probe(True, None, unhealthy_after=2, healthy_after=2)
    assert endpoint.available


def test_with_every_decoder_on_trial_the_recovering_ones_take_calls_else_only_healthy_ones_do() -> None:
    clock = Clock()
    pool = Pool([], ["http://d1", "http://d2"], breaker=BreakerPolicy(failures=1, cooldown=5.0))
    first, second = pool.decoders
    for endpoint in (first, second):
        endpoint.breaker.clock = clock
        endpoint.record_failure("timeout")
    clock.now += 5.0
    first.start()
    second.start()  # each breaker's one trial is running
    assert pool.healthy("decode") == []
    assert pool.recovering("decode") == [first, second]
    first.finish()
    first.record_success()
    assert pool.healthy("decode") == [first]
    assert pool.recovering("decode") == [second], "the planner asks for these only when none is healthy"
