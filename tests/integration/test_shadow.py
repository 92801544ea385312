"""Shadow traffic: the shadow gets copies of the chosen requests and nothing else, and a shadow that
hangs or fails costs the clients nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from dpd_router.api.auth import hash_key
from dpd_router.config import ShadowSettings
from dpd_router.shadow import ShadowChoice
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, chat_body, engine_stats, metric, running_router, settled

ADMIN = {"Authorization": "Bearer ops-secret"}
SHORT = "Hi there."
LONG = "Tell me everything about the history of the long prompt. " * 40  # a few hundred tokens
MIN_TOKENS = 100


@pytest.fixture(scope="module")
async def engines(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    """A prefiller and a decoder serving the live traffic, and a decoder alone as the monolithic shadow."""
    async with SimCluster(in_process=True, prefill=1, decode=2, tokenizer=tokenizer_dir, model=MODEL) as cluster:
        yield cluster


def live_settings(engines: SimCluster, tokenizer_dir: Path, shadow: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "prefill_urls": engines.prefill_urls,
        "decode_urls": engines.decode_urls[:1],
        "tokenizer": str(tokenizer_dir),
        "routing_threshold": 200,
        "threshold_mode": "static",
        "shadow": shadow,
    }


def shadow_url(engines: SimCluster) -> str:
    return engines.decode_urls[1]


async def shadow_saw(engines: SimCluster, prefix: str) -> list[str]:
    """The request ids starting with `prefix` the shadow engine served, in order."""
    stats = await engine_stats(shadow_url(engines))
    return [entry["request_id"] for entry in stats["recent"] if entry["request_id"].startswith(prefix)]


async def copies_finished(base_url: str, count: int, outcome: str | None = None) -> None:
    """Wait until the router has recorded `count` shadow copies (the clients never wait for them)."""
    labels = {} if outcome is None else {"outcome": outcome}
    async with asyncio.timeout(60):
        while await metric(base_url, "dpd_router_shadow_requests_total", labels) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def ask(
    client: httpx.AsyncClient, request_id: str, content: str, *, stream: bool, headers: dict[str, str] | None = None
) -> str:
    """One chat request; its answer's text (every chunk's, when streamed), checked to be whole."""
    body = chat_body(content, max_tokens=4, stream=stream)
    sent = {"x-request-id": request_id, **(headers or {})}
    if not stream:
        response = await client.post("/v1/chat/completions", json=body, headers=sent)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["finish_reason"] == "length"
        return str(answer["choices"][0]["message"]["content"])
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=sent) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        payload = orjson.loads(line[len("data: ") :])
        assert "error" not in payload, payload
        text += [choice["delta"].get("content") or "" for choice in payload["choices"]]
    return "".join(text)


async def test_only_prompts_of_at_least_min_prompt_tokens_reach_the_shadow_and_are_measured_there(
    engines: SimCluster, tokenizer_dir: Path
) -> None:
    shadow = {"url": shadow_url(engines), "min_prompt_tokens": MIN_TOKENS, "max_concurrent": 2, "queue": 64}
    long_ids = [f"minlen-long-{number}" for number in range(6)]
    short_ids = [f"minlen-short-{number}" for number in range(6)]
    async with (
        running_router(**live_settings(engines, tokenizer_dir, shadow)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        for number, (long_id, short_id) in enumerate(zip(long_ids, short_ids, strict=True)):
            assert await ask(client, long_id, LONG, stream=number % 2 == 0)
            assert await ask(client, short_id, SHORT, stream=number % 2 == 1)
        await copies_finished(base_url, len(long_ids))
        await settled(base_url)
        assert sorted(await shadow_saw(engines, "minlen-")) == sorted(long_ids)
        assert await metric(base_url, "dpd_router_shadow_requests_total", {"outcome": "ok"}) == len(long_ids)
        shadow_labels = {"arm": "shadow", "path": "monolithic"}
        assert await metric(base_url, "dpd_router_requests_total", {**shadow_labels, "outcome": "ok"}) == 6
        # Non-streamed clients' copies are streams too: every copy has a first token to time.
        ttft = await metric(base_url, "dpd_router_time_to_first_token_seconds_count", shadow_labels)
        assert ttft == len(long_ids)
        assert await metric(base_url, "dpd_router_inter_token_latency_seconds_count", shadow_labels) > 0
        assert await metric(base_url, "dpd_router_e2e_latency_seconds_count", shadow_labels) == 6
        # The live path's metrics count the clients' requests alone.
        assert await metric(base_url, "dpd_router_requests_total", {"arm": "live"}) == 12
        assert await metric(base_url, "dpd_router_shadow_dropped_total") == 0


async def test_messages_and_responses_requests_are_copied_in_their_own_api(
    engines: SimCluster, tokenizer_dir: Path
) -> None:
    shadow = {"url": shadow_url(engines), "min_prompt_tokens": MIN_TOKENS, "max_concurrent": 2, "queue": 64}
    async with (
        running_router(**live_settings(engines, tokenizer_dir, shadow)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        first = await client.post(
            "/v1/responses",
            json={"model": MODEL, "input": LONG, "max_output_tokens": 4},
            headers={"x-request-id": "apis-responses-1"},
        )
        assert first.status_code == 200, first.text
        follow = await client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "And?", "previous_response_id": first.json()["id"], "max_output_tokens": 4},
            headers={"x-request-id": "apis-responses-2"},
        )
        assert follow.status_code == 200, follow.text
        messages = await client.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": LONG}]},
            headers={"x-request-id": "apis-messages-1"},
        )
        assert messages.status_code == 200, messages.text
        await copies_finished(base_url, 3)
        assert await metric(base_url, "dpd_router_shadow_requests_total", {"outcome": "ok"}) == 3
        ttft = await metric(
            base_url, "dpd_router_time_to_first_token_seconds_count", {"arm": "shadow", "path": "monolithic"}
        )
        assert ttft == 3, "each copy's stream was read in its own API, its first token seen"
    assert sorted(await shadow_saw(engines, "apis-")) == ["apis-messages-1", "apis-responses-1", "apis-responses-2"]
    # The follow-up's copy is the whole history, as the engines got it: the shadow stores nothing either.
    recent = (await engine_stats(shadow_url(engines)))["recent"]
    prompts = {
        entry["request_id"]: entry["prompt_tokens"] for entry in recent if entry["request_id"].startswith("apis-")
    }
    assert prompts["apis-responses-2"] > prompts["apis-responses-1"]


async def test_a_share_of_requests_is_copied_and_every_replica_chooses_the_same_ones(
    engines: SimCluster, tokenizer_dir: Path
) -> None:
    shadow = {"url": shadow_url(engines), "share": 0.5, "max_concurrent": 4, "queue": 256}
    request_ids = [f"share-{number}" for number in range(60)]
    expected = [request_id for request_id in request_ids if ShadowChoice(ShadowSettings(**shadow)).chosen(request_id)]
    assert 20 <= len(expected) <= 40  # about half
    settings = live_settings(engines, tokenizer_dir, shadow)
    async with running_router(**settings) as first, running_router(**settings) as second:
        # Each request id goes to both replicas, as a retried request might.
        for base_url in (first, second):
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
                for request_id in request_ids:
                    assert await ask(client, request_id, LONG if request_id.endswith("7") else SHORT, stream=True)
        await copies_finished(first, len(expected))
        await copies_finished(second, len(expected))
        assert await metric(first, "dpd_router_shadow_requests_total") == len(expected)
        assert await metric(second, "dpd_router_shadow_requests_total") == len(expected)
    seen = await shadow_saw(engines, "share-")
    assert sorted(seen) == sorted(expected * 2)  # each chosen id once from each replica, no other


async def test_a_staging_dpd_router_as_shadow_gets_marked_copies_it_does_not_copy_again(
    engines: SimCluster, tokenizer_dir: Path
) -> None:
    staging_settings = live_settings(engines, tokenizer_dir, {"url": shadow_url(engines)})
    async with running_router(**staging_settings) as staging:
        shadow = {"url": f"{staging}/v1", "kind": "dpd", "min_prompt_tokens": MIN_TOKENS}
        async with (
            running_router(**live_settings(engines, tokenizer_dir, shadow)) as base_url,
            httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        ):
            for number in range(4):
                assert await ask(client, f"staging-{number}", LONG, stream=number % 2 == 0)
            await copies_finished(base_url, 4, "ok")
            dpd_labels = {"arm": "shadow", "path": "dpd"}
            assert await metric(base_url, "dpd_router_time_to_first_token_seconds_count", dpd_labels) == 4
        await settled(staging)
        # The staging router served the copies as its own live traffic, and sent none to its own shadow.
        assert await metric(staging, "dpd_router_requests_total", {"arm": "live", "outcome": "ok"}) == 4
        assert await metric(staging, "dpd_router_requests_total", {"arm": "shadow"}) == 0
    assert await shadow_saw(engines, "staging-") == []


async def test_a_shadow_is_turned_on_changed_and_off_on_a_running_router(
    engines: SimCluster, tokenizer_dir: Path
) -> None:
    settings = {**live_settings(engines, tokenizer_dir, None), "admin_key_hashes": [hash_key("ops-secret")]}
    async with (
        running_router(**settings) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        assert await ask(client, "live-before", LONG, stream=True)
        shadow = {"url": shadow_url(engines), "min_prompt_tokens": MIN_TOKENS}
        changed = await client.put("/admin/config", json={"shadow": shadow}, headers=ADMIN)
        assert changed.status_code == 200, changed.text
        assert await ask(client, "live-on-long", LONG, stream=False)
        assert await ask(client, "live-on-short", SHORT, stream=True)
        await copies_finished(base_url, 1)
        # Every prompt now, short ones too.
        changed = await client.put(
            "/admin/config", json={"shadow": {**shadow, "min_prompt_tokens": 0, "share": 1.0}}, headers=ADMIN
        )
        assert changed.status_code == 200, changed.text
        assert await ask(client, "live-changed-short", SHORT, stream=True)
        await copies_finished(base_url, 2)
        changed = await client.put("/admin/config", json={"shadow": None}, headers=ADMIN)
        assert changed.status_code == 200, changed.text
        assert await ask(client, "live-off", LONG, stream=True)
        await settled(base_url)
        config = (await client.get("/admin/config", headers=ADMIN)).json()
        assert config["shadow"] is None
        assert await metric(base_url, "dpd_router_shadow_requests_total") == 2
    assert sorted(await shadow_saw(engines, "live-")) == ["live-changed-short", "live-on-long"]


class BrokenShadow:
    """An OpenAI endpoint on 127.0.0.1 that never answers (`hang`) or answers 500, recording each call."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.calls: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.release = asyncio.Event()

    async def _completions(self, request: web.Request) -> web.Response:
        self.calls.append(({name.lower(): value for name, value in request.headers.items()}, await request.json()))
        if self.behaviour == "hang":
            await self.release.wait()
        return web.json_response({"error": {"message": "shadow engine broken"}}, status=500)

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            self.release.set()
            await runner.cleanup()


