"""The LMCache and SGLang connectors on loopback: simulated engines speaking each protocol, the openai client.

LMCache: the prefiller gets the prompt as token ids with a `disagg_spec`, pushes the KV to the
decoder's receiver socket and a ProxyNotif to the router; the decoder continues `prompt + [first_tok]`
as a plain completion. SGLang: both engines get the request at once with a bootstrap room, and the
decoder takes the KV from the prefiller's bootstrap server. Either way the client's answer must be
the one a decoder serving alone gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from dpd_sim.cluster import SimCluster
from dpd_sim.ports import free_ports
from dpd_sim.sampler import Sampler

from .conftest import (
    MODEL,
    cluster_settings,
    engine_stats,
    metric,
    openai_client,
    requests_seen,
    rid,
    running_router,
    settled,
)

THRESHOLD = 64
LONG = "The quarterly report shows steady growth across every region and product line. " * 12


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def kinds(urls: list[str], request_id: str) -> list[str]:
    return [entry["kind"] for url in urls for entry in await requests_seen(url, request_id)]


async def seen(urls: list[str], request_id: str) -> list[dict[str, Any]]:
    return [entry for url in urls for entry in await requests_seen(url, request_id)]


async def set_fault(url: str, mode: str, count: int | None = None) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/sim/fault", json={"mode": mode, "count": count})
        response.raise_for_status()


async def clear_faults(cluster: SimCluster) -> None:
    for engine in cluster.engines:
        await set_fault(engine.url, "none")


async def streamed_chat(base_url: str, text: str, request_id: str, **options: Any) -> tuple[str, Any, list[Any]]:
    stream = await openai_client(base_url).chat.completions.create(
        model=MODEL,
        messages=chat(text),
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id},
        **options,
    )
    chunks = [chunk async for chunk in stream]
    text_out = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next((c.usage for c in chunks if c.usage), None)
    return text_out, usage, chunks


async def direct_chat(decoder: str, text: str, **options: Any) -> Any:
    return await openai_client(decoder).chat.completions.create(model=MODEL, messages=chat(text), **options)


# -- LMCache -------------------------------------------------------------------------------------


class LMCacheCluster:
    """Two prefillers that push KV and notify the router, one decoder with a two-rank receiver."""

    def __init__(self, engines: SimCluster, notify_port: int, init_ports: list[int], alloc_ports: list[int]) -> None:
        self.engines = engines
        self.notify_address = f"tcp://127.0.0.1:{notify_port}"
        self.init_ports = init_ports
        self.alloc_ports = alloc_ports

    def settings(self, tokenizer_dir: Path, **extra: Any) -> dict[str, Any]:
        lmcache = {
            "kv_connector": "lmcache",
            "lmcache_notify_address": self.notify_address,
            "lmcache_receiver_init_ports": self.init_ports,
            "lmcache_receiver_alloc_ports": self.alloc_ports,
            "lmcache_notify_timeout": 2.0,
        }
        return cluster_settings(self.engines, tokenizer_dir, threshold=THRESHOLD, **(lmcache | extra))


@pytest.fixture(scope="module")
async def lmcache_cluster(tokenizer_dir: Path) -> AsyncIterator[LMCacheCluster]:
    notify_port, *ports = free_ports(5)
    init_ports, alloc_ports = ports[:2], ports[2:]
    receiver = [arg for port in init_ports for arg in ("--lmcache-receiver-port", str(port))]
    async with SimCluster(
        in_process=True,
        prefill=2,
        decode=1,
        tokenizer=tokenizer_dir,
        model=MODEL,
        extra_args=["--lmcache-notify-url", f"tcp://127.0.0.1:{notify_port}"],
        engine_args={"decode-0": receiver},
    ) as engines:
        yield LMCacheCluster(engines, notify_port, init_ports, alloc_ports)


@pytest.fixture
async def lmcache_router(lmcache_cluster: LMCacheCluster, tokenizer_dir: Path) -> AsyncIterator[str]:
    """One router at a time: the prefillers notify a single address, which each router binds."""
    async with running_router(**lmcache_cluster.settings(tokenizer_dir)) as base_url:
        yield base_url


@pytest.fixture
async def lmcache_engines(lmcache_cluster: LMCacheCluster) -> AsyncIterator[SimCluster]:
    yield lmcache_cluster.engines
    await clear_faults(lmcache_cluster.engines)


async def test_lmcache_streamed_chat_is_the_decoders_own_answer(
    lmcache_router: str, lmcache_engines: SimCluster
) -> None:
    request_id = rid()
    text, usage, chunks = await streamed_chat(lmcache_router, LONG, request_id, max_tokens=12, seed=5)
    alone = await direct_chat(lmcache_engines.decode_urls[0], LONG, max_tokens=12, seed=5)

    assert text == alone.choices[0].message.content
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens == alone.usage.prompt_tokens, "the first token is output, not prompt"
    assert usage.prompt_tokens_details.cached_tokens == 0, "the prefiller's cache view"

    (prefill,) = await seen(lmcache_engines.prefill_urls, request_id)
    (decode,) = await seen(lmcache_engines.decode_urls, request_id)
    assert prefill["kind"] == "remote_prefill" and prefill["prompt_tokens"] == usage.prompt_tokens
    assert decode["kind"] == "kv_decode", "the decoder found the pushed KV"
    assert decode["prompt_tokens"] == usage.prompt_tokens + 1, "prompt + [first_tok]"
    assert decode["cached_tokens"] == usage.prompt_tokens, "only the first token was computed there"
    await settled(lmcache_router)
    assert await metric(lmcache_router, "dpd_router_kv_transfer_ineffective_total") == 0


async def test_lmcache_whole_chat_answer(lmcache_router: str, lmcache_engines: SimCluster) -> None:
    request_id = rid()
    answer = await openai_client(lmcache_router).chat.completions.create(
        model=MODEL, messages=chat(LONG + " Again."), max_tokens=9, extra_headers={"X-Request-Id": request_id}
    )
    alone = await direct_chat(lmcache_engines.decode_urls[0], LONG + " Again.", max_tokens=9)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.content == alone.choices[0].message.content
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (alone.usage.prompt_tokens, 9)
    assert await kinds(lmcache_engines.decode_urls, request_id) == ["kv_decode"]


@pytest.mark.parametrize("stream", [True, False])
async def test_lmcache_text_completion(lmcache_router: str, lmcache_engines: SimCluster, stream: bool) -> None:
    request_id = rid()
    client = openai_client(lmcache_router)
    options: dict[str, Any] = {
        "model": MODEL,
        "prompt": LONG,
        "max_tokens": 7,
        "extra_headers": {"X-Request-Id": request_id},
    }
    if stream:
        pieces = [c async for c in await client.completions.create(stream=True, **options)]
        assert {piece.object for piece in pieces} == {"text_completion"}
        text = "".join(piece.choices[0].text for piece in pieces if piece.choices)
    else:
        text = (await client.completions.create(**options)).choices[0].text
    alone = await openai_client(lmcache_engines.decode_urls[0]).completions.create(
        model=MODEL, prompt=LONG, max_tokens=7
    )
    assert text == alone.choices[0].text
    assert await kinds(lmcache_engines.prefill_urls, request_id) == ["remote_prefill"]
    assert await kinds(lmcache_engines.decode_urls, request_id) == ["kv_decode"]


@pytest.mark.parametrize("stream", [True, False])
async def test_lmcache_one_token_request_is_served_by_the_decoder_alone(
    lmcache_router: str, lmcache_engines: SimCluster, stream: bool
) -> None:
    """The prefill's token would be the whole answer: no decoder would ever retrieve the pushed KV."""
    request_id = rid()
    if stream:
        text, usage, _ = await streamed_chat(lmcache_router, LONG + " One.", request_id, max_tokens=1)
    else:
        answer = await openai_client(lmcache_router).chat.completions.create(
            model=MODEL, messages=chat(LONG + " One."), max_tokens=1, extra_headers={"X-Request-Id": request_id}
        )
        text, usage = answer.choices[0].message.content, answer.usage
    alone = await direct_chat(lmcache_engines.decode_urls[0], LONG + " One.", max_tokens=1)
    assert text == alone.choices[0].message.content
    assert (usage.prompt_tokens, usage.completion_tokens) == (alone.usage.prompt_tokens, 1)
    assert await kinds(lmcache_engines.prefill_urls, request_id) == []
    assert await kinds(lmcache_engines.decode_urls, request_id) == ["local"]
    reasons = {"path": "direct", "reason": "connector_unsupported"}
    await settled(lmcache_router)
    assert await metric(lmcache_router, "dpd_router_route_decisions_total", reasons) == 1


