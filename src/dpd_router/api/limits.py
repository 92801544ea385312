"""Per-key rate limits: token buckets for requests per minute and prompt tokens per minute."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dpd_router.request.errors import RateLimit, RateLimited

if TYPE_CHECKING:
    from dpd_router.record.metrics import RouterMetrics

# Refusals counted where they happen, not by `count_refusal`: the gatekeeper counts its throttled
# addresses (auth_throttled).
COUNTED_ELSEWHERE: frozenset[RateLimit] = frozenset({"auth_failures"})


def worker_share(limit: int, workers: int) -> int:
    """One worker's part of a count limit kept per process (`workers` setting): rounded up, so the
    pod admits at least its limit and at most `workers - 1` more; 0 (no limit, or none allowed) stays 0."""
    return -(-limit // workers) if limit > 0 else limit


@dataclass
class TokenBucket:
    """`rate_per_minute` tokens refill continuously up to a burst of one minute's worth."""

    rate_per_minute: float
    clock: Callable[[], float] = time.monotonic
    level: float = field(init=False)
    updated: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = self.rate_per_minute
        self.updated = self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.rate_per_minute, self.level + (now - self.updated) * self.rate_per_minute / 60.0)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """The seconds until `amount` could be spent (0: now), spending nothing."""
        self._refill()
        if amount <= self.level:
            return 0.0
        return (min(amount, self.rate_per_minute) - self.level) * 60.0 / self.rate_per_minute

    def take(self, amount: float) -> float:
        """Spend `amount`; returns 0 when allowed, else the seconds until it would be."""
        self._refill()
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.rate_per_minute:
            # Larger than a full bucket: allowed only from a full bucket, leaving it in debt.
            if self.level >= self.rate_per_minute:
                self.level -= amount
                return 0.0
            return (self.rate_per_minute - self.level) * 60.0 / self.rate_per_minute
        return (amount - self.level) * 60.0 / self.rate_per_minute


class SharedBuckets(Protocol):
    """Token buckets every worker and replica spends from (`limits_store`; redis_limits.py)."""

    async def take(self, key: str, rate_per_minute: float, amount: float) -> float | None:
        """0 when spent, else the seconds until it could be; None when the store cannot say."""
        ...


@dataclass(frozen=True)
class SharedBudget:
    """One key's full per-minute rates, kept in the shared store under its key id."""

    store: SharedBuckets
    key_id: str
    requests_per_minute: float | None = None
    prompt_tokens_per_minute: float | None = None


@dataclass
class KeyLimits:
    """The buckets of one API key; None means unlimited.

    With a shared store, the key's full budget is spent there, once for the whole deployment; the
    process's own buckets (its share of the budget) decide only when the store cannot answer.
    """

    requests: TokenBucket | None = None
    prompt_tokens: TokenBucket | None = None
    shared: SharedBudget | None = None

    async def take_request(self) -> None:
        if self.requests is not None:
            wait = await self._take("requests", self.requests, 1)
            if wait:
                raise RateLimited("Requests per minute exceeded for this API key.", kind="requests", retry_after=wait)

    async def take_prompt_tokens(self, tokens: int) -> None:
        if self.prompt_tokens is not None:
            wait = await self._take("prompt_tokens", self.prompt_tokens, tokens)
            if wait:
                raise RateLimited(
                    f"Prompt tokens per minute exceeded for this API key ({tokens} tokens asked).",
                    kind="prompt_tokens",
                    retry_after=wait,
                )

    async def _take(self, kind: RateLimit, local: TokenBucket, amount: float) -> float:
        shared = self.shared
        if shared is not None:
            rate = shared.requests_per_minute if kind == "requests" else shared.prompt_tokens_per_minute
            if rate is not None:
                wait = await shared.store.take(f"{shared.key_id}:{kind}", rate, amount)
                if wait is not None:
                    return wait
        return local.take(amount)


def count_refusal(metrics: RouterMetrics, refusal: RateLimited) -> None:
    """The one place a per-key limit's refusal is counted (rate_limited, by the limit it names)."""
    if refusal.kind not in COUNTED_ELSEWHERE:
        metrics.rate_limited.labels(refusal.kind).inc()
