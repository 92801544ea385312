"""Fail over instead of waiting: hung engines are left at learned deadlines, a recovering pool takes a burst."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, chat_body, cluster_settings, engine_stats, metric, running_router
from tests.integration.test_reliability import LONG, SHORT, SLOW_DECODE, THRESHOLD, sse_events, wait_until

# Hang guard of each request once engines hang: far below the timeouts the settings give them, so a
# request still waiting for a timeout fails the test.
HANG_GUARD = 15.0
# Learned deadlines from a few hops, with a short floor, so a test learns them in a handful of requests.
LEARN_FAST = {"hop_deadline_samples": 4, "hop_deadline_floor": 0.5}


def served(answer: httpx.Response) -> bool:
    """A 200 whose content is an answer, not an error (in-band for streams)."""
    if answer.status_code != 200 or b'"error"' in answer.content:
        return False
    if answer.headers["content-type"].startswith("text/event-stream"):
        return sse_events(answer.content)[-1] == b"data: [DONE]"
    return bool(answer.json()["choices"][0]["message"]["content"])


async def test_hung_prefillers_are_left_at_their_learned_deadline_for_the_decoder_alone(tokenizer_dir: Path) -> None:
    """Both prefillers hang: with prefill_timeout 30 s, a request would wait 2 x 30 s; prefills of its
    size took milliseconds, so each hop is abandoned at the learned deadline and the decoder serves."""
    async with (
        SimCluster(in_process=True, prefill=2, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            **cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, prefill_timeout=30, **LEARN_FAST)
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
    ):
        for i in range(6):
            learned = await client.post("/v1/chat/completions", json=chat_body(f"{i} {LONG}"))
            assert served(learned)
        assert await metric(base_url, "dpd_router_route_decisions_total", {"path": "disaggregated"}) == 6
        for prefiller in cluster.prefill_urls:
            await client.post(f"{prefiller}/sim/fault", json={"mode": "hang"})

        for stream in (False, True):
            async with asyncio.timeout(HANG_GUARD):
                answer = await client.post("/v1/chat/completions", json=chat_body(f"hung {LONG}", stream=stream))
            assert served(answer), answer.text
        # Each request tried both prefillers (one retry), then the decoder alone.
        assert await metric(base_url, "dpd_router_prefill_fallbacks_total", {"reason": "slow"}) == 2
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "prefill"}) == 2
        assert (await engine_stats(cluster.decode_urls[0]))["local_prefills"] == 2


async def test_a_hung_decoder_is_replaced_before_the_first_byte(tokenizer_dir: Path) -> None:
    """One of two decoders hangs: streams (first_token_timeout 30 s) and whole answers (request_timeout
    30 s) sent to it are moved to the other at the learned deadline, none answered 504."""
    timeouts = {"first_token_timeout": 30, "request_timeout": 30}
    async with (
        SimCluster(in_process=True, prefill=0, decode=2, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            **cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, **timeouts, **LEARN_FAST)
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
    ):
        for i in range(6):
            for stream in (False, True):
                learned = await client.post("/v1/chat/completions", json=chat_body(f"{i} {SHORT}", stream=stream))
                assert served(learned)
        hung = cluster.decode_urls[0]
        seen_before = (await engine_stats(hung))["requests_total"]
        await client.post(f"{hung}/sim/fault", json={"mode": "hang"})

        async def one(i: int) -> httpx.Response:
            async with asyncio.timeout(HANG_GUARD):
                return await client.post("/v1/chat/completions", json=chat_body(f"hung {i} {SHORT}", stream=i % 2 == 1))

        answers = await asyncio.gather(*(one(i) for i in range(6)))
        assert all(served(answer) for answer in answers), [answer.text for answer in answers]
        assert (await engine_stats(hung))["requests_total"] > seen_before, "some went to the hung decoder"
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "decode"}) >= 1


async def test_a_burst_while_every_decoder_recovers_is_served_not_refused(tokenizer_dir: Path) -> None:
    """Both decoders' breakers opened (each hung once), and both are fine again: once half-open, a
    burst of 24 is served whole, not refused but for the one trial each breaker lets through."""
    async with (
        SimCluster(
            in_process=True, prefill=0, decode=2, tokenizer=tokenizer_dir, model=MODEL, extra_args=SLOW_DECODE
        ) as cluster,
        running_router(
            **cluster_settings(
                cluster,
                tokenizer_dir,
                threshold=THRESHOLD,
                breaker_failures=1,
                breaker_cooldown=1,
                first_token_timeout=1,
            )
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
    ):
        for decoder in cluster.decode_urls:
            await client.post(f"{decoder}/sim/fault", json={"mode": "hang", "count": 1})
        for i in range(2):  # the first hangs on one decoder and opens its breaker, the second the other's
            timed_out = await client.post("/v1/chat/completions", json=chat_body(f"{i} {SHORT}", stream=True))
            assert timed_out.status_code == 504
        assert await metric(base_url, "dpd_router_endpoint_circuit_opened") == 2

        async def both_half_open() -> bool:
            return await metric(base_url, "dpd_router_endpoint_circuit_open") == 0

        await wait_until(both_half_open)
        # Whole answers of 40 tokens: a trial lasts until its answer is complete.
        burst = await asyncio.gather(
            *(
                client.post("/v1/chat/completions", json=chat_body(f"burst {i} {SHORT}", max_tokens=40))
                for i in range(24)
            )
        )
        assert [answer.status_code for answer in burst] == [200] * 24
        assert all(served(answer) for answer in burst)


# Before any history: the first look at a hop comes from its size (a few seconds), and an engine
# that produced nothing meanwhile gets this long to answer a one-token probe.
PROBE = {"hang_probe_timeout": 1.0}
# Far below every timeout the default settings give (120 s a prefill or first token, 600 s an
# answer), far above a look and a probe per engine.
COLD_GUARD = 30.0


async def test_from_a_cold_start_hung_prefillers_cost_seconds_not_their_timeouts(tokenizer_dir: Path) -> None:
    """Just started, both prefillers hung: with nothing learned, each prefill hop is looked at after
    a prior from its size, the prefiller asked for one token and, silent, taken for hung: the decoder
    serves in seconds (it was 2 x prefill_timeout), and their breakers open."""
    async with (
        SimCluster(in_process=True, prefill=2, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, **PROBE)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=COLD_GUARD * 2) as client,
    ):
        for prefiller in cluster.prefill_urls:
            await client.post(f"{prefiller}/sim/fault", json={"mode": "hang"})
        async with asyncio.timeout(COLD_GUARD):
            answer = await client.post("/v1/chat/completions", json=chat_body(f"cold {LONG}"))
        assert served(answer), answer.text
        assert await metric(base_url, "dpd_router_prefill_fallbacks_total", {"reason": "hung"}) == 1
        assert await metric(base_url, "dpd_router_endpoint_circuit_opened") == 2
        for prefiller in cluster.prefill_urls:
            # Each got the prefill and one probe, both left unanswered.
            assert (await engine_stats(prefiller))["requests_total"] == 2

        async with asyncio.timeout(COLD_GUARD):
            answer = await client.post("/v1/chat/completions", json=chat_body(f"next {LONG}", stream=True))
        assert served(answer), answer.text


async def test_from_a_cold_start_every_decoder_hung_is_told_in_seconds(tokenizer_dir: Path) -> None:
    """Just started, both decoders hung: a whole answer (request_timeout 600 s) and a stream
    (first_token_timeout 120 s) each learn within seconds that no decoder answers, from the looks
    and probes; the decoders' breakers are open then."""
    async with (
        SimCluster(in_process=True, prefill=0, decode=2, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, **PROBE)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=COLD_GUARD * 2) as client,
    ):
        for decoder in cluster.decode_urls:
            await client.post(f"{decoder}/sim/fault", json={"mode": "hang"})
        async with asyncio.timeout(COLD_GUARD):
            whole = await client.post("/v1/chat/completions", json=chat_body(f"whole {SHORT}", max_tokens=500))
        assert whole.status_code == 502, whole.text
        assert "is hung" in whole.json()["error"]["message"]
        assert await metric(base_url, "dpd_router_endpoint_circuit_opened") == 2
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "decode"}) == 1

        async with asyncio.timeout(HANG_GUARD):
            stream = await client.post("/v1/chat/completions", json=chat_body(f"stream {SHORT}", stream=True))
        assert stream.status_code in (502, 503, 504), stream.text
        assert not served(stream)