def first_token(tokenizer_dir: Path, prompt: list[int], seed: int = 0) -> int:
    """The token every simulated engine draws first for `prompt` (engine seed 0)."""
    sampler = Sampler(AutoTokenizer.from_pretrained(str(tokenizer_dir)).backend_tokenizer, engine_seed=0)
    return sampler.stream(prompt, seed).token(0)


def token_prompt(salt: int) -> list[int]:
    """120 token ids of the simulator's vocabulary, different for each salt."""
    return [10 + (salt * 7919 + i * 31) % 3900 for i in range(120)]


async def test_lmcache_a_minimum_length_keeps_the_prefill_from_ending_the_answer(
    lmcache_router: str, lmcache_engines: SimCluster, tokenizer_dir: Path
) -> None:
    prompt = token_prompt(1)
    options: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 6,
        "extra_body": {"stop_token_ids": [first_token(tokenizer_dir, prompt)], "min_tokens": 2},
    }
    request_id = rid()
    answer = await openai_client(lmcache_router).completions.create(
        **options, extra_headers={"X-Request-Id": request_id}
    )
    alone = await openai_client(lmcache_engines.decode_urls[0]).completions.create(**options)
    assert alone.choices[0].finish_reason == "length", "the minimum forbids stopping on the first token"
    assert answer.choices[0].text == alone.choices[0].text
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 6
    assert await kinds(lmcache_engines.decode_urls, request_id) == ["kv_decode"]


