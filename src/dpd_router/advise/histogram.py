"""Prometheus histograms as a scrape gives them, and the estimates advise takes from their buckets."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


def parse_bound(text: str) -> float:
    return math.inf if text in ("+Inf", "Inf", "inf") else float(text)


@dataclass
class Histogram:
    """A Prometheus histogram: ascending upper bounds (the last is +Inf), cumulative counts, and the sum."""

    bounds: list[float]
    cumulative: list[float]
    sum: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def buckets(self) -> list[tuple[float, float, float]]:
        """(lower, upper, count) per bucket; the first bucket starts at 0."""
        out = []
        previous_bound, previous_count = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            out.append((previous_bound, bound, cumulative - previous_count))
            previous_bound, previous_count = bound, cumulative
        return out

    def quantile(self, q: float) -> tuple[float | None, bool]:
        """(estimate, capped) as Prometheus' histogram_quantile; capped when it falls in the +Inf bucket
        (then the estimate is the highest finite bound: the true value is at least that)."""
        if self.count <= 0:
            return None, False
        rank = q * self.count
        below = 0.0
        for lower, upper, count in self.buckets():
            if count > 0 and below + count >= rank:
                if math.isinf(upper):
                    finite = [b for b in self.bounds if not math.isinf(b)]
                    return (finite[-1] if finite else None), True
                return lower + (upper - lower) * (rank - below) / count, False
            below += count
        return None, False  # unreachable with consistent counts

    def count_above(self, x: float) -> float:
        """Observations greater than x: exact at a bound, linear inside a bucket, and all of the +Inf
        bucket when x is beyond the highest bound (an upper estimate)."""
        above = 0.0
        for lower, upper, count in self.buckets():
            if lower >= x:
                above += count
            elif upper > x:
                above += count if math.isinf(upper) else count * (upper - x) / (upper - lower)
        return above

    def sum_above(self, x: float) -> float:
        """The sum of the observations greater than x, estimated: each bucket's at its midpoint (the
        +Inf bucket's at whatever the exact sum leaves for it), scaled so the total is the exact sum."""
        parts: list[tuple[float, float, float, float]] = []  # (lower, upper, count, mean estimate)
        finite_total = 0.0
        inf_count = 0.0
        for lower, upper, count in self.buckets():
            if count <= 0:
                continue
            if math.isinf(upper):
                inf_count = count
                continue
            parts.append((lower, upper, count, (lower + upper) / 2))
            finite_total += count * (lower + upper) / 2
        if inf_count:
            top = max((b for b in self.bounds if not math.isinf(b)), default=0.0)
            parts.append((top, math.inf, inf_count, max(top, (self.sum - finite_total) / inf_count)))
        estimated_total = sum(count * mean for _, _, count, mean in parts)
        scale = self.sum / estimated_total if estimated_total > 0 else 0.0
        above = 0.0
        for lower, upper, count, mean in parts:
            # The +Inf bucket cut by x: its spread is unknown, so all of it, as count_above does.
            if lower >= x or math.isinf(upper):
                above += count * mean
            elif upper > x:  # a bucket cut by x: the part above it, uniformly spread
                share = (upper - x) / (upper - lower)
                above += count * share * (x + upper) / 2
        return above * scale


def combined(histograms: Iterable[Histogram]) -> Histogram:
    by_bound: dict[float, float] = defaultdict(float)
    total = 0.0
    for hist in histograms:
        for bound, cumulative in zip(hist.bounds, hist.cumulative, strict=True):
            by_bound[bound] += cumulative
        total += hist.sum
    if not by_bound:
        return Histogram([math.inf], [0.0], 0.0)
    bounds = sorted(by_bound)
    return Histogram(bounds, [by_bound[b] for b in bounds], total)
