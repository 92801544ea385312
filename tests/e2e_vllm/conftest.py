"""Real vLLM engines on this machine (src/dpd_sim/vllm_cpu.py) and the router in front of them.

One pair of engines runs at a time (two need about 6.5 GB): the NIXL pair for most tests, then
the shared-storage pair, which the last module asks for. Engines and routers start once per
session. When the engines' packages cannot be installed here, or memory is short, every test is
skipped with the reason; when the engines run, any misbehaviour is a failure.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import pytest
from openai import AsyncOpenAI

from dpd_sim.vllm_cpu import (
    MODEL_NAME,
    Engine,
    EnvironmentUnavailable,
    Layout,
    Mode,
    VllmPair,
    check_memory,
    ensure_env,
)
from tests.e2e_vllm.stalls import REPORTED_SECONDS, StallWatch
from tests.integration.conftest import LOCAL_TLS, local_client, running_router
from tests.integration.conftest import openai_client as integration_openai_client

# A chat prompt of about 700 tokens is disaggregated; one of about 25 goes straight to the decoder.
THRESHOLD = 256
ANSWER_TOKENS = 24
REQUEST_TIMEOUT = 300.0
# A router's start (its tokenizer loaded and checked) in the test process: 2 s here, and a starved CI machine
# has stretched the test process's steps by fifty times and more.
STARTUP_TIMEOUT = 300.0

_REPORT = (
    "the report shows steady growth in every region with costs held flat and new customers arriving faster "
    "than planned while the board asks for a plan to keep this pace next year across markets teams and "
    "products so each group reviews its numbers and writes a short note on risks and next steps"
)
_WORDS = tuple(_REPORT.split())


def long_text(words: int = 600, *, seed: str | None = None) -> str:
    """English-like text of about `words` tokens, different for every seed (fresh for the prefix caches)."""
    rng = random.Random(seed or uuid.uuid4().hex)
    return f"Summarise this report ({seed}). " + " ".join(rng.choice(_WORDS) for _ in range(words))


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        **extra,
    }


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0, **extra}


def openai_client(base_url: str) -> AsyncOpenAI:
    return integration_openai_client(base_url, timeout=REQUEST_TIMEOUT)


def anthropic_client(base_url: str) -> anthropic.AsyncAnthropic:
    """Anthropic's client, on an HTTP client of its own kind made with the tests' shared TLS context."""
    http_client = anthropic.DefaultAsyncHttpxClient(verify=LOCAL_TLS, trust_env=False)
    return anthropic.AsyncAnthropic(
        base_url=base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT, http_client=http_client
    )


async def metric_total(base_url: str, name: str, **labels: str) -> float:
    """The sum of every sample called `name` (over the labels not given) on a Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    async with local_client(timeout=REQUEST_TIMEOUT) as client:
        response = await client.get(f"{base_url}/metrics")
        response.raise_for_status()
    total = 0.0
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed call straight to an engine (or the router); the JSON answer."""
    async with local_client(timeout=REQUEST_TIMEOUT) as client:
        response = await client.post(f"{base_url}{path}", json=body)
    assert response.status_code == 200, f"{base_url}{path} answered {response.status_code}: {response.text[:500]}"
    return response.json()


@dataclass(frozen=True)
class EngineCounters:
    """What the pair's /metrics count: finished requests and prompt tokens per engine, NIXL transfers."""

    prefill_requests: float
    prefill_prompt_tokens: float
    decode_requests: float
    nixl_transfers: float

    @classmethod
    async def read(cls, pair: VllmPair) -> EngineCounters:
        prefill, decode = pair.prefill.url, pair.decode.url
        return cls(
            prefill_requests=await metric_total(prefill, "vllm:request_success_total"),
            prefill_prompt_tokens=await metric_total(prefill, "vllm:prompt_tokens_total"),
            decode_requests=await metric_total(decode, "vllm:request_success_total"),
            nixl_transfers=await metric_total(decode, "vllm:nixl_xfer_time_seconds_count"),
        )