async def test_lmcache_a_decoder_failing_in_band_before_its_first_token_is_replaced(
    lmcache_router: str, lmcache_engines: SimCluster
) -> None:
    """Non-streamed: judged on the decoder's own count, before the prefiller's token is added to it."""
    decoder = lmcache_engines.decode_urls[0]
    await set_fault(decoder, "reject_kv", count=1)
    request_id = rid()
    answer = await openai_client(lmcache_router).chat.completions.create(
        model=MODEL, messages=chat(LONG + " Rejected."), max_tokens=5, extra_headers={"X-Request-Id": request_id}
    )
    alone = await direct_chat(decoder, LONG + " Rejected.", max_tokens=5)
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content == alone.choices[0].message.content
    assert [(d["kind"], d["status"]) for d in await seen([decoder], request_id)] == [
        ("kv_decode", "error"),
        ("kv_decode", "ok"),
    ], "staged again: the failed decode had taken the KV"
    assert await metric(lmcache_router, "dpd_router_retries_total", {"hop": "decode"}) == 1


async def test_lmcache_serves_what_it_cannot_continue_on_the_decoder_alone(
    lmcache_router: str, lmcache_engines: SimCluster
) -> None:
    request_id = rid()
    answer = await openai_client(lmcache_router).chat.completions.create(
        model=MODEL,
        messages=chat(LONG + " Logprobs."),
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_headers={"X-Request-Id": request_id},
    )
    assert answer.choices[0].message.content
    assert await kinds(lmcache_engines.prefill_urls, request_id) == []
    assert await kinds(lmcache_engines.decode_urls, request_id) == ["local"]
    reasons = {"path": "direct", "reason": "connector_unsupported"}
    assert await metric(lmcache_router, "dpd_router_route_decisions_total", reasons) == 1


@pytest.mark.parametrize(("fault", "reason"), [("no_notification", "no_notification"), ("no_first_tok", "bad_answer")])
async def test_lmcache_prefill_failures_fall_back_to_the_unchanged_request(
    lmcache_cluster: LMCacheCluster, lmcache_engines: SimCluster, tokenizer_dir: Path, fault: str, reason: str
) -> None:
    settings = lmcache_cluster.settings(tokenizer_dir, prefill_retries=0, lmcache_notify_timeout=0.5)
    async with running_router(**settings) as base_url:
        for url in lmcache_engines.prefill_urls:
            await set_fault(url, fault)
        request_id = rid()
        text, usage, _ = await streamed_chat(base_url, LONG + f" {fault}.", request_id, max_tokens=6)
        alone = await direct_chat(lmcache_engines.decode_urls[0], LONG + f" {fault}.", max_tokens=6)
        assert text == alone.choices[0].message.content
        assert usage.completion_tokens == 6
        assert await kinds(lmcache_engines.decode_urls, request_id) == ["local"], "recomputed, as sent"
        assert await metric(base_url, "dpd_router_prefill_fallbacks_total", {"reason": reason}) == 1


