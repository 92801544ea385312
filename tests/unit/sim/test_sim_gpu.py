"""The simulated GPU's scheduler: prefills stall decodes, batches are bounded, cancels are immediate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from dpd_sim.gpu import ABORTED, Scheduler, TimingModel

EngineFactory = Callable[..., AbstractAsyncContextManager[Any]]
FAST = TimingModel(prefill_overhead=0.001, prefill_per_token=1e-6, decode_step_base=0.001)


@pytest.fixture
async def scheduler() -> AsyncIterator[Scheduler]:
    gpu = Scheduler(FAST, max_batch_size=4)
    gpu.start()
    yield gpu
    await gpu.close()


async def take(sink: asyncio.Queue[tuple[int, int]], count: int) -> list[int]:
    return [(await asyncio.wait_for(sink.get(), 5))[1] for _ in range(count)]


async def test_a_prefill_step_stalls_every_running_decode(scheduler: Scheduler) -> None:
    stream: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    scheduler.submit(prompt_tokens=10, uncached_tokens=10, max_tokens=1000, needs_prefill=True, sink=stream)
    assert await take(stream, 3) == [0, 1, 2]
    newcomer: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    scheduler.submit(prompt_tokens=5000, uncached_tokens=5000, max_tokens=2, needs_prefill=True, sink=newcomer)
    await take(newcomer, 2)

    kinds = [(step.kind, step.batch_size, step.stalled) for step in scheduler.steps]
    stall = kinds.index(("prefill", 1, 1))
    assert kinds[0] == ("prefill", 1, 0)
    assert all(kind == ("decode", 1, 0) for kind in kinds[1:stall])
    assert kinds[stall + 1] == ("decode", 2, 0)
    assert scheduler.stalling_prefill_steps == 1


async def test_sequences_with_transferred_kv_never_prefill(scheduler: Scheduler) -> None:
    sink: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    scheduler.submit(prompt_tokens=4000, uncached_tokens=0, max_tokens=3, needs_prefill=False, sink=sink)
    assert await take(sink, 3) == [0, 1, 2]
    assert [step.kind for step in scheduler.steps] == ["decode"] * 3
    assert scheduler.running == 0


async def test_decode_step_cost_follows_the_batch_context(scheduler: Scheduler) -> None:
    sink: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for _ in range(2):
        scheduler.submit(prompt_tokens=100, uncached_tokens=0, max_tokens=2, needs_prefill=False, sink=sink)
    await take(sink, 4)
    decode = [step for step in scheduler.steps if step.kind == "decode"]
    assert [step.tokens for step in decode] == [200, 202]
    assert all(step.duration == FAST.decode_step_seconds(step.tokens) for step in decode)


async def test_batch_is_bounded_and_the_rest_waits(scheduler: Scheduler) -> None:
    sink: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for _ in range(6):
        scheduler.submit(prompt_tokens=8, uncached_tokens=8, max_tokens=100, needs_prefill=True, sink=sink)
    await take(sink, 4)
    assert (scheduler.running, scheduler.waiting) == (4, 2)


async def test_cancel_takes_a_sequence_off_the_gpu_at_once(scheduler: Scheduler) -> None:
    sink: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    seq = scheduler.submit(prompt_tokens=8, uncached_tokens=8, max_tokens=1000, needs_prefill=True, sink=sink)
    await take(sink, 2)
    scheduler.cancel(seq)
    assert (scheduler.running, scheduler.context_tokens, seq.state) == (0, 0, "cancelled")
    waiting = scheduler.submit(prompt_tokens=8, uncached_tokens=8, max_tokens=9, needs_prefill=True, sink=sink)
    scheduler.cancel(waiting)
    assert scheduler.waiting == 0


async def test_close_aborts_what_is_left() -> None:
    gpu = Scheduler(FAST)
    gpu.start()
    sink: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    gpu.submit(prompt_tokens=8, uncached_tokens=8, max_tokens=1000, needs_prefill=True, sink=sink)
    await take(sink, 1)
    await gpu.close()
    while (item := sink.get_nowait())[1] != ABORTED:
        pass
    assert item == (0, ABORTED) and gpu.running == 0


def test_realistic_preset_is_slower_than_default() -> None:
    fast, real = TimingModel(), TimingModel.realistic()
    assert real.prefill_seconds(12000) == pytest.approx(1.004)
    assert real.decode_step_seconds(0) > fast.decode_step_seconds(0)


async def test_both_engine_stalls_its_streams_during_a_local_prefill(engine: EngineFactory) -> None:
    async with engine(role="both") as e:
        stream = asyncio.create_task(
            e.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 200, "stream": True})
        )
        for _ in range(5000):
            if e.core.scheduler.decode_steps >= 3:
                break
            await asyncio.sleep(0.001)
        long_prompt = " ".join(["river mountain garden"] * 300)
        direct = await e.client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2})
        await stream
        steps = list(e.core.scheduler.steps)
    big = direct.json()["usage"]["prompt_tokens"]
    (stall,) = [i for i, step in enumerate(steps) if step.kind == "prefill" and step.tokens == big]
    assert steps[stall].stalled == 1
    assert steps[stall - 1].kind == "decode" and steps[stall - 1].batch_size == 1
    assert steps[stall + 1].kind == "decode" and steps[stall + 1].batch_size == 2
