"""One engine the router can call, with the state routing decisions read."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from dpd_router.pool.breaker import CLOSED, CircuitBreaker

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class EngineLoad:
    """What an engine's `/metrics` said about its load at one scrape.

    `running` and `waiting` are summed over the engine's data-parallel ranks; `kv_cache_usage`
    (0..1) is their mean. `prefix_cache_hit_rate` is Δhits/Δqueries since the previous scrape,
    None until two scrapes have seen queries. `scraped_at` is a `time.monotonic()` reading.
    """

    running: float
    waiting: float
    kv_cache_usage: float | None
    prefix_cache_hit_rate: float | None
    scraped_at: float


class Slot:
    """A count a request holds on an engine (a call open there, prompt tokens queued there, a request staging
    its KV for it), released once however often `release` is called: on leaving its `with` block, or, for a
    slot held past one, by what holds it (the request's Completion, when its response closes)."""

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class Endpoint:
    """An engine's base URL, its role, and what the router knows of it right now.

    `healthy` starts optimistic so the first requests are not refused before the first probe;
    `probed_ok` says whether an active probe has ever seen it answer. `load` is the last scraped
    engine load; it counts only until `load_fresh_until` (monotonic), so a scraper that stops
    getting answers stops steering traffic with old numbers. A `draining` endpoint takes no new
    calls while the ones it has finish (discovery saw its engine go away).
    """

    url: str
    role: Role
    in_flight: int = 0
    # Prompt tokens this router has sent here that are not prefilled yet: on a prefiller, its open prefill
    # calls; on a decoder, its streamed direct calls before their first token. The work ahead of a new one.
    queued_tokens: int = 0
    # Requests counted in in_flight here that are still in their prefill hop (decoders only).
    staging: int = 0
    healthy: bool = True
    probed_ok: bool = False
    probe_failures: int = 0
    probe_passes: int = 0
    last_error: str | None = field(default=None, repr=False)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker, repr=False)
    load: EngineLoad | None = field(default=None, repr=False)
    load_fresh_until: float = field(default=0.0, repr=False)
    draining: bool = False
    # Loop time this engine last produced something for any call of this router: a streamed chunk, a
    # whole answer. What tells a busy engine (its other calls move) from a hung one (gateway/watch.py).
    last_moved: float = field(default=float("-inf"), repr=False)
    # The LoRA adapters the engine lists in its `/v1/models` (name -> its card there), learnt each health round.
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    _idle: asyncio.Event | None = field(default=None, repr=False)

    @property
    def available(self) -> bool:
        """Whether new calls may go here: not draining, its probes pass and its breaker lets them through."""
        return self.healthy and not self.draining and self.breaker.allows()

    def queue_prefill(self, tokens: int) -> Slot:
        """`tokens` prompt tokens counted in `queued_tokens` while the slot is held."""
        self.queued_tokens += tokens
        return Slot(functools.partial(self._dequeue, tokens))

    def _dequeue(self, tokens: int) -> None:
        self.queued_tokens -= tokens

    def calling(self) -> Slot:
        """A call open here (counted in `in_flight`, and by the breaker) while the slot is held."""
        self.start()
        return Slot(self.finish)

    def staging_for(self) -> Slot:
        """A request counted in `in_flight` here that is still in its prefill hop, while the slot is held."""
        self.staging += 1
        return Slot(self._staged)

    def _staged(self) -> None:
        self.staging -= 1

    def progressed(self, now: float) -> None:
        self.last_moved = now

    def moved_since(self, since: float) -> bool:
        return self.last_moved >= since

    def start(self) -> None:
        self.in_flight += 1
        self.breaker.on_start()

    def finish(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no call is open here (the caller bounds the wait)."""
        if self._idle is None:
            self._idle = asyncio.Event()
        while self.in_flight > 0:
            self._idle.clear()
            await self._idle.wait()

    def record_success(self) -> None:
        self.breaker.on_success()

    def record_failure(self, error: str) -> bool:
        """Count a failed call (passive outlier detection); True when it opened the breaker."""
        self.last_error = error
        return self.breaker.on_failure()

    def record_hang(self, error: str) -> None:
        """A hop's watch found the engine hung (no progress, a one-token probe unanswered): its
        breaker opens now, so the next requests go elsewhere, or are told at once."""
        self.last_error = error
        self.breaker.trip()

    def record_probe(self, ok: bool, error: str | None, *, unhealthy_after: int, healthy_after: int) -> bool:
        """Count an active probe's result; True when it changed `healthy`."""
        was = self.healthy
        if ok:
            self.probed_ok = True
            self.probe_failures = 0
            self.probe_passes += 1
            if not self.healthy and self.probe_passes >= healthy_after:
                self.healthy = True
        else:
            self.last_error = error
            self.probe_passes = 0
            self.probe_failures += 1
            if self.probe_failures >= unhealthy_after:
                self.healthy = False
        return was != self.healthy

    def record_load(self, load: EngineLoad, *, fresh_for: float) -> None:
        self.load = load
        self.load_fresh_until = load.scraped_at + fresh_for

    def fresh_load(self, now: float) -> EngineLoad | None:
        """The scraped load if it is recent enough to route on, else None."""
        return self.load if now < self.load_fresh_until else None

    @property
    def state(self) -> str:
        """`draining`, `unhealthy` (failing probes), else the breaker's state: `healthy`, `open` or `half_open`."""
        if self.draining:
            return "draining"
        if not self.healthy:
            return "unhealthy"
        breaker = self.breaker.state
        return "healthy" if breaker == CLOSED else breaker
