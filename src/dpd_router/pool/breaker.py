"""Per-endpoint circuit breaker: passive outlier detection from the request path.

closed -> (consecutive failures) -> open -> (cool-down) -> half-open -> (a trial succeeds) -> closed,
or back to open with a longer cool-down when the trial fails. Half-open lets one call through at a time
(when no engine of its role is up, `Pool.recovering` sends it the calls that would be refused).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    """When a breaker opens and how long it stays open."""

    failures: int = 3
    cooldown: float = 5.0
    max_cooldown: float = 60.0


@dataclass
class CircuitBreaker:
    policy: BreakerPolicy = field(default_factory=BreakerPolicy)
    clock: Callable[[], float] = time.monotonic
    consecutive_failures: int = 0
    opened_at: float | None = None
    cooldown: float = 0.0
    trial_started: float | None = None
    times_opened: int = 0

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        if self.clock() - self.opened_at >= self.cooldown:
            return HALF_OPEN
        return OPEN

    def allows(self) -> bool:
        """Whether a new call may go to this endpoint now."""
        state = self.state
        if state != HALF_OPEN:
            return state == CLOSED
        # One trial at a time; a trial that never reported back (its client left) expires.
        return self.trial_started is None or self.clock() - self.trial_started >= self.policy.cooldown

    def on_start(self) -> None:
        if self.opened_at is not None and self.state == HALF_OPEN:
            self.trial_started = self.clock()

    def on_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        self.cooldown = 0.0
        self.trial_started = None

    def on_failure(self) -> bool:
        """Count a failed call; returns True when this failure opened the breaker."""
        self.consecutive_failures += 1
        if self.opened_at is not None:
            if self.state == HALF_OPEN:
                # The trial failed: open again, for longer.
                self.trial_started = None
                self._open(min(self.cooldown * 2, self.policy.max_cooldown))
                return True
            return False
        if self.consecutive_failures >= self.policy.failures:
            self._open(self.policy.cooldown)
            return True
        return False

    def trip(self) -> bool:
        """Open now, whatever the count (a hang seen for certain); True when this opened it."""
        if self.opened_at is None:
            self.consecutive_failures = max(self.consecutive_failures + 1, self.policy.failures)
            self._open(self.policy.cooldown)
            return True
        return self.on_failure()

    def reset(self) -> None:
        self.on_success()

    def _open(self, cooldown: float) -> None:
        self.opened_at = self.clock()
        self.cooldown = cooldown
        self.times_opened += 1
