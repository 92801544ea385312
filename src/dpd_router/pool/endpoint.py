"""One engine the router can call, with the state routing decisions read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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


@dataclass(eq=False)
class Endpoint:
    """An engine's base URL, its role, and what the router knows of it right now.

    `healthy` starts optimistic so the first requests are not refused before the first probe;
    `probed_ok` says whether an active probe has ever seen it answer. `load` is the last scraped
    engine load; it counts only until `load_fresh_until` (monotonic), so a scraper that stops
    getting answers stops steering traffic with old numbers.
    """

    url: str
    role: Role
    in_flight: int = 0
    healthy: bool = True
    probed_ok: bool = False
    consecutive_failures: int = 0
    last_error: str | None = field(default=None, repr=False)
    load: EngineLoad | None = field(default=None, repr=False)
    load_fresh_until: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self.in_flight += 1

    def finish(self) -> None:
        self.in_flight -= 1

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.healthy = True

    def record_failure(self, error: str, *, unhealthy_after: int) -> None:
        self.consecutive_failures += 1
        self.last_error = error
        if self.consecutive_failures >= unhealthy_after:
            self.healthy = False

    def record_load(self, load: EngineLoad, *, fresh_for: float) -> None:
        self.load = load
        self.load_fresh_until = load.scraped_at + fresh_for

    def fresh_load(self, now: float) -> EngineLoad | None:
        """The scraped load if it is recent enough to route on, else None."""
        return self.load if now < self.load_fresh_until else None

    @property
    def state(self) -> str:
        return "healthy" if self.healthy else "unhealthy"
