"""A hop past its expected time: busy, slow or hung, told apart while it waits.

A fixed timeout must allow for the longest legitimate call, so on its own it lets a hung engine
hold a request for minutes. A hop's watch looks at the hop when it has run as long as it should
(its learned deadline, or before there is history a prior from its size) and asks the engine
rather than guesses:

- busy: the engine's other calls have moved within the last period (a token streamed, an answer
  finished). It is working through what it was given, and this call waits its turn: the watch looks
  again one period later. A burst is queueing, not a hang.
- slow: nothing moved, and the hop is past a learned deadline, far longer than hops of its size take
  here: abandoned for another engine as before (deadlines.py).
- hung: nothing moved, no history to judge by, and the engine leaves a one-token completion
  unanswered for `hang_probe_timeout` seconds while nothing else of it moves either. An engine that
  answers the probe is alive and merely long at this call: the watch looks again after twice the
  period. One whose other calls move while the probe waits is busy (the probe queued behind their
  work, as it does on an engine working through a burst): the watch looks again one period later.

A look that comes late (the router's own loop held up: a long collection, a starved CPU) judges nothing:
the engine's tokens of that time may still wait in the socket, unread, so the watch looks again one
period later instead of taking the router's pause for the engine's.

A verdict ends the hop's current wait at once (its timeout scope expires); without one the phase's
timeout still bounds it. One probe at a time per engine: every hop waiting on it shares the answer.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Literal

import httpx
import orjson

from dpd_router.gateway.deadlines import LearnedDeadline, prior
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineCalls

Verdict = Literal["slow", "hung"]

# When a watch first looks at its hop (seconds from the hop's start), and whether that is a learned deadline
# (a hop past it and idle is "slow") or a time to ask whether the engine hangs; None: no look at all.
Expectation = tuple[float, bool] | None

# How late a look may run (a share of its period, and at least this many seconds) and still judge.
LATE_SHARE = 0.25
LATE_SECONDS = 0.05


class EngineProbe:
    """Asks an engine that seems stuck for one token; built once, shared by every hop."""

    def __init__(self, engines: EngineCalls) -> None:
        self._engines = engines
        self._running: weakref.WeakKeyDictionary[Endpoint, asyncio.Task[bool]] = weakref.WeakKeyDictionary()

    def answers(self, endpoint: Endpoint, model: str, within: float) -> asyncio.Task[bool]:
        """Whether `endpoint` completes a one-token request within `within` seconds (the probe in
        flight, if one is: its answer is as good for every hop waiting on that engine)."""
        task = self._running.get(endpoint)
        if task is None:
            task = asyncio.create_task(self._ask(endpoint, model, within), name=f"hang probe {endpoint.url}")
            self._running[endpoint] = task
            task.add_done_callback(lambda _: self._running.pop(endpoint, None))
        return task

    async def _ask(self, endpoint: Endpoint, model: str, within: float) -> bool:
        body = orjson.dumps({"model": model, "prompt": "ping", "max_tokens": 1, "stream": False})
        # The smallest request that needs the engine's scheduler and model to answer, named in its logs.
        headers = {"Content-Type": "application/json", "X-Request-Id": f"dpd-router-probe-{uuid.uuid4().hex}"}
        limits = httpx.Timeout(within, connect=min(within, 5.0))
        try:
            await self._engines.whole(f"{endpoint.url}/v1/completions", body, headers, limits=limits)
        except httpx.TimeoutException:
            return False
        except httpx.HTTPError:
            # Unreachable or broken: the hop itself fails with that; the probe judges only silence.
            return True
        # Any answer in time: the engine's server is alive. A refusal (another model name, a prompt
        # it rejects) says nothing against the engine, and a hop is never cut on doubt.
        endpoint.progressed(asyncio.get_running_loop().time())
        return True


class HopWatch:
    """Judges one hop on one engine while it runs past `expected` seconds (see the module's doc)."""

    def __init__(
        self,
        endpoint: Endpoint,
        expected: float,
        *,
        learned: bool,
        probe: EngineProbe | None,
        model: str | None,
        probe_timeout: float,
        settle: Callable[[], Expectation] | None = None,
    ) -> None:
        """`settle`: the expectation is worked out at the first look, `expected` seconds in (no later than
        whatever it settles on): there it says when the hop is looked at, if at all."""
        self._loop = asyncio.get_running_loop()
        self._endpoint = endpoint
        self._period = expected
        self._learned = learned
        self._settle = settle
        self._probe = probe if model is not None and probe_timeout > 0 else None
        self._model = model or ""
        self._probe_timeout = probe_timeout
        self.started = self._loop.time()
        self.verdict: Verdict | None = None
        self.busy_checks = 0
        self.late_looks = 0
        self._scope: asyncio.Timeout | None = None
        self._asking: asyncio.Task[bool] | None = None
        self._asked_at = self.started  # when this hop last asked for the probe's answer
        self._due = self.started + expected
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self._due, self._look)

    @property
    def expected(self) -> float:
        return self._period

    def stop(self) -> None:
        """The hop is over (answered, failed or cancelled): no more looks, no probe waited for."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._asking = None

    def _look(self) -> None:
        self._timer = None
        now = self._loop.time()
        if self._settle is not None:
            settle, self._settle = self._settle, None
            expectation = settle()
            if expectation is None:
                return  # nothing to look at after all: the phase's timeout alone bounds the hop
            self._period, self._learned = expectation
            self._due = self.started + self._period
            if self._due > now:
                self._timer = self._loop.call_at(self._due, self._look)
                return
        if now - self._due > max(LATE_SECONDS, LATE_SHARE * self._period):
            self.late_looks += 1
            self._again(now + self._period)
        elif self._endpoint.moved_since(now - self._period):
            self.busy_checks += 1
            self._again(now + self._period)
        elif self._learned:
            self._decide("slow")
        elif self._probe is not None:
            self._asked_at = now
            asking = self._asking = self._probe.answers(self._endpoint, self._model, self._probe_timeout)
            asking.add_done_callback(self._answered)

    def _answered(self, asking: asyncio.Task[bool]) -> None:
        if asking is not self._asking:
            return  # the hop ended meanwhile
        self._asking = None
        now = self._loop.time()
        if asking.cancelled() or asking.exception() is not None or asking.result():
            self._period *= 2
            self._again(now + self._period)
        elif self._endpoint.moved_since(self._asked_at):
            # Its other calls moved while the probe waited: alive, and the probe queued behind their work.
            self.busy_checks += 1
            self._again(now + self._period)
        else:
            self._decide("hung")

    def _again(self, at: float) -> None:
        self._due = at
        self._timer = self._loop.call_at(at, self._look)

    def _decide(self, verdict: Verdict) -> None:
        self.verdict = verdict
        if self._scope is not None:
            self._scope.reschedule(self._loop.time())


def watch_hop(
    endpoint: Endpoint,
    *,
    tokens: int,
    learned: LearnedDeadline | None,
    cap: float,
    floor: float,
    probe: EngineProbe | None,
    model: str | None,
    probe_timeout: float,
) -> HopWatch | None:
    """The watch of a hop of `tokens` uncached prompt tokens that `cap` seconds bound (None: the cap alone).

    At its learned deadline, where there is one below the cap; else, when a prior from its size says and
    only to ask whether the engine hangs (never with the probe off). A learned deadline is worked out at a
    first look `floor` seconds in (none is shorter), where most hops have long ended."""

    def without_history() -> Expectation:
        expected = max(floor, prior(tokens))
        return None if expected >= cap or probe_timeout <= 0 else (expected, False)

    def settle() -> Expectation:
        assert learned is not None
        seconds = learned()
        return without_history() if seconds is None else (seconds, True)

    if learned is None or floor >= cap:  # at or past the cap, no learned deadline applies
        expectation = without_history()
        if expectation is None:
            return None
        expected, _ = expectation
        return HopWatch(endpoint, expected, learned=False, probe=probe, model=model, probe_timeout=probe_timeout)
    return HopWatch(
        endpoint, floor, learned=False, probe=probe, model=model, probe_timeout=probe_timeout, settle=settle
    )


class Bound:
    """`asyncio.timeout_at(at)` around one wait of a hop, which its watch's verdict (if it has a
    watch) moves to now while it is entered."""

    def __init__(self, watch: HopWatch | None, at: float) -> None:
        self._watch = watch
        self._at = at
        self._scope: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        watch = self._watch
        at = self._at if watch is None or watch.verdict is None else asyncio.get_running_loop().time()
        scope = self._scope = asyncio.timeout_at(at)
        await scope.__aenter__()
        if watch is not None:
            watch._scope = scope

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._watch is not None:
            self._watch._scope = None
        assert self._scope is not None
        await self._scope.__aexit__(kind, exc, tb)  # expired: raises TimeoutError