async def test_lmcache_retries_another_prefiller_then_fails_per_policy(
    lmcache_cluster: LMCacheCluster, lmcache_engines: SimCluster, tokenizer_dir: Path
) -> None:
    settings = lmcache_cluster.settings(
        tokenizer_dir, lmcache_notify_timeout=0.5, prefill_failure_policy="fail", prefill_strategy="roundrobin"
    )
    async with running_router(**settings) as base_url:
        first, second = lmcache_engines.prefill_urls
        await set_fault(first, "no_notification", count=1)
        await set_fault(second, "no_notification", count=1)
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            refused = await client.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": chat(LONG + " Fail."), "max_tokens": 4}
            )
        assert refused.status_code == 503
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "prefill"}) == 1

        await set_fault(first, "no_notification", count=1)
        for attempt in range(2):  # round robin: one of two requests starts on the faulty prefiller
            answer = await openai_client(base_url).chat.completions.create(
                model=MODEL, messages=chat(LONG + f" Retry {attempt}."), max_tokens=4
            )
            assert answer.choices[0].message.content
        assert (await engine_stats(first))["fault"]["mode"] == "none", "the fault was met"
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "prefill"}) == 2
        assert await metric(base_url, "dpd_router_prefill_fallbacks_total") == 0


async def test_lmcache_first_token_reaches_the_client_before_the_decoder_answers(
    lmcache_cluster: LMCacheCluster, lmcache_engines: SimCluster, tokenizer_dir: Path
) -> None:
    settings = lmcache_cluster.settings(tokenizer_dir, first_token_timeout=1.0)
    async with (
        running_router(**settings) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        await set_fault(lmcache_engines.decode_urls[0], "hang", count=1)
        body = {"model": MODEL, "messages": chat(LONG + " Early."), "max_tokens": 5, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    alone = await direct_chat(lmcache_engines.decode_urls[0], LONG + " Early.", max_tokens=1)
    assert alone.choices[0].message.content in events[1], "the prefiller's token came first"
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]", "then the hung decoder ended it in-band"


async def test_lmcache_client_leaving_after_the_first_token_cancels_the_decoder_call(
    lmcache_router: str, lmcache_engines: SimCluster
) -> None:
    decoder = lmcache_engines.decode_urls[0]
    await set_fault(decoder, "hang", count=1)
    request_id = rid()
    body = {"model": MODEL, "messages": chat(LONG + " Leaving."), "max_tokens": 5, "stream": True}
    async with (
        httpx.AsyncClient(base_url=lmcache_router, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}) as response,
    ):
        async for line in response.aiter_lines():
            if '"content":" ' in line or '"content": " ' in line:
                break  # the prefiller's token arrived: leave
    async with asyncio.timeout(10):
        while [e["status"] for e in await seen([decoder], request_id)] != ["cancelled"]:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    await settled(lmcache_router)
    assert await metric(lmcache_router, "dpd_router_requests_total", {"outcome": "client_disconnect"}) == 1


@pytest.fixture(scope="module")
async def small_buffer_cluster(tokenizer_dir: Path) -> AsyncIterator[LMCacheCluster]:
    """One prefiller, one decoder whose LMCache receive buffer holds two 120-token prompts."""
    notify_port, init_port, alloc_port = free_ports(3)
    async with SimCluster(
        in_process=True,
        prefill=1,
        decode=1,
        tokenizer=tokenizer_dir,
        model=MODEL,
        extra_args=["--lmcache-notify-url", f"tcp://127.0.0.1:{notify_port}"],
        engine_args={"decode-0": ["--lmcache-receiver-port", str(init_port), "--lmcache-buffer-tokens", "300"]},
    ) as engines:
        yield LMCacheCluster(engines, notify_port, [init_port], [alloc_port])


async def buffer_emptied(decoder: str) -> dict[str, int]:
    """The decoder's LMCache receive buffer, once nothing waits in it (within 5 s)."""
    async with asyncio.timeout(5):
        while (buffer := (await engine_stats(decoder))["lmcache_buffer"])["entries"]:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return buffer


