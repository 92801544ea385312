"""Faults on loopback with real engine processes: nothing lost, nothing hung, nobody let in who does not belong."""

from __future__ import annotations

import asyncio
import resource
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_router.api.auth import hash_key
from dpd_router.startup.families import build_transport
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import (
    MODEL,
    chat_body,
    cluster_settings,
    engine_stats,
    metric,
    requests_seen,
    running_router,
)

THRESHOLD = 64
LONG = "Every region reported steady growth while costs stayed flat across the whole year. " * 10
SHORT = "Hi there."
SLOW_DECODE = ["--decode-step-base", "0.01"]


async def wait_until(check: Any, *, within: float = 10.0) -> None:
    """Poll an async predicate about other processes until it holds (bounded)."""
    async with asyncio.timeout(within):
        while not await check():  # noqa: ASYNC110 - the state lives in other processes: polling is the only way
            await asyncio.sleep(0.05)


def sse_events(raw: bytes) -> list[bytes]:
    return [event for event in raw.split(b"\n\n") if event.startswith(b"data: ")]


async def test_killing_a_prefiller_mid_run_loses_no_request(tokenizer_dir: Path) -> None:
    async with (
        SimCluster(prefill=2, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            **cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, prefill_strategy="roundrobin")
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):

        async def one(i: int) -> httpx.Response:
            await asyncio.sleep(0.02 * i)
            return await client.post("/v1/chat/completions", json=chat_body(f"{i} {LONG if i % 2 else SHORT}"))

        requests = [asyncio.create_task(one(i)) for i in range(40)]
        await asyncio.sleep(0.2)
        await cluster.kill(cluster.engines[0])
        answers = await asyncio.gather(*requests)
        assert [a.status_code for a in answers] == [200] * 40
        assert all(a.json()["choices"][0]["message"]["content"] for a in answers)
        assert await metric(base_url, "dpd_router_requests_total", {"outcome": "ok", "path": "disaggregated"}) > 0


async def test_killing_a_decoder_continues_its_streams_on_the_other_and_new_requests_use_it(
    tokenizer_dir: Path,
) -> None:
    """The streams a killed decoder was serving go on from the other (tests/integration/test_stream_continuation.py
    checks their text); without continuations they end in-band (ibid.)."""
    async with (
        SimCluster(prefill=1, decode=2, tokenizer=tokenizer_dir, model=MODEL, extra_args=SLOW_DECODE) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        received: list[bytes] = [b""] * 4
        started = [asyncio.Event() for _ in range(4)]

        async def stream(i: int) -> None:
            async with client.stream(
                "POST", "/v1/chat/completions", json=chat_body(f"{i} {SHORT}", max_tokens=400, stream=True)
            ) as response:
                async for chunk in response.aiter_bytes():
                    received[i] += chunk
                    started[i].set()

        streams = [asyncio.create_task(stream(i)) for i in range(4)]
        await asyncio.gather(*(event.wait() for event in started))
        victim = cluster.engines[1]  # the first decoder
        assert (await engine_stats(victim.url))["running"] > 0, "least-loaded spreads the streams over both"
        await cluster.kill(victim)
        await asyncio.gather(*streams)

        endings = [sse_events(raw)[-2:] for raw in received]
        assert not [end for end in endings if b'"error"' in end[0]], "no stream ends in error"
        assert all(end[1] == b"data: [DONE]" for end in endings), "every stream ends with [DONE], none hangs"
        assert await metric(base_url, "dpd_router_stream_continuations_total", {"outcome": "continued"}) >= 1

        for i in range(6):
            answer = await client.post("/v1/chat/completions", json=chat_body(f"after {i}"))
            assert answer.status_code == 200


async def test_a_hanging_prefiller_times_out_and_the_decoder_serves(tokenizer_dir: Path) -> None:
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            **cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, prefill_timeout=0.5)
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        await client.post(f"{cluster.prefill_urls[0]}/sim/fault", json={"mode": "hang"})
        answer = await client.post("/v1/chat/completions", json=chat_body(LONG))
        assert answer.status_code == 200
        assert await metric(base_url, "dpd_router_prefill_fallbacks_total", {"reason": "timeout"}) == 1
        assert (await engine_stats(cluster.decode_urls[0]))["local_prefills"] == 1


async def test_prefill_failure_policy_fail_answers_503(tokenizer_dir: Path) -> None:
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            **cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, prefill_failure_policy="fail")
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        await client.post(f"{cluster.prefill_urls[0]}/sim/fault", json={"mode": "error_500"})
        answer = await client.post("/v1/chat/completions", json=chat_body(LONG))
        assert answer.status_code == 503
        assert answer.json()["error"]["type"] == "ServiceUnavailableError"
        assert answer.headers["retry-after"]
        assert (await engine_stats(cluster.decode_urls[0]))["requests_total"] == 0