# What the session saw of the engines, for the summary at the end of the run.
REPORT: list[str] = []


def _say(text: str) -> None:
    REPORT.append(text)
    print(f"\n[e2e_vllm] {text}", file=sys.stderr, flush=True)


# Where this process's event loop was held up (stalls.py): said at the end of a run, failed or not.
STALLS = StallWatch()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT:
        terminalreporter.section("real vLLM engines")
        for line in REPORT:
            terminalreporter.write_line(line)
    if stalls := STALLS.report():
        terminalreporter.section(f"the test process's main thread held for {REPORTED_SECONDS:g} s or more")
        for line in stalls:
            terminalreporter.write_line(line)


# The engines run eagerly: these tests are about what crosses the wire between the router and the engines,
# not the engines' compiled kernels, and an eager engine is healthy in about 60 s instead of 100 and never
# stops mid-test for a new batch size to compile (the prefiller restarted in test_prefill_failure too).
ENGINE_ARGS = ("--enforce-eager", "--enable-lora", "--max-lora-rank", "8")
# LoRA adapters are loaded while the engines run (test_lora), as a router's users load theirs.
ENGINE_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


class Engines:
    """Hands out the running pair of one mode, stopping the other mode's pair first."""

    def __init__(self, layout: Layout, log_dir: Path) -> None:
        self.layout = layout
        self.log_dir = log_dir
        self.current: VllmPair | None = None
        self._lock = asyncio.Lock()

    async def pair(self, mode: Mode) -> VllmPair:
        async with self._lock:
            if self.current is not None and self.current.mode == mode:
                return self.current
            await self.stop()
            check_memory()
            pair = VllmPair(
                mode, layout=self.layout, log_dir=self.log_dir, extra_args=ENGINE_ARGS, extra_env=ENGINE_ENV
            )
            started = time.monotonic()
            _say(f"starting the {mode} pair (logs in {self.log_dir}) ...")
            await pair.start()
            _say(
                f"{mode} pair healthy in {time.monotonic() - started:.0f} s: "
                f"prefill {pair.prefill.url}, decode {pair.decode.url}"
            )
            await warm_up(pair)
            _say(f"{mode} pair warmed up; {time.monotonic() - started:.0f} s since start")
            self.current = pair
            return pair

    async def stop(self) -> None:
        if self.current is not None:
            await self.current.stop()
            self.current = None


async def warm_up(pair: VllmPair) -> None:
    """Run the shapes the tests use once on each engine, so that no first call of its kind is timed."""
    for engine in pair.engines:
        await warm_up_engine(engine)


async def warm_up_engine(engine: Engine) -> None:
    for body in (chat(long_text(seed=f"warm-{engine.role}")), chat("Hello there, how are you?")):
        await post(engine.url, "/v1/chat/completions", body)
        await post(engine.url, "/v1/chat/completions", {**body, "max_tokens": 1})


@pytest.fixture(scope="session")
async def engines() -> AsyncIterator[Engines]:
    """The real engines' venv (built when missing), or a skip saying why it cannot be had here."""
    layout = Layout()
    try:
        await asyncio.to_thread(ensure_env, layout, say=_say)
        check_memory()
    except EnvironmentUnavailable as exc:
        pytest.skip(f"real vLLM engines cannot run on this machine: {exc}")
    holder = Engines(layout, layout.new_log_dir())
    try:
        yield holder
    finally:
        await holder.stop()


@pytest.fixture(scope="session")
async def nixl_pair(engines: Engines) -> VllmPair:
    try:
        return await engines.pair("nixl")
    except EnvironmentUnavailable as exc:
        pytest.skip(f"real vLLM engines cannot run on this machine: {exc}")


@pytest.fixture(scope="session")
async def router(nixl_pair: VllmPair) -> AsyncIterator[str]:
    """dpd-router on 127.0.0.1 in front of the NIXL pair, with a static threshold of THRESHOLD tokens."""
    async with router_for(nixl_pair) as base_url:
        yield base_url