async def test_lmcache_kv_no_decode_call_takes_is_drained_so_the_buffer_never_fills(
    small_buffer_cluster: LMCacheCluster, tokenizer_dir: Path
) -> None:
    """LMCache's receive buffer never evicts: KV pushed for an answer the prefill's token already
    ended, or for a client that left, must be taken out by the router or it blocks every push."""
    engines = small_buffer_cluster.engines
    (prefiller,), (decoder,) = engines.prefill_urls, engines.decode_urls
    async with running_router(**small_buffer_cluster.settings(tokenizer_dir)) as base_url:
        client = openai_client(base_url)
        for salt in range(4):  # twice what the buffer holds
            prompt = token_prompt(100 + salt)
            request_id = rid()
            answer = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=5,
                extra_body={"stop_token_ids": [first_token(tokenizer_dir, prompt)]},
                extra_headers={"X-Request-Id": request_id},
            )
            assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("", "stop")
            assert await kinds([prefiller], request_id) == ["remote_prefill"]
            assert await kinds([decoder], request_id) == [], "the prefill's token was the whole answer"
            await buffer_emptied(decoder)
            assert await kinds([decoder], f"{request_id}-drain") == ["kv_decode"], "drained"

        await set_fault(decoder, "hang", count=1)
        request_id = rid()
        body = {"model": MODEL, "prompt": token_prompt(200), "max_tokens": 5, "stream": True}
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # the prefiller's token arrived, the decoder hangs: leave
        assert (await buffer_emptied(decoder))["refused"] == 0, "no push ever found the buffer full"
        await settled(base_url)
        assert await metric(base_url, "dpd_router_client_disconnects_total", {"phase": "serve"}) == 1

        request_id = rid()
        answer = await client.completions.create(
            model=MODEL, prompt=token_prompt(300), max_tokens=4, extra_headers={"X-Request-Id": request_id}
        )
        assert answer.choices[0].finish_reason == "length"
        assert await kinds([decoder], request_id) == ["kv_decode"], "the buffer still takes hand-offs"


# -- SGLang --------------------------------------------------------------------------------------


class SGLangCluster:
    """Two prefillers with bootstrap servers on ports of their own, one decoder in decode mode: a
    request without a bootstrap room gets a 500 there, as from SGLang's. Answers to compare with
    come from a prefiller serving alone (the same model, and the simulator samples alike)."""

    def __init__(self, engines: SimCluster, bootstrap_ports: dict[str, int]) -> None:
        self.engines = engines
        self.bootstrap_ports = bootstrap_ports

    def settings(self, tokenizer_dir: Path, **extra: Any) -> dict[str, Any]:
        sglang = {"kv_connector": "sglang", "sglang_bootstrap_ports": self.bootstrap_ports}
        return cluster_settings(self.engines, tokenizer_dir, threshold=THRESHOLD, **(sglang | extra))


@pytest.fixture(scope="module")
async def sglang_cluster(tokenizer_dir: Path) -> AsyncIterator[SGLangCluster]:
    ports = free_ports(2)
    async with SimCluster(
        in_process=True,
        prefill=2,
        decode=1,
        tokenizer=tokenizer_dir,
        model=MODEL,
        extra_args=["--bootstrap-timeout", "3"],
        engine_args={
            "decode-0": ["--bootstrap-required"],
            **{f"prefill-{i}": ["--bootstrap-port", str(port)] for i, port in enumerate(ports)},
        },
    ) as engines:
        bootstrap = {engines.engine(f"prefill-{i}").url: port for i, port in enumerate(ports)}
        yield SGLangCluster(engines, bootstrap)


@pytest.fixture(scope="module")
async def sglang_router(sglang_cluster: SGLangCluster, tokenizer_dir: Path) -> AsyncIterator[str]:
    async with running_router(**sglang_cluster.settings(tokenizer_dir)) as base_url:
        yield base_url


@pytest.fixture
async def sglang_engines(sglang_cluster: SGLangCluster) -> AsyncIterator[SimCluster]:
    yield sglang_cluster.engines
    await clear_faults(sglang_cluster.engines)


@pytest.mark.parametrize("stream", [True, False])
async def test_sglang_chat_goes_to_both_engines_at_once(
    sglang_router: str, sglang_engines: SimCluster, stream: bool
) -> None:
    request_id = rid()
    prompt = f"Streamed: {stream}. {LONG}"  # new to every engine's prefix cache
    if stream:
        text, usage, _ = await streamed_chat(sglang_router, prompt, request_id, max_tokens=10)
    else:
        answer = await openai_client(sglang_router).chat.completions.create(
            model=MODEL, messages=chat(prompt), max_tokens=10, extra_headers={"X-Request-Id": request_id}
        )
        text, usage = answer.choices[0].message.content, answer.usage
    alone = await direct_chat(sglang_engines.prefill_urls[0], prompt, max_tokens=10)
    assert text == alone.choices[0].message.content
    assert (usage.prompt_tokens, usage.completion_tokens) == (alone.usage.prompt_tokens, 10)
    assert usage.prompt_tokens_details.cached_tokens == 0, "the prefiller's cache view"
    (prefill,) = await seen(sglang_engines.prefill_urls, request_id)
    (decode,) = await seen(sglang_engines.decode_urls, request_id)
    assert (prefill["kind"], prefill["status"]) == ("remote_prefill", "ok")
    assert (decode["kind"], decode["cached_tokens"]) == ("kv_decode", usage.prompt_tokens)


