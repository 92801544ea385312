"""One engine the router can call, with the state routing decisions read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["prefill", "decode"]


@dataclass(eq=False)
class Endpoint:
    """An engine's base URL, its role, and what the router knows of it right now.

    `healthy` starts optimistic so the first requests are not refused before the first probe;
    `probed_ok` says whether an active probe has ever seen it answer.
    """

    url: str
    role: Role
    in_flight: int = 0
    healthy: bool = True
    probed_ok: bool = False
    consecutive_failures: int = 0
    last_error: str | None = field(default=None, repr=False)

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

    @property
    def state(self) -> str:
        return "healthy" if self.healthy else "unhealthy"