async def test_a_hung_shadow_changes_nothing_for_clients_and_its_overflow_is_dropped(
    engines: SimCluster, tokenizer_dir: Path
) -> None:
    broken = BrokenShadow("hang")
    async with broken.serving() as url:
        shadow = {"url": url, "max_concurrent": 1, "queue": 2, "timeout": 600}
        async with (
            running_router(**live_settings(engines, tokenizer_dir, shadow)) as base_url,
            httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        ):
            async with asyncio.timeout(30):
                assert await ask(client, "hung-0", LONG, stream=True)
                while not broken.calls:  # noqa: ASYNC110 - the one worker takes the first copy
                    await asyncio.sleep(0.02)
            answers = await asyncio.gather(
                *(
                    ask(client, f"hung-{number}", LONG if number % 2 else SHORT, stream=number % 3 == 0)
                    for number in range(1, 13)
                )
            )
            assert all(answers)
            await settled(base_url)
            assert await metric(base_url, "dpd_router_requests_total", {"arm": "live", "outcome": "ok"}) == 13
            assert await metric(base_url, "dpd_router_requests_total", {"arm": "live"}) == 13
            # One copy hangs in the one call, two wait in the queue, the other ten are dropped.
            assert len(broken.calls) == 1
            assert await metric(base_url, "dpd_router_shadow_dropped_total", {"reason": "queue_full"}) == 10
            assert await metric(base_url, "dpd_router_shadow_requests_total") == 0


