"""Learned deadlines: how long a hop may take, judged by how long hops of its size have been taking.

A fixed timeout must allow for the longest legitimate call (minutes), so a hung engine holds every
request sent to it that long. A hop's learned deadline is `factor` times the time recent hops of
its size took (never below `floor`), capped by the fixed timeout; a hop past it is abandoned for
another engine, or for the decoder alone, long before the fixed timeout. Until `samples` hops of a
kind have completed, a prior from the hop's size says when the hop is first looked at, and only
an engine found hung (gateway/watch.py) cuts it short of the fixed timeout.

What a hop's size is, per kind of hop:
- a prefill hop: its uncached prompt tokens;
- a decode call's first token (streams): its uncached prompt tokens, learned apart for calls that
  carry staged KV (the decoder pulls it) and calls that compute the prompt (a prompt the decoder
  computes costs far more a token than one whose KV it pulls);
- a whole non-streamed answer: its uncached prompt tokens and its output tokens. vLLM sends the
  status line of a non-streamed answer only once the whole answer is ready, so that wait grows
  with the output; an answer in progress is judged by its `max_tokens`, the most it may produce.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from dpd_router.config import Settings

# Completed hops each estimate is drawn from: enough for the median to shrug off a few odd ones,
# few enough to follow the engines when their load changes.
WINDOW = 64

HopKind = Literal["prefill", "first_token", "answer"]

# Before there is history, the first look at a hop (gateway/watch.py) of `tokens` uncached prompt
# tokens comes after PRIOR_SECONDS plus the time an engine computing PRIOR_TOKENS_PER_SECOND takes
# (slower than any serving engine; a look at a live engine costs one probe, never the hop).
PRIOR_SECONDS = 4.0
PRIOR_TOKENS_PER_SECOND = 1000.0


def prior(tokens: int) -> float:
    """Seconds after which a hop of `tokens` prompt tokens with no history to judge it is looked at."""
    return PRIOR_SECONDS + max(tokens, 0) / PRIOR_TOKENS_PER_SECOND


@dataclass(frozen=True)
class DeadlinePolicy:
    """How far past its expected time a hop may run; `factor` 0 turns learned deadlines off."""

    factor: float = 4.0
    floor: float = 2.0
    samples: int = 20

    @classmethod
    def from_settings(cls, settings: Settings) -> DeadlinePolicy:
        return cls(settings.hop_deadline_factor, settings.hop_deadline_floor, settings.hop_deadline_samples)


class CostBound:
    """The expected seconds of a hop of a given size, from the recent completed hops of its kind.

    Each completed hop (size s_i, seconds t_i) bounds a hop of size S from above by
    t_i * max(1, S_j / s_ij over the size's dimensions): if a hop costs a fixed overhead plus a
    cost per unit of each dimension, scaling every part by that factor covers the new hop. The
    estimate is the median of these bounds, so a few hops slowed by something else do not move it.
    Scaling the overhead along errs long for hops larger than those seen, never short.
    """

    def __init__(self, window: int = WINDOW) -> None:
        self._seen: deque[tuple[tuple[int, ...], float]] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._seen)

    def learn(self, size: Sequence[int], seconds: float) -> None:
        if seconds >= 0:
            self._seen.append((tuple([max(part, 1) for part in size]), seconds))

    def expected(self, size: Sequence[int]) -> float | None:
        """The expected seconds of a hop of `size`; None before any hop was learned."""
        return expected_of(self._seen, size)

    def seen(self) -> Seen:
        """The hops learned so far, as they stand now (for an estimate made later: `expected_of`)."""
        return tuple(self._seen)


# A completed hop: its size (every dimension at least 1) and seconds; `Seen`, the hops of a window as they stood.
Hop = tuple[tuple[int, ...], float]
Seen = tuple[Hop, ...]


def expected_of(seen: Collection[Hop], size: Sequence[int]) -> float | None:
    """The expected seconds of a hop of `size` from the hops `seen` (CostBound's estimate); None for none."""
    if not seen:
        return None
    wanted = [max(part, 1) for part in size]
    # One comprehension per arity (hops have one or two dimensions): a generic loop over the dimensions cost
    # several times more.
    if len(wanted) == 1:
        (want,) = wanted
        bounds = [seconds if want <= have else seconds * want / have for (have,), seconds in seen]
    elif len(wanted) == 2:
        first, second = wanted
        bounds = [seconds * max(1.0, first / a, second / b) for (a, b), seconds in seen]
    else:
        bounds = [seconds * max(1.0, *(w / h for w, h in zip(wanted, had, strict=True))) for had, seconds in seen]
    return statistics.median(bounds)


class LearnedDeadline:
    """A hop's learned deadline from the hops learned when it started, worked out when first asked for.

    A hop's watch needs it only once the hop has run `policy.floor` seconds (no learned deadline is
    shorter), and most hops end long before: the median over the window (4 us a hop) is then never taken.
    Calling it gives what `HopDeadlines.deadline` gave when the hop started.
    """

    __slots__ = ("_cap", "_policy", "_seen", "_size")

    def __init__(self, seen: Seen, size: Sequence[int], policy: DeadlinePolicy, cap: float) -> None:
        self._seen, self._size, self._policy, self._cap = seen, size, policy, cap

    def __call__(self) -> float | None:
        """The deadline in seconds, when it is below the cap (None: the cap alone applies)."""
        expected = expected_of(self._seen, self._size)
        if expected is None:
            return None
        seconds = max(self._policy.floor, self._policy.factor * expected)
        return seconds if seconds < self._cap else None


class HopDeadlines:
    """The learned deadlines of one pool's hops, by kind (decode hops also by whether they carry KV)."""

    def __init__(self) -> None:
        self._bounds: dict[tuple[HopKind, bool], CostBound] = {}

    def learn(self, kind: HopKind, size: Sequence[int], seconds: float, *, with_kv: bool = False) -> None:
        self._bound(kind, with_kv).learn(size, seconds)

    def deadline(
        self, kind: HopKind, size: Sequence[int], policy: DeadlinePolicy, cap: float, *, with_kv: bool = False
    ) -> float | None:
        """Seconds a hop of `size` may take before it is abandoned, when that is below `cap`; None
        while too few hops are learned (or learned deadlines are off): then `cap` alone applies."""
        later = self.deadline_later(kind, size, policy, cap, with_kv=with_kv)
        return None if later is None else later()

    def deadline_later(
        self, kind: HopKind, size: Sequence[int], policy: DeadlinePolicy, cap: float, *, with_kv: bool = False
    ) -> LearnedDeadline | None:
        """`deadline`, from the hops learned by now, worked out when called; None where `deadline` is None
        for want of hops learned (or with learned deadlines off)."""
        bound = self._bound(kind, with_kv)
        if policy.factor <= 0 or len(bound) < policy.samples:
            return None
        return LearnedDeadline(bound.seen(), size, policy, cap)

    def _bound(self, kind: HopKind, with_kv: bool) -> CostBound:
        key = (kind, with_kv)
        bound = self._bounds.get(key)
        if bound is None:
            bound = self._bounds[key] = CostBound()
        return bound