async def test_a_decoder_that_cannot_load_the_kv_computes_the_prompt_itself(tokenizer_dir: Path) -> None:
    """The decoder rejects every transferred KV (in-band, finish_reason "error"): staging it again would
    be rejected again, so the decode call is sent without kv_transfer_params, counted as ineffective."""
    async with (
        SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        await client.post(f"{cluster.decode_urls[0]}/sim/fault", json={"mode": "reject_kv"})
        for stream in (True, False):
            request_id = f"kvfail-{uuid.uuid4().hex[:8]}"
            answer = await client.post(
                "/v1/chat/completions",
                json=chat_body(LONG, stream=stream),
                headers={"X-Request-Id": request_id},
            )
            assert answer.status_code == 200, answer.text
            assert b'"error"' not in answer.content
            staged = [e["kind"] for e in await requests_seen(cluster.prefill_urls[0], request_id)]
            assert staged == ["remote_prefill"], "staged once, not again for a decoder that rejects it"
            decoded = [e["kind"] for e in await requests_seen(cluster.decode_urls[0], request_id)]
            assert decoded == ["kv_decode", "local"]
        assert await metric(base_url, "dpd_router_kv_transfer_ineffective_total") == 2
        assert await metric(base_url, "dpd_router_route_decisions_total", {"reason": "kv_rejected"}) == 2
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "decode"}) == 0
        assert await metric(base_url, "dpd_router_endpoint_circuit_opened") == 0