def router_for(pair: VllmPair, **settings: Any) -> AbstractAsyncContextManager[str]:
    """dpd-router in front of `pair`: static threshold of THRESHOLD tokens, round robin; `settings` on top."""
    defaults: dict[str, Any] = {
        "prefill_urls": [pair.prefill.url],
        "decode_urls": [pair.decode.url],
        "tokenizer": str(pair.tokenizer_dir),
        "model": MODEL_NAME,
        "routing_threshold": THRESHOLD,
        "threshold_mode": "static",
        "prefill_strategy": "roundrobin",
        "log_format": "text",
        # The engines busy both cores of a CI machine: give a starved connect room (the router also
        # resends a request its only decoder could not be reached for, see test_reliability).
        "connect_timeout": 30.0,
        # No hang probes: the tests count the engines' requests exactly, and a probe is one. And a CPU
        # engine's step over a long prompt takes seconds, which a probe waits for: silence here is not a
        # hang, as it would be on a GPU engine (the hang watch is tested on simulated engines).
        "hang_probe_timeout": 0,
        # The router serves in the test process's event loop, which a starved CI machine has held for tens of
        # seconds (a client's connect timed out at 30 s): a client's request written after such a hold must
        # not find its connection's header timeout (10 s) gone meanwhile, as one did (408 on /metrics).
        "client_header_timeout": REQUEST_TIMEOUT,
        "client_body_timeout": REQUEST_TIMEOUT,
    }
    return running_router(startup_within=STARTUP_TIMEOUT, **{**defaults, **settings})


async def ask(base_url: str, kind: str, prompt: str, *, stream: bool, **extra: Any) -> tuple[str, Any]:
    """One greedy request with the openai client: the generated text and the usage object."""
    client = openai_client(base_url)
    async with client:
        if kind == "chat":
            body = chat(prompt, **extra)
            if not stream:
                answer = await client.chat.completions.create(**body)
                return answer.choices[0].message.content or "", answer.usage
            chunks = await client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
            text, usage = [], None
            async for chunk in chunks:
                text.extend(choice.delta.content or "" for choice in chunk.choices)
                usage = chunk.usage or usage
            return "".join(text), usage
        body = completion(prompt, **extra)
        if not stream:
            answer = await client.completions.create(**body)
            return answer.choices[0].text, answer.usage
        chunks = await client.completions.create(**body, stream=True, stream_options={"include_usage": True})
        text, usage = [], None
        async for chunk in chunks:
            text.extend(choice.text for choice in chunk.choices)
            usage = chunk.usage or usage
        return "".join(text), usage


async def eventually(check: Any, *, within: float = 15.0, every: float = 0.25) -> None:
    """Wait until `await check()` is true (engines update their metrics a step after answering)."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {within:g} s: {getattr(check, '__doc__', None) or check}")
        await asyncio.sleep(every)


async def counters_after_a_transfer(pair: VllmPair, before: EngineCounters) -> EngineCounters:
    """The pair's counters once the decoder has counted a NIXL transfer since `before`."""

    async def transferred() -> bool:
        """the decoder's vllm:nixl_xfer_time_seconds_count grew"""
        return (await EngineCounters.read(pair)).nixl_transfers > before.nixl_transfers

    await eventually(transferred)
    return await EngineCounters.read(pair)


_MODULE_ORDER = (
    "test_protocol",
    "test_disaggregation",
    "test_engine_parity",
    # Before the other APIs' requests: it reads every lease that expires on the prefiller while it runs.
    "test_nixl_leases",
    "test_messages",
    "test_responses",
    "test_lora",
    "test_stream_continuation",
    "test_prefill_failure",
    "test_shared_storage",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """NIXL tests first, the one that stops the prefiller after them, the shared-storage pair last."""

    def rank(item: pytest.Item) -> int:
        name = item.path.stem
        return _MODULE_ORDER.index(name) if name in _MODULE_ORDER else len(_MODULE_ORDER)

    items.sort(key=rank)