async def test_sglang_text_completion_and_a_batch(sglang_router: str, sglang_engines: SimCluster) -> None:
    client = openai_client(sglang_router)
    alone = openai_client(sglang_engines.prefill_urls[0])
    request_id = rid()
    pieces = [
        c
        async for c in await client.completions.create(
            model=MODEL, prompt=LONG, max_tokens=6, stream=True, extra_headers={"X-Request-Id": request_id}
        )
    ]
    text = "".join(piece.choices[0].text for piece in pieces if piece.choices)
    assert text == (await alone.completions.create(model=MODEL, prompt=LONG, max_tokens=6)).choices[0].text
    assert await kinds(sglang_engines.decode_urls, request_id) == ["kv_decode"]

    batch_id = rid()
    prompts = [LONG + " First.", LONG + " Second."]
    answer = await client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, extra_headers={"X-Request-Id": batch_id}
    )
    direct = await alone.completions.create(model=MODEL, prompt=prompts, max_tokens=5)
    assert sorted((c.index, c.text) for c in answer.choices) == sorted((c.index, c.text) for c in direct.choices)
    assert await kinds(sglang_engines.prefill_urls, batch_id) == ["remote_prefill"], "one room per prompt"
    assert await kinds(sglang_engines.decode_urls, batch_id) == ["kv_decode"]


@pytest.mark.parametrize("fault", ["error_500", "no_bootstrap"])
async def test_sglang_prefill_failure_cancels_the_decoder_and_is_refused(
    sglang_cluster: SGLangCluster, sglang_engines: SimCluster, tokenizer_dir: Path, fault: str
) -> None:
    """A decode-mode decoder cannot serve the request alone: no fallback, whatever the policy says."""
    settings = sglang_cluster.settings(tokenizer_dir, prefill_retries=0, prefill_timeout=0.5)
    async with running_router(**settings) as base_url:
        for url in sglang_engines.prefill_urls:
            await set_fault(url, fault)
        request_id = rid()
        body = {"model": MODEL, "messages": chat(LONG + f" {fault}."), "max_tokens": 5, "stream": True}
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            refused = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": request_id})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        decodes = await seen(sglang_engines.decode_urls, request_id)
        assert [(d["kind"], d["status"]) for d in decodes] == [("kv_decode", "cancelled")]
        assert await metric(base_url, "dpd_router_prefill_fallbacks_total") == 0
        await settled(base_url)
        assert await metric(base_url, "dpd_router_requests_total", {"outcome": "error"}) == 1


async def test_sglang_every_prompt_takes_the_prefill_hop_however_short(
    sglang_router: str, sglang_engines: SimCluster
) -> None:
    request_id = rid()
    text, usage, _ = await streamed_chat(sglang_router, "Hi.", request_id, max_tokens=4)
    assert usage.prompt_tokens < THRESHOLD
    alone = await direct_chat(sglang_engines.prefill_urls[0], "Hi.", max_tokens=4)
    assert text == alone.choices[0].message.content
    assert await kinds(sglang_engines.prefill_urls, request_id) == ["remote_prefill"]
    assert await kinds(sglang_engines.decode_urls, request_id) == ["kv_decode"]
    await settled(sglang_router)
    reasons = {"path": "disaggregated", "reason": "connector_requires_prefill"}
    assert await metric(sglang_router, "dpd_router_route_decisions_total", reasons) >= 1