class RefusesFirstConnects(httpx.AsyncBaseTransport):
    """The router's transport, except that the first `count` completion calls to `url` cannot connect."""

    def __init__(self, inner: httpx.AsyncBaseTransport, url: str, count: int) -> None:
        self.inner, self.url, self.left = inner, url, count

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if str(request.url).startswith(self.url) and request.url.path.endswith("completions") and self.left:
            self.left -= 1
            raise httpx.ConnectError("connection refused (injected)", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("path", ["direct", "disaggregated"])
async def test_the_only_decoder_unreachable_for_a_moment_is_tried_again(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A connect failure means the decoder never saw the request: with no other decoder, resend it there."""
    async with SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster:
        decoder = cluster.decode_urls[0]

        def flaky_transport(settings: Any) -> httpx.AsyncBaseTransport:
            return RefusesFirstConnects(build_transport(settings), decoder, count=1)

        monkeypatch.setattr("dpd_router.startup.components.build_transport", flaky_transport)
        async with (
            running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
            httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        ):
            request_id = f"refused-{uuid.uuid4().hex[:8]}"
            prompt = LONG if path == "disaggregated" else SHORT
            answer = await client.post(
                "/v1/chat/completions", json=chat_body(prompt), headers={"X-Request-Id": request_id}
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
            assert len(await requests_seen(decoder, request_id)) == 1, "only the resent call reached it"
            staged = [e["kind"] for e in await requests_seen(cluster.prefill_urls[0], request_id)]
            assert staged == (["remote_prefill"] if path == "disaggregated" else []), "the staged KV was reused"
            assert await metric(base_url, "dpd_router_retries_total", {"hop": "decode"}) == 1
            assert await metric(base_url, "dpd_router_requests_total", {"outcome": "ok", "path": path}) == 1


async def test_decoders_failing_only_their_probes_still_serve_until_their_calls_fail(tokenizer_dir: Path) -> None:
    """No decoder passes /health, but one still answers: serve there (counted), not 503 for everyone."""
    async with (
        SimCluster(in_process=True, prefill=0, decode=2, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            **cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, health_unhealthy_threshold=1)
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        busy, dead = cluster.decode_urls
        await client.post(f"{busy}/sim/fault", json={"mode": "unhealthy"})
        await client.post(f"{dead}/sim/fault", json={"mode": "dead"})

        async def both_unhealthy() -> bool:
            ready = await client.get("/ready")
            return ready.status_code == 503

        await wait_until(both_unhealthy)
        # Distinct prompts: each hashes to either decoder first (prefix affinity), so the dead one gets its
        # share of first calls; 24 make fewer than the breaker's 3 failures a 1 in 50,000 chance.
        count = 24
        answers = [await client.post("/v1/chat/completions", json=chat_body(f"{i} {SHORT}")) for i in range(count)]
        # A call the dead one fails is retried on the other; after a few, its breaker keeps it out.
        assert [answer.status_code for answer in answers] == [200] * count
        assert (await engine_stats(busy))["requests_total"] == count
        assert await metric(base_url, "dpd_router_last_resort_routes_total") == count

        await client.post(f"{busy}/sim/fault", json={"mode": "dead"})
        await wait_until(lambda: _all_refused(client))


async def _all_refused(client: httpx.AsyncClient) -> bool:
    """Once both decoders fail their calls too, their breakers open and the router answers 503 at once."""
    answer = await client.post("/v1/chat/completions", json=chat_body(SHORT))
    return answer.status_code == 503 and answer.json()["error"]["type"] == "ServiceUnavailableError"


async def test_a_client_that_leaves_cancels_both_hops_and_frees_everything(tokenizer_dir: Path) -> None:
    slow = ["--decode-step-base", "0.02", "--prefill-per-token", "0.01"]
    async with (
        SimCluster(
            in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=MODEL, extra_args=slow
        ) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
    ):
        prefiller, decoder = cluster.prefill_urls[0], cluster.decode_urls[0]

        # 1. Gone during the prefill hop (it takes about 2 s here).
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            request = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(LONG, stream=True)))
            await wait_until(lambda: _running(prefiller))
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

        # 2. Gone in the middle of the decoder's stream.
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=30) as client,
            client.stream(
                "POST", "/v1/chat/completions", json=chat_body(SHORT, max_tokens=1000, stream=True)
            ) as response,
        ):
            async for _ in response.aiter_bytes():
                break
            assert (await engine_stats(decoder))["running"] == 1

        async def all_free() -> bool:
            engines_idle = not await _running(prefiller) and not await _running(decoder)
            router_idle = await metric(base_url, "dpd_router_in_flight_requests") == 0
            slots = await metric(base_url, "dpd_router_endpoint_in_flight_requests", {"endpoint": decoder})
            return engines_idle and router_idle and slots == 0

        await wait_until(all_free)
        assert await metric(base_url, "dpd_router_client_disconnects_total", {"phase": "serve"}) == 1
        assert await metric(base_url, "dpd_router_client_disconnects_total", {"phase": "stream"}) == 1
        assert await metric(base_url, "dpd_router_requests_total", {"outcome": "client_disconnect"}) == 2
        statuses = [e["status"] for e in (await engine_stats(decoder))["recent"]]
        assert "cancelled" in statuses


async def _running(url: str) -> bool:
    stats = await engine_stats(url)
    return stats["running"] + stats["waiting"] > 0


async def test_admission_refuses_beyond_capacity_with_retry_after(cluster: SimCluster, tokenizer_dir: Path) -> None:
    settings = cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, max_in_flight=1, max_queued=0)
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        async with client.stream(
            "POST", "/v1/chat/completions", json=chat_body(SHORT, max_tokens=300, stream=True)
        ) as first:
            async for _ in first.aiter_bytes():
                break
            refused = await client.post("/v1/chat/completions", json=chat_body(SHORT))
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert await metric(base_url, "dpd_router_admission_rejected_total", {"reason": "queue_full"}) == 1
        later = await client.post("/v1/chat/completions", json=chat_body(SHORT))
        assert later.status_code == 200, "the slot is free again once the stream ended"


async def test_api_keys_and_tenant_isolation(cluster: SimCluster, tokenizer_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - sha256: {hash_key('acme-key')}\n    tenant: acme\n"
        f"  - sha256: {hash_key('public-key')}\n"
        f"  - sha256: {hash_key('tiny-key')}\n    requests_per_minute: 1\n"
        f"  - sha256: {hash_key('few-tokens-key')}\n    prompt_tokens_per_minute: 50\n"
    )
    shared_p, acme_p = cluster.prefill_urls
    shared_d, acme_d = cluster.decode_urls
    settings = {
        "prefill_urls": [shared_p],
        "decode_urls": [shared_d],
        "tenants": {"acme": {"prefill_urls": [acme_p], "decode_urls": [acme_d]}},
        "api_keys_file": str(keys),
        "tokenizer": str(tokenizer_dir),
        "routing_threshold": THRESHOLD,
    }
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        assert (await client.post("/v1/chat/completions", json=chat_body(SHORT))).status_code == 401
        wrong = await client.post(
            "/v1/chat/completions", json=chat_body(SHORT), headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
        assert (await client.get("/v1/models")).status_code == 401

        seen: dict[str, set[str]] = {}
        for key in ("acme-key", "public-key"):
            for content in (LONG, SHORT):
                request_id = f"{key}-{uuid.uuid4().hex[:8]}"
                answer = await client.post(
                    "/v1/chat/completions",
                    json=chat_body(content),
                    headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id},
                )
                assert answer.status_code == 200
                for url in cluster.prefill_urls + cluster.decode_urls:
                    if await requests_seen(url, request_id):
                        seen.setdefault(key, set()).add(url)
        assert seen["acme-key"] == {acme_p, acme_d}
        assert seen["public-key"] == {shared_p, shared_d}

        tiny = {"Authorization": "Bearer tiny-key"}
        assert (await client.post("/v1/chat/completions", json=chat_body(SHORT), headers=tiny)).status_code == 200
        limited = await client.post("/v1/chat/completions", json=chat_body(SHORT), headers=tiny)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert await metric(base_url, "dpd_router_rate_limited_total", {"limit": "requests"}) == 1

        # A budget of prompt tokens is charged once the prompt is counted: a long prompt overdraws it,
        # and the next request waits until it is paid back.
        few = {"Authorization": "Bearer few-tokens-key"}
        assert (await client.post("/v1/chat/completions", json=chat_body(LONG), headers=few)).status_code == 200
        overdrawn = await client.post("/v1/chat/completions", json=chat_body(SHORT), headers=few)
        assert overdrawn.status_code == 429 and "Prompt tokens per minute" in overdrawn.json()["error"]["message"]
        assert await metric(base_url, "dpd_router_rate_limited_total", {"limit": "prompt_tokens"}) == 1


async def test_oversized_bodies_and_prompts_are_refused_before_any_engine(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    settings = cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, max_body_bytes=256 * 1024)
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        before = [(await engine_stats(url))["requests_total"] for url in cluster.decode_urls + cluster.prefill_urls]
        too_big = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 300_000})
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == 413
        too_long = await client.post("/v1/completions", json={"model": MODEL, "prompt": [7] * 33_000})
        assert too_long.status_code == 400
        assert "maximum context length" in too_long.json()["error"]["message"]
        after = [(await engine_stats(url))["requests_total"] for url in cluster.decode_urls + cluster.prefill_urls]
        assert before == after


async def test_a_thousand_concurrent_streams_complete_without_errors(tokenizer_dir: Path) -> None:
    async with (
        # Engines of their own, in processes of their own as real ones are: engines served from this
        # process's loop, beside the router and 1000 client streams on a busy machine, stall with it, and
        # an engine that answers nothing for seconds is rightly taken for hung.
        SimCluster(prefill=2, decode=2, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        # A burst of 1000 new connections to two engine processes on a small, busy machine can take
        # seconds to be accepted: this test is about the router, not about connect latency.
        running_router(
            **cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, log_level="warning", connect_timeout=60)
        ) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=None)) as client,
    ):
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        async def stream(i: int) -> tuple[int, bytes]:
            content = f"{i} {LONG}" if i % 4 == 0 else f"{i} {SHORT}"
            async with client.stream("POST", "/v1/chat/completions", json=chat_body(content, stream=True)) as response:
                return response.status_code, await response.aread()

        results = await asyncio.gather(*(stream(i) for i in range(1000)))
        refused = [(i, status, raw[:300]) for i, (status, raw) in enumerate(results) if status != 200]
        assert not refused, f"{len(refused)} of 1000 streams refused, the first: {refused[:3]}"
        assert all(sse_events(raw)[-1] == b"data: [DONE]" and b'"error"' not in raw for _, raw in results)
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
        assert grown_mib < 400, f"router + client grew {grown_mib:.0f} MiB for 1000 streams"
        assert await metric(base_url, "dpd_router_in_flight_requests") == 0


async def test_poison_requests_leave_every_breaker_closed(tokenizer_dir: Path) -> None:
    """A request every engine fails (an engine bug it trips) is the request's fault, not the engines':
    a failure that a second engine repeats counts against neither, so no client can open the breakers."""
    async with (
        SimCluster(in_process=True, prefill=2, decode=2, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        for i in range(6):  # twice the breaker's threshold, on both paths
            content = f"{i} {LONG if i % 2 else SHORT}"
            poisoned = await client.post("/v1/chat/completions", json={**chat_body(content), "sim_poison": True})
            assert poisoned.status_code == 502, poisoned.text
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=chat_body(f"{i} {SHORT}")) for i in range(10))
        )
        assert [a.status_code for a in answers] == [200] * 10
        assert await metric(base_url, "dpd_router_endpoint_circuit_opened") == 0


async def test_a_failure_another_engine_does_not_repeat_still_counts(tokenizer_dir: Path) -> None:
    async with (
        SimCluster(in_process=True, prefill=1, decode=2, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        broken = cluster.decode_urls[0]
        await client.post(f"{broken}/sim/fault", json={"mode": "error_500"})
        answers = [await client.post("/v1/chat/completions", json=chat_body(f"{i} {SHORT}")) for i in range(8)]
        assert [a.status_code for a in answers] == [200] * 8  # each served by the other after a retry
        assert await metric(base_url, "dpd_router_endpoint_circuit_opened", {"endpoint": broken}) >= 1
