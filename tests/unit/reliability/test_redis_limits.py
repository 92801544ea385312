"""The shared limits store's Lua token bucket, run by a real redis-server, against the in-process bucket."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis.asyncio as aioredis

from dpd_router.api.limits import TokenBucket
from dpd_router.api.redis_limits import KEY_PREFIX, RedisBuckets
from dpd_router.record.metrics import RouterMetrics
from tests.redis_server import RedisServer

# The bucket tests judge the store's answers, not its speed: on a loaded machine (the suite's workers share two
# cores) connecting and loading the script can take longer than the router's own 0.1 s, which is a fallback to
# the local buckets there, not an answer.
ANSWERS_WITHIN = 5.0


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def errors(metrics: RouterMetrics) -> float:
    return metrics.registry.get_sample_value("dpd_router_limits_store_errors_total") or 0.0


async def test_a_minute_of_burst_then_refill_by_the_time_passed(redis: RedisServer) -> None:
    store = RedisBuckets(redis.url, RouterMetrics(), timeout=ANSWERS_WITHIN)
    try:
        for _ in range(60):
            assert await store.take("k:requests", 60, 1, now=1000.0) == 0
        assert await store.take("k:requests", 60, 1, now=1000.0) == pytest.approx(1.0)
        assert await store.take("k:requests", 60, 2, now=1001.5) == pytest.approx(0.5)  # 1.5 refilled, 2 asked
        assert await store.take("k:requests", 60, 2, now=1002.0) == 0
        assert await store.take("other:requests", 60, 60, now=1002.0) == 0  # each key its own bucket
    finally:
        await store.aclose()


async def test_an_amount_larger_than_the_bucket_needs_a_full_one_and_leaves_it_in_debt(redis: RedisServer) -> None:
    store = RedisBuckets(redis.url, RouterMetrics(), timeout=ANSWERS_WITHIN)
    try:
        assert await store.take("k:prompt_tokens", 100, 150, now=0.0) == 0
        assert await store.take("k:prompt_tokens", 100, 150, now=0.0) == pytest.approx(90.0)  # from -50 to 100
        assert await store.take("k:prompt_tokens", 100, 150, now=90.0) == 0
    finally:
        await store.aclose()


async def test_the_script_answers_as_the_in_process_bucket_does(redis: RedisServer) -> None:
    clock = Clock(0.0)
    local = TokenBucket(30, clock=clock)
    store = RedisBuckets(redis.url, RouterMetrics(), timeout=ANSWERS_WITHIN)
    steps = [(0.0, 10), (0.0, 25), (1.0, 5), (7.5, 3), (0.2, 40), (60.0, 40), (0.0, 1), (13.0, 12), (0.0, 30)]
    try:
        for elapsed, amount in steps:
            clock.now += elapsed
            assert await store.take("k:requests", 30, amount, now=clock.now) == pytest.approx(local.take(amount))
    finally:
        await store.aclose()


async def test_a_bucket_is_forgotten_once_it_would_be_full_again(redis: RedisServer) -> None:
    store = RedisBuckets(redis.url, RouterMetrics(), timeout=ANSWERS_WITHIN)
    client = aioredis.Redis.from_url(redis.url)
    try:
        assert await store.take("k:requests", 6, 3, now=0.0) == 0
        ttl = await client.pttl(KEY_PREFIX + "k:requests")
        assert 30_000 < ttl <= 31_000  # 3 of 6 a minute refill in 30 s, plus a second's margin
    finally:
        await client.aclose()
        await store.aclose()


async def test_without_a_time_passed_the_servers_clock_is_used(redis: RedisServer) -> None:
    store = RedisBuckets(redis.url, RouterMetrics(), timeout=ANSWERS_WITHIN)
    try:
        assert await store.take("k:requests", 1, 1) == 0
        assert await store.take("k:requests", 1, 1) == pytest.approx(60.0, abs=0.5)
    finally:
        await store.aclose()


async def test_a_store_that_is_down_is_counted_logged_once_and_left_alone_for_a_while(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    metrics = RouterMetrics()
    store = RedisBuckets(redis.url, metrics, clock=clock, retry_after=1.0)
    try:
        assert await store.take("k:requests", 60, 1) == 0
        await redis.kill()
        with caplog.at_level(logging.INFO, logger="dpd_router.limits"):
            assert await store.take("k:requests", 60, 1) is None
            assert errors(metrics) == 1
            for _ in range(5):  # within retry_after: not even tried
                assert await store.take("k:requests", 60, 1) is None
            assert errors(metrics) == 1
            clock.now += 1.0
            assert await store.take("k:requests", 60, 1) is None  # tried again, still down: counted, not logged
            assert errors(metrics) == 2
        downs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(downs) == 1 and downs[0].levelno == logging.WARNING
    finally:
        await store.aclose()


async def test_the_end_of_an_outage_is_logged_once_and_the_shared_buckets_decide_again(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    store = RedisBuckets(redis.url, RouterMetrics(), clock=clock, retry_after=1.0)
    try:
        await redis.kill()
        assert await store.take("k:requests", 1, 1) is None
        await redis.start()  # empty: the bucket starts full again
        clock.now += 1.0
        with caplog.at_level(logging.INFO, logger="dpd_router.limits"):
            assert await store.take("k:requests", 1, 1) == 0
            assert await store.take("k:requests", 1, 1) == pytest.approx(60.0, abs=0.5)
        backs = [r for r in caplog.records if "reachable again" in r.getMessage()]
        assert len(backs) == 1
    finally:
        await store.aclose()


async def test_more_checks_in_flight_than_connections_wait_for_one_instead_of_failing(redis: RedisServer) -> None:
    metrics = RouterMetrics()
    store = RedisBuckets(redis.url, metrics, max_connections=2, timeout=2.0)
    try:
        waits = await asyncio.gather(*(store.take(f"k{i % 5}:requests", 1000, 1) for i in range(50)))
        assert waits == [0] * 50 and errors(metrics) == 0
    finally:
        await store.aclose()


async def test_a_store_that_does_not_answer_is_given_up_on_within_the_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts and reads, never answers
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    metrics = RouterMetrics()
    store = RedisBuckets(f"redis://127.0.0.1:{port}/0", metrics, timeout=0.05)
    try:
        started = time.perf_counter()
        assert await store.take("k:requests", 60, 1) is None
        assert time.perf_counter() - started < 0.5
        assert errors(metrics) == 1
    finally:
        await store.aclose()
        server.close()
