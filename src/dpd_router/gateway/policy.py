"""The value objects that bound a request's hops: how long each phase may take, how often a failed
hop is tried elsewhere, and when one decode call must have answered."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dpd_router.config import Settings
from dpd_router.gateway.deadlines import DeadlinePolicy
from dpd_router.gateway.watch import Bound, HopWatch


@dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds each phase of a request may take."""

    connect: float = 5.0
    prefill: float = 120.0
    first_token: float = 120.0
    idle: float = 120.0
    total: float = 600.0
    # Seconds an engine that seems stuck has to answer a one-token probe before it is taken for hung
    # (gateway/watch.py); 0: no probe, and before there is history the timeouts alone apply.
    hang_probe: float = 5.0
    # Shorter, learned bounds on the prefill hop and on a decoder's first byte (deadlines.py).
    learned: DeadlinePolicy = field(default_factory=DeadlinePolicy)

    @classmethod
    def from_settings(cls, settings: Settings) -> PhaseTimeouts:
        return cls(
            connect=settings.connect_timeout,
            prefill=settings.prefill_timeout,
            first_token=settings.first_token_timeout,
            idle=settings.idle_timeout,
            total=settings.request_timeout,
            hang_probe=settings.hang_probe_timeout,
            learned=DeadlinePolicy.from_settings(settings),
        )


@dataclass(frozen=True)
class RetryPolicy:
    """How many other engines a failed hop is retried on, and what a failed prefill pool means."""

    prefill_retries: int = 1
    decode_retries: int = 1
    prefill_failure_policy: str = "fallback"
    # Times a stream whose decoder failed after output is continued on another (gateway/resume.py), and
    # the most tokens (prompt and output) a stream keeps for it.
    stream_continuations: int = 1
    continuation_max_tokens: int = 131_072

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(
            settings.prefill_retries,
            settings.decode_retries,
            settings.prefill_failure_policy,
            settings.stream_continuations,
            settings.stream_continuation_max_tokens,
        )


@dataclass(frozen=True)
class Deadline:
    """When a decode call must have answered at the latest (a loop time: the phase's timeout, missed:
    the client gets 504), and the watch that may end it sooner: past a learned deadline with the decoder
    idle, or with the decoder hung (the decoder is then replaced)."""

    started: float
    at: float
    watch: HopWatch | None = None

    def bound(self) -> Bound:
        """The timeout scope of one wait of the call."""
        return Bound(self.watch, self.at)

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    @classmethod
    def fixed(cls, seconds: float) -> Deadline:
        """The phase's timeout alone, from now."""
        now = asyncio.get_running_loop().time()
        return cls(now, now + seconds)
