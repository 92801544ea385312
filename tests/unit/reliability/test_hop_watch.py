"""A hop's watch: busy engines are waited for, idle ones past a learned deadline left, hung ones told apart
from long answers by a one-token probe (the probe answered here by an httpx mock transport)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from dpd_router.gateway.deadlines import DeadlinePolicy, HopDeadlines
from dpd_router.gateway.watch import Bound, EngineProbe, Expectation, HopWatch, watch_hop
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineCalls


class Engine:
    """The probe's engine: answers at once, or never (hung); counts the probes it got."""

    def __init__(self, *, hung: bool) -> None:
        self.hung = hung
        self.probes: list[dict[str, object]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.probes.append(orjson.loads(request.content))
        if self.hung:
            await asyncio.Event().wait()
        return httpx.Response(200, json={"choices": [{"text": "p"}]})

    def probe(self) -> EngineProbe:
        return EngineProbe(EngineCalls(httpx.MockTransport(self), {}))


def watch(
    endpoint: Endpoint, engine: Engine, expected: float, *, learned: bool, probe_timeout: float = 0.2
) -> HopWatch:
    return HopWatch(endpoint, expected, learned=learned, probe=engine.probe(), model="m", probe_timeout=probe_timeout)


@contextlib.asynccontextmanager
async def moving(endpoint: Endpoint) -> AsyncIterator[None]:
    """Other calls on `endpoint` produce a chunk every 10 ms meanwhile."""

    async def stamp() -> None:
        loop = asyncio.get_running_loop()
        while True:
            endpoint.progressed(loop.time())
            await asyncio.sleep(0.01)

    task = asyncio.create_task(stamp())
    try:
        yield
    finally:
        task.cancel()


async def hop(hop_watch: HopWatch, seconds: float, cap: float = 30.0) -> None:
    """A hop that answers after `seconds`, bounded by the watch and by `cap` seconds."""
    try:
        async with Bound(hop_watch, asyncio.get_running_loop().time() + cap):
            await asyncio.sleep(seconds)
    finally:
        hop_watch.stop()


async def test_a_busy_engine_is_waited_for_past_its_learned_deadline() -> None:
    """Its other calls move: the hop waits its turn however often the deadline passes."""
    endpoint, engine = Endpoint("http://busy", "decode"), Engine(hung=False)
    hop_watch = watch(endpoint, engine, 0.05, learned=True)
    async with moving(endpoint):
        await hop(hop_watch, 0.4)
    assert hop_watch.verdict is None
    assert hop_watch.busy_checks >= 3
    assert engine.probes == [], "a busy engine is not asked"


async def test_a_look_the_routers_own_pause_held_up_judges_nothing() -> None:
    """The router's loop held past the look (a long collection, a starved CPU): what the engine sent
    meanwhile is still unread when the late look runs, so it judges nothing, and the next look finds the
    engine busy."""
    endpoint, engine = Endpoint("http://busy", "decode"), Engine(hung=False)
    hop_watch = watch(endpoint, engine, 0.05, learned=True)
    hopping = asyncio.create_task(hop(hop_watch, 0.3))
    time.sleep(0.2)  # noqa: ASYNC251 -- the router's loop held up, on purpose
    await asyncio.sleep(0)  # the late look runs before anything reads the engine's tokens
    async with moving(endpoint):
        await hopping
    assert hop_watch.verdict is None
    assert hop_watch.late_looks == 1
    assert hop_watch.busy_checks >= 1


async def test_an_idle_engine_past_its_learned_deadline_is_left() -> None:
    endpoint, engine = Endpoint("http://idle", "decode"), Engine(hung=False)
    hop_watch = watch(endpoint, engine, 0.05, learned=True)
    with pytest.raises(TimeoutError):
        await hop(hop_watch, 10.0)
    assert hop_watch.verdict == "slow"
    assert engine.probes == [], "history judges it: no probe"


async def test_without_history_an_engine_that_leaves_the_probe_unanswered_is_hung() -> None:
    endpoint, engine = Endpoint("http://hung", "prefill"), Engine(hung=True)
    hop_watch = watch(endpoint, engine, 0.05, learned=False, probe_timeout=0.1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await hop(hop_watch, 10.0)
    assert hop_watch.verdict == "hung"
    assert loop.time() - started < 5.0, "told at the look and the probe, not at the cap"
    assert engine.probes == [{"model": "m", "prompt": "ping", "max_tokens": 1, "stream": False}]


async def test_an_engine_whose_other_calls_move_while_the_probe_waits_is_busy_not_hung() -> None:
    """Quiet at the look, then working through a burst: the probe queues behind that work, unanswered."""
    endpoint, engine = Endpoint("http://bursting", "decode"), Engine(hung=True)
    hop_watch = watch(endpoint, engine, 0.05, learned=False, probe_timeout=0.1)

    async def burst_after_the_look() -> None:
        await asyncio.sleep(0.07)
        async with moving(endpoint):
            await asyncio.sleep(10)

    bursting = asyncio.create_task(burst_after_the_look())
    try:
        await hop(hop_watch, 0.5)
    finally:
        bursting.cancel()
    assert hop_watch.verdict is None
    assert engine.probes and hop_watch.busy_checks >= 1


async def test_without_history_a_live_engine_keeps_a_long_hop_looking_less_often() -> None:
    """The probe answered: the hop is long, not hung; each look after the last comes twice as late."""
    endpoint, engine = Endpoint("http://long", "decode"), Engine(hung=False)
    hop_watch = watch(endpoint, engine, 0.05, learned=False)
    await hop(hop_watch, 0.5)
    assert hop_watch.verdict is None
    # Looks at 0.05, 0.15, 0.35 s (and the next at 0.75, after the hop): three probes, not ten.
    assert len(engine.probes) == 3
    assert hop_watch.expected == pytest.approx(0.4)


async def test_hops_waiting_on_one_engine_share_its_probe() -> None:
    endpoint, engine = Endpoint("http://shared", "decode"), Engine(hung=True)
    probe = engine.probe()
    watches = [HopWatch(endpoint, 0.05, learned=False, probe=probe, model="m", probe_timeout=0.2) for _ in range(5)]
    results = await asyncio.gather(*(hop(each, 10.0) for each in watches), return_exceptions=True)
    assert all(isinstance(result, TimeoutError) for result in results)
    assert {each.verdict for each in watches} == {"hung"}
    assert len(engine.probes) == 1


async def test_a_hop_that_ends_stops_its_watch() -> None:
    endpoint, engine = Endpoint("http://quick", "decode"), Engine(hung=True)
    hop_watch = watch(endpoint, engine, 0.05, learned=False)
    await hop(hop_watch, 0.0)
    await asyncio.sleep(0.3)
    assert hop_watch.verdict is None
    assert engine.probes == []


def test_a_hang_opens_the_breaker_at_once() -> None:
    endpoint = Endpoint("http://hung", "decode")
    assert endpoint.available
    endpoint.record_hang("hung")
    assert not endpoint.available
    assert endpoint.breaker.times_opened == 1


def learned_watch(
    endpoint: Endpoint, engine: Engine, deadlines: HopDeadlines, *, cap: float = 30.0, floor: float = 0.05
) -> HopWatch | None:
    """The watch of a prefill of 100 tokens judged by `deadlines` (four times the usual, at least `floor`)."""
    policy = DeadlinePolicy(factor=4.0, floor=floor, samples=1)
    return watch_hop(
        endpoint,
        tokens=100,
        learned=deadlines.deadline_later("prefill", (100,), policy, cap),
        cap=cap,
        floor=policy.floor,
        probe=engine.probe(),
        model="m",
        probe_timeout=0.2,
    )


async def test_a_learned_deadline_is_worked_out_at_the_first_look_and_judges_as_one_known_from_the_start() -> None:
    """The first look comes at the floor; there the deadline (0.2 s here) is worked out and the hop is looked
    at again then: an idle engine is left as slow at 0.2 s, not at the floor."""
    endpoint, engine = Endpoint("http://idle", "prefill"), Engine(hung=False)
    deadlines = HopDeadlines()
    deadlines.learn("prefill", (100,), 0.05)
    hop_watch = learned_watch(endpoint, engine, deadlines)
    assert hop_watch is not None
    started = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        await hop(hop_watch, 10.0)
    waited = asyncio.get_running_loop().time() - started
    assert hop_watch.verdict == "slow" and hop_watch.expected == pytest.approx(0.2)
    assert 0.2 <= waited < 5.0
    assert engine.probes == [], "history judges it: no probe"


async def test_a_hop_over_before_its_first_look_never_works_its_deadline_out() -> None:
    endpoint, engine = Endpoint("http://quick", "prefill"), Engine(hung=False)
    deadlines = HopDeadlines()
    deadlines.learn("prefill", (100,), 0.05)
    asked: list[bool] = []
    hop_watch = learned_watch(endpoint, engine, deadlines, floor=0.5)  # a first look far past the hop's end
    assert hop_watch is not None
    settle = hop_watch._settle
    assert settle is not None

    def counted() -> Expectation:
        asked.append(True)
        return settle()

    hop_watch._settle = counted
    await hop(hop_watch, 0.01)
    await asyncio.sleep(0.6)  # past where the first look would have come
    assert asked == [] and hop_watch.verdict is None


async def test_a_learned_deadline_past_the_cap_leaves_the_hop_to_the_hang_probe() -> None:
    """Worked out at or past the cap, the learned deadline gives way to the prior's look for a hang, as
    it did known at the start (the prior, 4 s and more, past this cap: no look at all)."""
    endpoint, engine = Endpoint("http://idle", "prefill"), Engine(hung=False)
    deadlines = HopDeadlines()
    deadlines.learn("prefill", (100,), 0.5)  # 2 s learned, past the cap of 1 s
    hop_watch = learned_watch(endpoint, engine, deadlines, cap=1.0)
    assert hop_watch is not None
    with pytest.raises(TimeoutError):
        await hop(hop_watch, 10.0, cap=0.3)
    assert hop_watch.verdict is None and engine.probes == []