async def test_sglang_without_a_prefiller_refuses_instead_of_calling_the_decoder_alone(
    sglang_cluster: SGLangCluster, sglang_engines: SimCluster, tokenizer_dir: Path
) -> None:
    (nobody,) = free_ports(1)
    settings = sglang_cluster.settings(
        tokenizer_dir, prefill_urls=[f"http://127.0.0.1:{nobody}"], sglang_bootstrap_ports={}
    )
    async with running_router(**settings) as base_url:
        async with asyncio.timeout(10):
            while await metric(base_url, "dpd_router_endpoint_healthy", {"role": "prefill"}) != 0:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        request_id = rid()
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            body = {"model": MODEL, "messages": chat(LONG + " Nobody."), "max_tokens": 4}
            refused = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": request_id})
        assert refused.status_code == 503
        assert "cannot serve it alone" in refused.json()["error"]["message"]
        assert await seen(sglang_engines.decode_urls, request_id) == []


async def test_sglang_a_decoder_failing_while_the_prefill_runs_is_a_failed_hand_off(
    sglang_cluster: SGLangCluster, sglang_engines: SimCluster, tokenizer_dir: Path
) -> None:
    """The decoder's 500 comes before the prefill ends (it waits for the decoder to take the KV):
    the hand-off failed, and the prefill hop is retried elsewhere, not the decoder blamed."""
    async with running_router(**sglang_cluster.settings(tokenizer_dir)) as base_url:
        (decoder,) = sglang_engines.decode_urls
        await set_fault(decoder, "error_500", count=1)
        request_id = rid()
        text, _, _ = await streamed_chat(base_url, LONG + " Handed off.", request_id, max_tokens=4)
        alone = await direct_chat(sglang_engines.prefill_urls[0], LONG + " Handed off.", max_tokens=4)
        assert text == alone.choices[0].message.content
        prefills = await seen(sglang_engines.prefill_urls, request_id)
        assert sorted(p["status"] for p in prefills) == ["cancelled", "ok"], "a second prefiller, a new room"
        assert [d["status"] for d in await seen([decoder], request_id)] == ["error", "ok"]
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "prefill"}) == 1
        assert await metric(base_url, "dpd_router_retries_total", {"hop": "decode"}) == 0
        await settled(base_url)
        assert await metric(base_url, "dpd_router_prefill_seconds_count", {"outcome": "cancelled"}) == 1
        assert await metric(base_url, "dpd_router_prefill_seconds_count", {"outcome": "ok"}) == 1


async def test_sglang_retries_another_prefiller_with_a_new_room(
    sglang_cluster: SGLangCluster, sglang_engines: SimCluster, tokenizer_dir: Path
) -> None:
    async with running_router(**sglang_cluster.settings(tokenizer_dir, prefill_strategy="roundrobin")) as base_url:
        for url in sglang_engines.prefill_urls:
            await set_fault(url, "error_500", count=1)
        await set_fault(sglang_engines.prefill_urls[0], "none")
        request_id = rid()
        text, _, _ = await streamed_chat(base_url, LONG + " Retried.", request_id, max_tokens=4)
        alone = await direct_chat(sglang_engines.prefill_urls[0], LONG + " Retried.", max_tokens=4)
        assert text == alone.choices[0].message.content
        prefills = await seen(sglang_engines.prefill_urls, request_id)
        decodes = await seen(sglang_engines.decode_urls, request_id)
        assert len(prefills) in (1, 2) and prefills[-1]["status"] == "ok"
        assert decodes[-1]["kind"] == "kv_decode" and decodes[-1]["status"] == "ok"
        retried = await metric(base_url, "dpd_router_retries_total", {"hop": "prefill"})
        assert retried == len(prefills) - 1


async def test_sglang_client_leaving_cancels_both_calls(
    sglang_cluster: SGLangCluster, sglang_engines: SimCluster, tokenizer_dir: Path
) -> None:
    async with running_router(**sglang_cluster.settings(tokenizer_dir)) as base_url:
        for url in sglang_engines.prefill_urls:
            await set_fault(url, "no_bootstrap")
        request_id = rid()
        body = {"model": MODEL, "messages": chat(LONG + " Leave."), "max_tokens": 5, "stream": True}
        async with httpx.AsyncClient(base_url=base_url) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}, timeout=0.5)

        async def both_cancelled() -> bool:
            entries = await seen(sglang_engines.prefill_urls + sglang_engines.decode_urls, request_id)
            return sorted(e["status"] for e in entries) == ["cancelled", "cancelled"]

        async with asyncio.timeout(10):
            while not await both_cancelled():  # noqa: ASYNC110 - the state lives in other processes
                await asyncio.sleep(0.05)
        await settled(base_url)
        assert await metric(base_url, "dpd_router_client_disconnects_total") == 1
