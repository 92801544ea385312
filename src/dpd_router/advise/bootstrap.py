"""Bootstrap confidence intervals for quantiles estimated from a histogram's buckets.

A scrape has only bucket counts, not the observations, so the resampling is of the counts: each
replicate draws the same number of observations over the buckets, multinomially with the observed
shares, and estimates the quantile from the new counts as `Histogram.quantile` does (Prometheus'
interpolation). The interval is the replicates' percentile interval. Each estimate has its own
random stream, seeded from `seed` and a name for what it measures, so the numbers are the same on
every run and do not shift when another arm or class is added to the scrape.

Python's `random` has no binomial draw before 3.12 (and numpy is not a dependency), so the
multinomial is drawn as a chain of binomials, each exact by inversion when its mean is small and
from the normal approximation (rounded, clamped) when it is large enough for that to be close.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from dpd_router.advise.histogram import Histogram

# Below this mean (n * min(p, 1 - p)) a binomial is drawn exactly, by inversion; above, the normal
# approximation's error is well inside the bootstrap's own.
EXACT_BINOMIAL_MEAN = 30.0
# Observations a quantile needs beyond it before its estimate counts as evidence: p95 needs 100, p99 500.
TAIL_OBSERVATIONS = 5


@dataclass
class Estimate:
    """A quantile with its bootstrap interval. `capped`: it lies in the +Inf bucket, so `value` is the
    highest finite bound and the truth is at least that. `enough`: `count` reaches `needed`."""

    value: float | None
    low: float | None
    high: float | None
    count: float
    needed: int
    capped: bool = False
    enough: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.enough = self.value is not None and self.count >= self.needed


def needed_observations(q: float, min_requests: int) -> int:
    """Observations a q-quantile needs to count: `min_requests`, and TAIL_OBSERVATIONS beyond the quantile."""
    return max(min_requests, math.ceil(TAIL_OBSERVATIONS / max(1.0 - q, 1e-9) - 1e-9))


def binomial(rng: random.Random, n: int, p: float) -> int:
    if n <= 0 or p <= 0.0:
        return 0
    if p >= 1.0:
        return n
    if p > 0.5:
        return n - binomial(rng, n, 1.0 - p)
    if n * p < EXACT_BINOMIAL_MEAN:
        q = 1.0 - p
        ratio = p / q
        probability = q**n  # of 0 successes; n * p < 30 keeps it far from underflow
        u = rng.random()
        x = 0
        while u > probability and x < n:
            u -= probability
            x += 1
            probability *= ratio * (n - x + 1) / x
        return x
    x = round(rng.gauss(n * p, math.sqrt(n * p * (1.0 - p))))
    return min(max(x, 0), n)


def multinomial(rng: random.Random, n: int, weights: Sequence[float]) -> list[int]:
    """n draws over len(weights) cells with probabilities proportional to the weights."""
    remaining_weight = float(sum(weights))
    remaining = n
    out = []
    for weight in weights:
        if remaining <= 0 or weight <= 0 or remaining_weight <= 0:
            out.append(0)
            continue
        draw = remaining if weight >= remaining_weight else binomial(rng, remaining, weight / remaining_weight)
        out.append(draw)
        remaining -= draw
        remaining_weight -= weight
    return out


def replicates(
    hist: Histogram, quantiles: Sequence[float], resamples: int, rng: random.Random, draws: int | None = None
) -> list[list[float]]:
    """Per quantile, its estimates over `resamples` multinomial resamplings of the histogram's bucket counts
    (one resampling serves every quantile); each draws `draws` observations (default: as many as observed)."""
    cells = [(lower, upper, count) for lower, upper, count in hist.buckets() if count > 0]
    n = round(sum(count for _, _, count in cells)) if draws is None else draws
    out: list[list[float]] = [[] for _ in quantiles]
    if n <= 0:
        return out
    weights = [count for _, _, count in cells]
    top = max((b for b in hist.bounds if not math.isinf(b)), default=math.nan)
    for _ in range(resamples):
        drawn = multinomial(rng, n, weights)
        for values, q in zip(out, quantiles, strict=True):
            values.append(_quantile(cells, drawn, q * n, top))
    return out


def _quantile(cells: Sequence[tuple[float, float, float]], drawn: Sequence[int], rank: float, top: float) -> float:
    """`Histogram.quantile` over resampled counts of the non-empty buckets (empty ones never hold a rank)."""
    below = 0
    for (lower, upper, _), count in zip(cells, drawn, strict=True):
        if count > 0 and below + count >= rank:
            return top if math.isinf(upper) else lower + (upper - lower) * (rank - below) / count
        below += count
    return cells[-1][1] if not math.isinf(cells[-1][1]) else top


def interval(values: Sequence[float], confidence: float) -> tuple[float | None, float | None]:
    """The percentile interval of bootstrap replicates (linear between order statistics)."""
    if not values:
        return None, None
    ordered = sorted(values)
    tail = (1.0 - confidence) / 2
    return _percentile(ordered, tail), _percentile(ordered, 1.0 - tail)


def _percentile(ordered: Sequence[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


@dataclass
class Bootstrap:
    """The resampling settings, and the seeded stream for each named estimate."""

    resamples: int = 1000
    confidence: float = 0.95
    seed: int = 0

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{name}")  # a str seed hashes the same on every run

    def estimate(
        self, hist: Histogram | None, q: float, needed: int, name: str, *, units: float | None = None
    ) -> tuple[Estimate, list[float]]:
        """The q-quantile of `hist` with its interval, and the replicates (for differences)."""
        [(estimate, values)] = self.estimates(hist, [(q, needed)], name, units=units)
        return estimate, values

    def estimates(
        self, hist: Histogram | None, quantiles: Sequence[tuple[float, int]], name: str, *, units: float | None = None
    ) -> list[tuple[Estimate, list[float]]]:
        """Several quantiles (q, observations needed) of `hist` from one set of resamplings.

        `units`: how many independent units the observations come from, when that is fewer (the streams
        an ITL histogram's gaps belong to: one stalled stream's gaps stall together). Each replicate then
        draws that many observations, so the interval is as wide as the units make it, and `count` and
        `needed` are in units."""
        if hist is None or hist.count <= 0 or (units is not None and units < 1):
            return [(Estimate(None, None, None, units or 0.0, needed), []) for _, needed in quantiles]
        draws = None if units is None or units >= hist.count else max(round(units), 1)
        drawn = replicates(hist, [q for q, _ in quantiles], self.resamples, self.rng(name), draws)
        count = hist.count if units is None else units
        out = []
        for (q, needed), values in zip(quantiles, drawn, strict=True):
            value, capped = hist.quantile(q)
            low, high = interval(values, self.confidence)
            out.append((Estimate(value, low, high, count, needed, capped), values))
        return out