async def test_a_burst_on_busy_decoders_waits_its_turn_instead_of_failing_over(tokenizer_dir: Path) -> None:
    """Decoders that run four streams at a time: a burst of 32 queues behind them, its first tokens
    far past the learned deadline (first tokens took one step when they were idle). Their running
    streams move all along, so the decoders are busy, not hung: every stream is served where it was
    sent, none retried."""
    busy = ["--max-batch-size", "4", "--decode-step-base", "0.03"]
    async with (
        SimCluster(
            in_process=True, prefill=0, decode=2, tokenizer=tokenizer_dir, model=MODEL, extra_args=busy
        ) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, **LEARN_FAST)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
    ):
        for i in range(6):
            learned = await client.post("/v1/chat/completions", json=chat_body(f"{i} {SHORT}", stream=True))
            assert served(learned)
        burst = await asyncio.gather(
            *(
                client.post("/v1/chat/completions", json=chat_body(f"burst {i} {SHORT}", max_tokens=20, stream=True))
                for i in range(32)
            )
        )
        assert all(served(answer) for answer in burst), [answer.text for answer in burst if not served(answer)]
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "decode"}) == 0
        assert await metric(base_url, "dpd_router_endpoint_circuit_opened") == 0
        assert len(cluster.decode_urls) == 2