async def test_a_failing_shadow_changes_nothing_for_clients_and_its_failures_are_counted(
    engines: SimCluster, tokenizer_dir: Path
) -> None:
    broken = BrokenShadow("fail")
    async with broken.serving() as url:
        shadow = {"url": url, "max_concurrent": 2, "api_key": "shadow-key", "model": "staging-model"}
        async with (
            running_router(**live_settings(engines, tokenizer_dir, shadow)) as base_url,
            httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        ):
            for number in range(8):
                assert await ask(client, f"failing-{number}", LONG if number % 2 else SHORT, stream=number % 2 == 0)
            # A copy arriving at this router (as at a staging one) is served but not copied again.
            assert await ask(client, "failing-copy", LONG, stream=True, headers={"x-dpd-shadow": "1"})
            await copies_finished(base_url, 8, "status_5xx")
            await settled(base_url)
            assert await metric(base_url, "dpd_router_requests_total", {"arm": "live", "outcome": "ok"}) == 9
            assert await metric(base_url, "dpd_router_requests_total", {"arm": "shadow", "outcome": "status_5xx"}) == 8
            assert await metric(base_url, "dpd_router_shadow_requests_total") == 8
    assert sorted(headers["x-request-id"] for headers, _ in broken.calls) == [f"failing-{n}" for n in range(8)]
    for headers, body in broken.calls:
        assert headers["x-dpd-shadow"] == "1" and headers["authorization"] == "Bearer shadow-key"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "staging-model" and body["messages"][0]["role"] == "user"
