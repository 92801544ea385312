"""`dpd-router advise`: tune the routing threshold and the pool ratio from the router's own metrics.

It reads one or more `/metrics` scrapes of dpd-router (live with `--metrics URL`, or saved with
`--file FILE`; several routers are summed, and `--since FILE` / `--window SECONDS` subtract an
earlier scrape so that only the traffic in between counts) and answers the playbook's questions:

1. **Prompt-token distribution** (`dpd_router_prompt_tokens{path}`, all paths summed): count,
   mean (exact, from `_sum`/`_count`) and percentiles estimated from the histogram buckets the way
   Prometheus' `histogram_quantile` does (linear inside a bucket; a percentile in the `+Inf`
   bucket is reported as the highest finite bound, marked `>=`).
2. **Share of traffic above candidate thresholds** (512 ... 32768 tokens by default): requests with
   more than T tokens (exact when T is a bucket bound, interpolated otherwise) and the share of
   prompt tokens they carry (estimated: each bucket's requests at the bucket's midpoint, scaled so
   the total matches the exact `_sum`).
3. **TTFT by prompt length and path** (`dpd_router_ttft_by_prompt_length_seconds{path,prompt_tokens}`,
   whose label is the bucket's upper bound in tokens): per bucket and path the request count, the
   mean (exact) and p50/p90 (estimated from the latency buckets).
4. **Recommended threshold**, the crossover where the disaggregated path's TTFT stops losing to the
   direct path's:

   - A prompt-length bucket is *comparable* when both paths have at least `--min-requests`
     requests in it; otherwise it is "not enough evidence" and takes no part in the decision.
   - In a comparable bucket the disaggregated path *does not lose* when its TTFT statistic
     (`--statistic`, the mean by default) is at most the direct path's times `1 + --tolerance`
     (5% by default: a tie goes to disaggregation, which also takes the prefill off the decoders
     and so protects their inter-token latency).
   - The crossover bucket is the lowest comparable bucket from which the disaggregated path does not
     lose in *every* comparable bucket above it. The recommended threshold is that bucket's lower
     edge (the previous bucket's bound): "disaggregated wins above 2k tokens" gives 2048.
   - If the disaggregated path loses in the highest comparable bucket, there is no crossover in the
     evidence: keep those prompts direct, raising the threshold to at least that bucket's bound.
   - Fallback when no bucket is comparable (the usual case with one static threshold, since each
     length then takes one path only): if each path has at least two buckets with enough requests,
     fit TTFT = a + b * tokens per path (weighted by requests, at each bucket's midpoint) and take
     the crossing point, rounded to the nearest bucket bound (log scale), marked "extrapolated".
     A crossing outside the measured lengths, or fewer buckets, gives no recommendation ("not
     enough evidence"), with how to collect it: move the threshold for a while (both paths then
     see the same lengths), or run one router replica with another threshold and advise on both.

5. **Recommended prefill:decode ratio**: the work each pool does, in engine-seconds, from the token
   counters and per-engine capacities (`--prefill-rate`, prompt tokens/s of one prefill engine;
   `--decode-rate`, output tokens/s of one decode engine at your ITL target; the defaults are an
   8B model on one H100, measure yours as deploy/README.md "Sizing the pools" says):

       prefill work = disaggregated prompt tokens / prefill rate
       decode work  = output tokens (all paths) / decode rate + direct prompt tokens / prefill rate

   (decoders prefill the direct path's prompts themselves). The ratio of the two, as small integers
   and split over the engines the router has now, is the recommendation, computed both at the
   current threshold (exact token sums) and at the recommended one (prompt tokens above it
   estimated from the histogram). It is then checked against the pools' scraped load
   (`dpd_router_endpoint_load{signal=waiting|kv_cache_usage}`, a snapshot): when one pool has
   requests waiting (>= 1 per engine, or decoders' KV cache >= 90% full) and the other has none
   (< 0.5 per engine), and the demand ratio would not move an engine towards the queueing pool,
   one engine is moved towards it, and the output says so.

6. **Adaptive threshold** (routers in `threshold_mode: adaptive`): each router's effective threshold
   per decoder at that decoder's load when scraped (`dpd_router_adaptive_threshold_tokens`) and the
   costs it learned (`dpd_router_adaptive_cost`: overhead, time per token and observations per model
   and endpoint; the ITL budget's gaps). The routing decisions table (`route_decisions_total`) gives
   its decisions by reason.

The output is plain-text tables with the evidence (or `--json`), and `--plot FILE` writes a PNG of
TTFT per path against prompt length with the distribution and the threshold marked (matplotlib, the
`bench` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from dpd_router.metrics import PREFIX, PROMPT_LENGTH_BOUNDS

PATHS = ("direct", "disaggregated")
DEFAULT_CANDIDATES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
PROMPT_QUANTILES = (0.5, 0.75, 0.9, 0.95, 0.99)
DEFAULT_MIN_REQUESTS = 20
DEFAULT_TOLERANCE = 0.05
# One prefill engine's prompt tokens/s and one decode engine's output tokens/s: Llama-3.1-8B on an H100.
DEFAULT_PREFILL_RATE = 12000.0
DEFAULT_DECODE_RATE = 3000.0
STATISTICS = ("mean", "p50", "p90")
# The load check: a pool "queues" at this many waiting requests per engine, is "idle" below the other.
QUEUEING_WAITING = 1.0
IDLE_WAITING = 0.5
KV_CACHE_FULL = 0.9

PLOT_INSTALL_HINT = "pip install 'dpd-router[bench]'  (or: pip install matplotlib)"


class AdviseError(Exception):
    """The scrapes could not be read or combined; the message says why."""


# --------------------------------------------------------------------------------------------- scrapes

LabelItems = tuple[tuple[str, str], ...]
SampleKey = tuple[str, LabelItems]


@dataclass
class Scrape:
    """The dpd_router_* samples of one or more scrapes: cumulative ones (counters, histograms) and gauges
    (one value per router scraped, since summing them is right for some and wrong for others)."""

    cumulative: dict[SampleKey, float] = field(default_factory=dict)
    gauges: dict[SampleKey, list[float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        scrape = cls()
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as exc:  # the parser raises ValueError and friends on bad text
            raise AdviseError(f"not Prometheus text exposition: {exc}") from None
        for family in families:
            if not family.name.startswith(PREFIX):
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if family.type in ("counter", "histogram", "summary"):
                    scrape.cumulative[key] = float(sample.value)
                else:
                    scrape.gauges[key] = [float(sample.value)]
        return scrape

    @property
    def empty(self) -> bool:
        return not self.cumulative and not self.gauges

    def plus(self, other: Scrape) -> Scrape:
        """Several routers' scrapes together: cumulative series add up, gauges keep every router's value."""
        out = Scrape(dict(self.cumulative), {k: list(v) for k, v in self.gauges.items()})
        for key, value in other.cumulative.items():
            out.cumulative[key] = out.cumulative.get(key, 0.0) + value
        for key, values in other.gauges.items():
            out.gauges.setdefault(key, []).extend(values)
        return out

    def minus(self, earlier: Scrape) -> Scrape:
        """The traffic between `earlier` and this scrape of the same router(s); gauges are this scrape's."""
        out = Scrape({}, {k: list(v) for k, v in self.gauges.items()})
        for key, value in self.cumulative.items():
            before = earlier.cumulative.get(key, 0.0)
            if value < before - 1e-6:
                raise AdviseError(
                    f"{key[0]}{dict(key[1])} went down between the scrapes ({before:g} -> {value:g}): the router "
                    "restarted in between, or the scrapes are in the wrong order (--since takes the earlier one)"
                )
            out.cumulative[key] = value - before
        missing = [key for key in earlier.cumulative if key not in self.cumulative and earlier.cumulative[key] > 0]
        if missing:
            name, labels = missing[0]
            raise AdviseError(f"{name}{dict(labels)} is in the earlier scrape but not in the later one")
        return out

    def counters(self, name: str, by: Sequence[str]) -> dict[tuple[str, ...], float]:
        """A counter's values summed by the labels `by`."""
        totals: dict[tuple[str, ...], float] = defaultdict(float)
        for (sample, labels), value in self.cumulative.items():
            if sample == name:
                found = dict(labels)
                totals[tuple(found.get(label, "") for label in by)] += value
        return dict(totals)

    def gauge_values(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [
            (dict(labels), value)
            for (sample, labels), values in self.gauges.items()
            if sample == name
            for value in values
        ]

    def histograms(self, name: str, by: Sequence[str] = ()) -> dict[tuple[str, ...], Histogram]:
        """A histogram's series summed by the labels `by` (every other label summed over)."""
        buckets: dict[tuple[str, ...], dict[float, float]] = defaultdict(lambda: defaultdict(float))
        sums: dict[tuple[str, ...], float] = defaultdict(float)
        for (sample, labels), value in self.cumulative.items():
            found = dict(labels)
            group = tuple(found.get(label, "") for label in by)
            if sample == f"{name}_bucket":
                buckets[group][_bound(found.get("le", "+Inf"))] += value
            elif sample == f"{name}_sum":
                sums[group] += value
        out = {}
        for group, by_bound in buckets.items():
            bounds = sorted(by_bound)
            out[group] = Histogram(bounds, [by_bound[b] for b in bounds], sums.get(group, 0.0))
        return out

    def histogram(self, name: str) -> Histogram:
        return self.histograms(name).get((), Histogram([math.inf], [0.0], 0.0))


def _bound(text: str) -> float:
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


# ------------------------------------------------------------------------------------------- the report


@dataclass
class PathStats:
    requests: int
    mean: float | None
    p50: float | None
    p90: float | None
    p90_capped: bool = False

    def statistic(self, name: str) -> float | None:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90}[name]


@dataclass
class LengthBucket:
    """One prompt-length bucket of the TTFT-by-prompt-length histogram, both paths side by side."""

    label: str  # the metric's prompt_tokens label: the bucket's upper bound, or +Inf
    lower: int  # prompts of more than `lower` tokens ...
    upper: int | None  # ... and at most `upper` (None: no upper bound)
    direct: PathStats
    disaggregated: PathStats
    comparable: bool
    faster: str | None  # "direct", "disaggregated" (not losing, within the tolerance) or None
    note: str

    @property
    def span(self) -> str:
        if self.upper is None:
            return f">{self.lower}"
        return f"{self.lower + 1}-{self.upper}" if self.lower else f"1-{self.upper}"


@dataclass
class Recommendation:
    threshold: int | None
    current: int | None
    verdict: str  # crossover | disaggregate_more | keep_direct | not_enough_evidence
    basis: str  # measured | extrapolated | none
    action: str  # lower | raise | keep | none
    summary: str
    rule: str
    evidence: list[str] = field(default_factory=list)
    crossover_bucket: str | None = None
    estimated_crossover_tokens: float | None = None


@dataclass
class PoolLoad:
    engines: int
    waiting_per_engine: float | None
    running_per_engine: float | None
    kv_cache_usage: float | None
    router_in_flight_per_engine: float | None


@dataclass
class RatioAdvice:
    prefill_rate: float
    decode_rate: float
    prefill_prompt_tokens: float
    direct_prompt_tokens: float
    output_tokens: float
    prefill_work: float  # engine-seconds
    decode_work: float
    ratio: float | None  # prefill work / decode work
    recommended: str | None  # "p:d"
    split: dict[str, int] | None  # over the engines the router has now
    current: str | None
    at_recommended_threshold: dict[str, Any] | None
    load: dict[str, PoolLoad]
    load_check: str
    heuristic: str


@dataclass
class Report:
    sources: list[str]
    requests: dict[str, float]
    thresholds: list[int]
    prompt_tokens: dict[str, Any]
    shares: list[dict[str, Any]]
    ttft: list[LengthBucket]
    ttft_by_path: dict[str, PathStats]
    phases: dict[str, dict[str, float | None]]
    decisions: list[dict[str, Any]]
    recommendation: Recommendation
    ratio: RatioAdvice
    warnings: list[str]
    settings: dict[str, Any]
    # threshold_mode adaptive: each router's effective threshold per decoder at its load when scraped, and
    # the costs it learned (empty for static routers)
    adaptive: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row, bucket in zip(data["ttft"], self.ttft, strict=True):
            row["span"] = bucket.span
        safe: dict[str, Any] = _json_safe(data)
        return safe


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


@dataclass
class Options:
    min_requests: int = DEFAULT_MIN_REQUESTS
    tolerance: float = DEFAULT_TOLERANCE
    statistic: str = "mean"
    candidates: Sequence[int] = DEFAULT_CANDIDATES
    prefill_rate: float = DEFAULT_PREFILL_RATE
    decode_rate: float = DEFAULT_DECODE_RATE


def analyse(scrape: Scrape, options: Options | None = None, sources: Sequence[str] = ()) -> Report:
    """The whole report from a (possibly combined or differenced) scrape."""
    opts = options or Options()
    if opts.statistic not in STATISTICS:
        raise AdviseError(f"statistic must be one of {', '.join(STATISTICS)}")
    warnings: list[str] = []
    thresholds = sorted({int(v) for _, v in scrape.gauge_values(f"{PREFIX}_routing_threshold_tokens") if v == v})
    current = thresholds[0] if len(thresholds) == 1 else None
    if len(thresholds) > 1:
        warnings.append(f"the routers scraped run different thresholds ({', '.join(map(str, thresholds))})")

    requests = {path: 0.0 for path in PATHS}
    for (path, _), value in scrape.counters(f"{PREFIX}_requests_total", ("path", "outcome")).items():
        requests[path] = requests.get(path, 0.0) + value

    prompt_by_path = scrape.histograms(f"{PREFIX}_prompt_tokens", ("path",))
    prompt_all = _combined(prompt_by_path.values())
    prompt_summary = _prompt_summary(prompt_all, prompt_by_path)
    shares = _shares(prompt_all, opts.candidates, current)

    rows = _length_buckets(scrape, opts)
    ttft_by_path = {
        path: _path_stats(hist)
        for (path,), hist in scrape.histograms(f"{PREFIX}_time_to_first_token_seconds", ("path",)).items()
    }
    phases = _phases(scrape)
    decisions = [
        {"path": path, "reason": reason, "requests": value}
        for (path, reason), value in sorted(
            scrape.counters(f"{PREFIX}_route_decisions_total", ("path", "reason")).items()
        )
        if value > 0
    ]
    recommendation = recommend(rows, opts, current)
    ratio = _ratio(scrape, prompt_by_path, prompt_all, opts, recommendation.threshold)
    adaptive = _adaptive(scrape)

    if prompt_all.count == 0:
        warnings.append("no requests in the scrape (or between the scrapes): nothing to advise on yet")
    elif not rows:
        warnings.append(
            f"no {PREFIX}_ttft_by_prompt_length_seconds samples (a router older than this advise?): TTFT by prompt "
            "length, and so the threshold, cannot be judged"
        )
    ineffective = sum(scrape.counters(f"{PREFIX}_kv_transfer_ineffective_total", ()).values())
    disaggregated = requests.get("disaggregated", 0.0)
    if ineffective > 0:
        share = f" ({ineffective / disaggregated:.0%} of disaggregated requests)" if disaggregated else ""
        warnings.append(
            f"{ineffective:g} disaggregated requests recomputed their prompt on the decoder{share}: the KV transfer "
            "is not working for them, so the disaggregated TTFT here is pessimistic; fix the KV connector first"
        )
    fallbacks = sum(scrape.counters(f"{PREFIX}_prefill_fallbacks_total", ("reason",)).values())
    if fallbacks > 0:
        warnings.append(
            f"{fallbacks:g} prefill hops failed and were served by the decoder alone: they count on the direct "
            "path with the failed hop's time in their TTFT"
        )
    diverted = sum(
        value
        for (path, reason), value in scrape.counters(f"{PREFIX}_route_decisions_total", ("path", "reason")).items()
        if path == "direct" and reason in ("cached_on_decoder", "prefill_pool_busy", "prefill_pool_down")
    )
    if diverted > 0:
        warnings.append(
            f"{diverted:g} long prompts went direct for another reason (cached on the decoder, prefill pool busy or "
            "down; see the decisions table): they are part of the direct path's TTFT above the threshold"
        )
    return Report(
        sources=list(sources),
        requests=requests,
        thresholds=thresholds,
        prompt_tokens=prompt_summary,
        shares=shares,
        ttft=rows,
        ttft_by_path=ttft_by_path,
        phases=phases,
        decisions=decisions,
        recommendation=recommendation,
        ratio=ratio,
        warnings=warnings,
        settings=asdict(opts) | {"candidates": list(opts.candidates)},
        adaptive=adaptive,
    )


def _adaptive(scrape: Scrape) -> dict[str, list[dict[str, Any]]]:
    """Adaptive mode's evidence as scraped: the effective threshold per decoder (one row per router) and
    the learned costs, one row per (model, endpoint) and router with its terms."""
    thresholds = [
        {"decoder": labels.get("decoder", ""), "tokens": value}
        for labels, value in sorted(
            scrape.gauge_values(f"{PREFIX}_adaptive_threshold_tokens"), key=lambda lv: lv[0].get("decoder", "")
        )
    ]
    grouped: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    for (sample, labels), values in sorted(scrape.gauges.items()):
        if sample != f"{PREFIX}_adaptive_cost":
            continue
        found = dict(labels)
        rows = grouped[(found.get("model", ""), found.get("endpoint", ""))]
        rows.extend({} for _ in range(len(values) - len(rows)))  # one row per router scraped
        for row, value in zip(rows, values, strict=False):
            row[found.get("term", "")] = value
    costs = [
        {"model": model, "endpoint": endpoint, "terms": terms}
        for (model, endpoint), rows in sorted(grouped.items())
        for terms in rows
    ]
    if not thresholds and not costs:
        return {}
    return {"thresholds": thresholds, "costs": costs}


def _threshold_text(tokens: float) -> str:
    if math.isnan(tokens):
        return "-"
    return "never (keeps every prompt)" if math.isinf(tokens) else f"{tokens:,.0f} tokens"


def _cost_text(model: str, terms: dict[str, float]) -> str:
    if model == "itl_budget":
        return (
            f"{terms.get('recent_gaps', 0):,.0f} recent inter-token gaps, {terms.get('late_gaps', 0):,.1f} late "
            f"({terms.get('late_share', 0):.2%})"
        )
    return (
        f"{terms.get('overhead_seconds', 0) * 1000:,.1f} ms + {terms.get('seconds_per_token', 0) * 1e6:,.1f} us/token "
        f"({terms.get('observations', 0):,.0f} observations)"
    )


def _combined(histograms: Iterable[Histogram]) -> Histogram:
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


def _prompt_summary(prompt_all: Histogram, by_path: dict[tuple[str, ...], Histogram]) -> dict[str, Any]:
    percentiles = {}
    for q in PROMPT_QUANTILES:
        value, capped = prompt_all.quantile(q)
        percentiles[f"p{round(q * 100)}"] = {"tokens": value, "at_least": capped}
    return {
        "requests": prompt_all.count,
        "mean": prompt_all.mean,
        "percentiles": percentiles,
        "by_path": {path: {"requests": h.count, "mean": h.mean} for (path,), h in sorted(by_path.items())},
    }


def _shares(prompt_all: Histogram, candidates: Sequence[int], current: int | None) -> list[dict[str, Any]]:
    rows = []
    total, tokens = prompt_all.count, prompt_all.sum
    for threshold in sorted(set(candidates) | ({current} if current else set())):
        above = prompt_all.count_above(threshold)
        rows.append(
            {
                "threshold": threshold,
                "current": threshold == current,
                "requests_above": above,
                "share_of_requests": above / total if total else None,
                "share_of_prompt_tokens": prompt_all.sum_above(threshold) / tokens if tokens else None,
            }
        )
    return rows


def _path_stats(hist: Histogram | None) -> PathStats:
    if hist is None or hist.count <= 0:
        return PathStats(0, None, None, None)
    p50, _ = hist.quantile(0.5)
    p90, capped = hist.quantile(0.9)
    return PathStats(round(hist.count), hist.mean, p50, p90, capped)


def _length_buckets(scrape: Scrape, opts: Options) -> list[LengthBucket]:
    by = scrape.histograms(f"{PREFIX}_ttft_by_prompt_length_seconds", ("path", "prompt_tokens"))
    labels = {label for (_, label) in by}
    finite = sorted({int(_bound(label)) for label in labels if label != "+Inf"} | set(PROMPT_LENGTH_BOUNDS))
    rows = []
    for label in sorted(labels, key=_bound):
        bound = _bound(label)
        upper = None if math.isinf(bound) else int(bound)
        below = [b for b in finite if upper is None or b < upper]
        lower = below[-1] if below else 0
        direct = _path_stats(by.get(("direct", label)))
        disaggregated = _path_stats(by.get(("disaggregated", label)))
        short = [
            f"{path} {stats.requests} < {opts.min_requests}"
            for path, stats in (("direct", direct), ("disaggregated", disaggregated))
            if stats.requests < opts.min_requests
        ]
        faster: str | None = None
        if short:
            note = "not enough evidence: " + ", ".join(short) + " requests"
        else:
            d, g = direct.statistic(opts.statistic), disaggregated.statistic(opts.statistic)
            assert d is not None and g is not None
            faster = "disaggregated" if g <= d * (1 + opts.tolerance) else "direct"
            delta = (g - d) / d if d > 0 else 0.0
            note = f"disaggregated {delta:+.0%} vs direct ({opts.statistic})"
        rows.append(LengthBucket(label, lower, upper, direct, disaggregated, not short, faster, note))
    return rows


RULE = (
    "A prompt-length bucket counts when both paths have at least {min} requests in it. There the "
    "disaggregated path does not lose when its TTFT {stat} is at most {tol:.0%} above the direct path's. "
    "The threshold is the lower edge of the lowest counting bucket from which the disaggregated path does "
    "not lose in every counting bucket above; if it loses in the highest, keep those prompts direct. "
    "Without any counting bucket: the crossing of straight-line fits of TTFT against prompt length per "
    "path (extrapolated), else no recommendation."
)


def recommend(rows: Sequence[LengthBucket], opts: Options, current: int | None) -> Recommendation:
    """The threshold rule (see the module docstring) over the TTFT-by-prompt-length buckets."""
    rule = RULE.format(min=opts.min_requests, stat=opts.statistic, tol=opts.tolerance)
    comparable = [row for row in rows if row.comparable]
    if comparable:
        return _measured(comparable, opts.statistic, rule, current)
    extrapolated = _extrapolated(rows, opts, rule, current)
    if extrapolated is not None:
        return extrapolated
    evidence = _evidence_counts(rows)
    return Recommendation(
        threshold=None,
        current=current,
        verdict="not_enough_evidence",
        basis="none",
        action="none",
        summary=(
            "Not enough evidence to recommend a threshold: no prompt-length bucket has at least "
            f"{opts.min_requests} requests on both paths, and the paths' own buckets do not support an "
            f"extrapolation. Keep the current threshold{f' ({current})' if current else ''}. To collect evidence, "
            "move the threshold for a while without restarting the router (both paths then serve prompts of the "
            "same lengths), or run a second router with another threshold against the same engines and pass "
            "both to --metrics."
        ),
        rule=rule,
        evidence=evidence,
    )


def _action(threshold: int, current: int | None) -> str:
    if current is None:
        return "none"
    return "lower" if threshold < current else "raise" if threshold > current else "keep"


def _verb(action: str, threshold: int) -> str:
    return {
        "lower": f"lower routing_threshold to {threshold}",
        "raise": f"raise routing_threshold to {threshold}",
        "keep": f"keep routing_threshold at {threshold}",
        "none": f"set routing_threshold to {threshold}",
    }[action]


def _row_evidence(row: LengthBucket, stat: str) -> str:
    d, g = row.direct.statistic(stat), row.disaggregated.statistic(stat)
    return (
        f"{row.span} tokens: direct {_seconds(d)} (n={row.direct.requests}), disaggregated {_seconds(g)} "
        f"(n={row.disaggregated.requests}) -> {row.faster}"
    )


def _measured(comparable: list[LengthBucket], stat: str, rule: str, current: int | None) -> Recommendation:
    start = len(comparable)
    while start > 0 and comparable[start - 1].faster == "disaggregated":
        start -= 1
    evidence = [_row_evidence(row, stat) for row in comparable]
    if start == len(comparable):  # direct wins the highest bucket with evidence
        top = comparable[-1]
        bound = top.upper if top.upper is not None else top.lower
        threshold = bound if current is None else max(bound, current)
        action = _action(threshold, current)
        keep = "keep it there" if action == "keep" else f"raise the threshold to at least {threshold}"
        return Recommendation(
            threshold=threshold,
            current=current,
            verdict="keep_direct",
            basis="measured",
            action=action,
            summary=(
                f"The direct path is faster up to the longest prompts with evidence ({top.span} tokens): keep these "
                f"prompts direct; {keep}. Disaggregation has not shown a TTFT gain at any measured length."
            ),
            rule=rule,
            evidence=evidence,
            crossover_bucket=None,
        )
    first = comparable[start]
    threshold = max(first.lower, 1)
    action = _action(threshold, current)
    below = comparable[:start]
    if below:
        verdict = "crossover"
        why = (
            f"from the {first.span} bucket up the disaggregated path's TTFT is not worse than the direct path's in "
            f"every bucket with evidence, and the direct path is faster in the {below[-1].span} bucket"
        )
    else:
        verdict = "disaggregate_more"
        why = (
            f"the disaggregated path's TTFT is not worse than the direct path's in every bucket with evidence, down "
            f"to the lowest ({first.span} tokens); the crossover may be lower still, where there is no evidence yet"
        )
    odd = [row.span for row in below if row.faster == "disaggregated"]
    if odd:
        evidence.append(f"ignored: disaggregated also wins in {', '.join(odd)} but loses above it (noise, or load)")
    return Recommendation(
        threshold=threshold,
        current=current,
        verdict=verdict,
        basis="measured",
        action=action,
        summary=f"{_verb(action, threshold).capitalize()}: {why}.",
        rule=rule,
        evidence=evidence,
        crossover_bucket=first.label,
    )


def _evidence_counts(rows: Sequence[LengthBucket]) -> list[str]:
    return [
        f"{row.span} tokens: direct n={row.direct.requests}, disaggregated n={row.disaggregated.requests}"
        for row in rows
    ]


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Weighted least squares y = a + b x over (x, y, weight); None without two distinct x."""
    if len({x for x, _, _ in points}) < 2:
        return None
    w = sum(p[2] for p in points)
    mx = sum(x * wt for x, _, wt in points) / w
    my = sum(y * wt for _, y, wt in points) / w
    sxx = sum(wt * (x - mx) ** 2 for x, _, wt in points)
    sxy = sum(wt * (x - mx) * (y - my) for x, y, wt in points)
    b = sxy / sxx
    return my - b * mx, b


def _extrapolated(rows: Sequence[LengthBucket], opts: Options, rule: str, current: int | None) -> Recommendation | None:
    points: dict[str, list[tuple[float, float, float]]] = {path: [] for path in PATHS}
    for row in rows:
        if row.upper is None:
            continue
        midpoint = (row.lower + row.upper) / 2
        for path in PATHS:
            stats: PathStats = getattr(row, path)
            value = stats.statistic(opts.statistic)
            if stats.requests >= opts.min_requests and value is not None:
                points[path].append((midpoint, value, stats.requests))
    fits = {path: _fit(points[path]) for path in PATHS}
    direct, disaggregated = fits["direct"], fits["disaggregated"]
    if direct is None or disaggregated is None:
        return None
    (a_d, b_d), (a_g, b_g) = direct, disaggregated
    measured = [x for path in PATHS for x, _, _ in points[path]]
    low, high = min(measured), max(measured)
    evidence = [
        f"direct: TTFT {opts.statistic} = {a_d:.4f} s + {b_d * 1000:.4f} ms/token over {len(points['direct'])} buckets",
        f"disaggregated: TTFT {opts.statistic} = {a_g:.4f} s + {b_g * 1000:.4f} ms/token over "
        f"{len(points['disaggregated'])} buckets",
    ]
    if b_d <= b_g:
        return None  # the direct path's TTFT does not grow faster: the lines give no crossover to trust
    crossing = (a_g - a_d) / (b_d - b_g)
    evidence.append(f"the lines cross at about {crossing:.0f} tokens (measured lengths: {low:.0f}-{high:.0f})")
    if not low / 2 <= crossing <= high * 2:
        return Recommendation(
            threshold=None,
            current=current,
            verdict="not_enough_evidence",
            basis="none",
            action="none",
            summary=(
                f"Not enough evidence: no bucket has enough requests on both paths, and the straight-line fits cross "
                f"at about {crossing:.0f} tokens, outside the measured prompt lengths ({low:.0f}-{high:.0f}). Keep the "
                f"current threshold{f' ({current})' if current else ''} and collect evidence on both paths around it."
            ),
            rule=rule,
            evidence=evidence,
            estimated_crossover_tokens=crossing,
        )
    threshold = min(PROMPT_LENGTH_BOUNDS, key=lambda b: abs(math.log2(b) - math.log2(max(crossing, 1.0))))
    action = _action(threshold, current)
    return Recommendation(
        threshold=threshold,
        current=current,
        verdict="crossover",
        basis="extrapolated",
        action=action,
        summary=(
            f"{_verb(action, threshold).capitalize()} (extrapolated): no bucket has enough requests on both paths, "
            f"so TTFT was fitted against prompt length per path; the fits cross at about {crossing:.0f} tokens, "
            f"and {threshold} is the nearest bucket bound. Confirm it by moving the threshold for a while, so that "
            "both paths serve prompts of the same lengths, and run advise again."
        ),
        rule=rule,
        evidence=evidence,
        estimated_crossover_tokens=crossing,
    )


def _phases(scrape: Scrape) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for (path, phase), hist in sorted(scrape.histograms(f"{PREFIX}_phase_seconds", ("path", "phase")).items()):
        out.setdefault(path, {})[phase] = hist.mean
    return out


# ---------------------------------------------------------------------------------------------- the ratio

RATIO_HEURISTIC = (
    "prefill work = disaggregated prompt tokens / prefill rate; decode work = output tokens / decode rate + "
    "direct prompt tokens / prefill rate (decoders prefill the direct prompts themselves); ratio = prefill work / "
    "decode work, as small integers and split over the engines the router has now. Rates are one engine's "
    "capacity (--prefill-rate {p:g} prompt tokens/s, --decode-rate {d:g} output tokens/s): measure yours. "
    "Then the scraped load: a pool with requests waiting (>= {q:g} per engine, or decoders' KV cache >= {kv:.0%}) "
    "while the other has none (< {i:g}) gets one engine more than the token counts alone give."
)


def _simple_ratio(ratio: float) -> str:
    """p:d in small integers closest to `ratio` on a log scale (ties: fewer engines)."""
    if ratio <= 0:
        return "0:1"
    candidates = {(p, d) for p in range(1, 5) for d in range(1, 5)}
    candidates |= {(n, 1) for n in range(1, 17)} | {(1, n) for n in range(1, 17)}
    p, d = min(candidates, key=lambda c: (round(abs(math.log(c[0] / c[1]) - math.log(ratio)), 9), c[0] + c[1]))
    return f"{p}:{d}"


def _split(ratio: float, engines: int) -> dict[str, int]:
    if engines < 2:
        return {"prefill": 0 if ratio <= 0 else 1, "decode": max(engines, 1)}
    if ratio <= 0:
        return {"prefill": 0, "decode": engines}
    prefill = min(max(round(engines * ratio / (1 + ratio)), 1), engines - 1)
    return {"prefill": prefill, "decode": engines - prefill}


def _pool_loads(scrape: Scrape) -> dict[str, PoolLoad]:
    endpoints: dict[str, set[str]] = defaultdict(set)
    signals: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    in_flight: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for labels, value in scrape.gauge_values(f"{PREFIX}_endpoint_load"):
        role, endpoint = labels.get("role", ""), labels.get("endpoint", "")
        endpoints[role].add(endpoint)
        if value == value:  # NaN: not scraped yet, or the engine lacks the signal
            signals[(role, labels.get("signal", ""))][endpoint].append(value)
    for name in (f"{PREFIX}_endpoint_in_flight_requests", f"{PREFIX}_endpoint_healthy"):
        for labels, value in scrape.gauge_values(name):
            role, endpoint = labels.get("role", ""), labels.get("endpoint", "")
            endpoints[role].add(endpoint)
            if name.endswith("in_flight_requests"):
                in_flight[role][endpoint] += value  # every router's open calls to that engine

    def per_engine(role: str, signal: str) -> float | None:
        # Several routers scrape the same engine: average their readings, then the engines'.
        readings = [sum(values) / len(values) for values in signals[(role, signal)].values() if values]
        return sum(readings) / len(readings) if readings else None

    out = {}
    for role in ("prefill", "decode"):
        count = len(endpoints.get(role, ()))
        flights = list(in_flight[role].values())
        out[role] = PoolLoad(
            engines=count,
            waiting_per_engine=per_engine(role, "waiting"),
            running_per_engine=per_engine(role, "running"),
            kv_cache_usage=per_engine(role, "kv_cache_usage"),
            router_in_flight_per_engine=sum(flights) / len(flights) if flights else None,
        )
    return out


def _queueing(load: PoolLoad, role: str) -> bool:
    waiting = load.waiting_per_engine or 0.0
    full = role == "decode" and (load.kv_cache_usage or 0.0) >= KV_CACHE_FULL
    return waiting >= QUEUEING_WAITING or full


def _idle(load: PoolLoad) -> bool:
    return load.engines > 0 and (load.waiting_per_engine or 0.0) < IDLE_WAITING


def _ratio(
    scrape: Scrape,
    prompt_by_path: dict[tuple[str, ...], Histogram],
    prompt_all: Histogram,
    opts: Options,
    recommended_threshold: int | None,
) -> RatioAdvice:
    prefill_tokens = prompt_by_path.get(("disaggregated",), Histogram([math.inf], [0.0], 0.0)).sum
    direct_tokens = prompt_by_path.get(("direct",), Histogram([math.inf], [0.0], 0.0)).sum
    output_tokens = scrape.histogram(f"{PREFIX}_output_tokens").sum
    heuristic = RATIO_HEURISTIC.format(
        p=opts.prefill_rate, d=opts.decode_rate, q=QUEUEING_WAITING, kv=KV_CACHE_FULL, i=IDLE_WAITING
    )

    def work(prefill: float, direct: float) -> tuple[float, float, float | None]:
        prefill_work = prefill / opts.prefill_rate
        decode_work = output_tokens / opts.decode_rate + direct / opts.prefill_rate
        return prefill_work, decode_work, (prefill_work / decode_work if decode_work > 0 else None)

    prefill_work, decode_work, ratio = work(prefill_tokens, direct_tokens)
    load = _pool_loads(scrape)
    engines = load["prefill"].engines + load["decode"].engines
    current = f"{load['prefill'].engines}:{load['decode'].engines}" if engines else None
    split = _split(ratio, engines) if ratio is not None and engines else None

    notes: list[str] = []
    recommended = _simple_ratio(ratio) if ratio is not None else None
    if split is not None:
        prefill_queues = _queueing(load["prefill"], "prefill") and _idle(load["decode"])
        decode_queues = _queueing(load["decode"], "decode") and _idle(load["prefill"])
        if prefill_queues and split["prefill"] <= load["prefill"].engines and split["decode"] > 1:
            split = {"prefill": split["prefill"] + 1, "decode": split["decode"] - 1}
            recommended = f"{split['prefill']}:{split['decode']}"
            notes.append("the prefill pool has requests waiting and the decode pool none: one engine moved to prefill")
        elif decode_queues and split["decode"] <= load["decode"].engines and split["prefill"] > 1:
            split = {"prefill": split["prefill"] - 1, "decode": split["decode"] + 1}
            recommended = f"{split['prefill']}:{split['decode']}"
            notes.append(
                "the decode pool is queueing (requests waiting or KV cache full) and the prefill pool is not: "
                "one engine moved to decode"
            )
        elif prefill_queues or decode_queues:
            pool = "prefill" if prefill_queues else "decode"
            notes.append(f"the {pool} pool is queueing now, which the recommended split already addresses")
    if not any(pool.waiting_per_engine is not None for pool in load.values()):
        notes.append(
            "no engine load in the scrape (the router has not scraped the engines' /metrics): token counts only"
        )
    elif not notes:
        notes.append("neither pool is queueing on its own: the token counts decide")

    at_threshold = None
    if recommended_threshold is not None and prompt_all.count > 0:
        above = prompt_all.sum_above(recommended_threshold)
        p_work, d_work, r = work(above, prompt_all.sum - above)
        at_threshold = {
            "threshold": recommended_threshold,
            "prefill_prompt_tokens": above,
            "prefill_work": p_work,
            "decode_work": d_work,
            "ratio": r,
            "recommended": _simple_ratio(r) if r is not None else None,
            "split": _split(r, engines) if r is not None and engines else None,
        }
    return RatioAdvice(
        prefill_rate=opts.prefill_rate,
        decode_rate=opts.decode_rate,
        prefill_prompt_tokens=prefill_tokens,
        direct_prompt_tokens=direct_tokens,
        output_tokens=output_tokens,
        prefill_work=prefill_work,
        decode_work=decode_work,
        ratio=ratio,
        recommended=recommended,
        split=split,
        current=current,
        at_recommended_threshold=at_threshold,
        load=load,
        load_check="; ".join(notes),
        heuristic=heuristic,
    )


# -------------------------------------------------------------------------------------------- rendering


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _number(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [indent + "  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append(indent + "  ".join("-" * w for w in widths))
    for row in rows:
        lines.append(indent + "  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def render_text(report: Report) -> str:
    out: list[str] = []
    req = report.requests
    threshold = ", ".join(map(str, report.thresholds)) or "unknown"
    out.append(
        f"dpd-router advise: {_number(sum(req.values()))} requests (direct {_number(req.get('direct'))}, "
        f"disaggregated {_number(req.get('disaggregated'))}); current threshold {threshold} tokens"
    )
    if report.sources:
        out.append("from " + ", ".join(report.sources))
    for warning in report.warnings:
        out.append(f"warning: {warning}")

    p = report.prompt_tokens
    out.append("\nPrompt tokens, all paths (percentiles estimated from the histogram buckets)")
    percentiles = p["percentiles"]
    out.append(
        _table(
            ["requests", "mean", *percentiles],
            [
                [
                    _number(p["requests"]),
                    _number(p["mean"]),
                    *((">=" if v["at_least"] else "") + _number(v["tokens"]) for v in percentiles.values()),
                ]
            ],
        )
    )

    out.append("\nShare of traffic above candidate thresholds (* the current one)")
    out.append(
        _table(
            ["threshold", "requests above", "of requests", "of prompt tokens (est.)"],
            [
                [
                    f"{'*' if row['current'] else ''}{row['threshold']}",
                    _number(row["requests_above"]),
                    _share(row["share_of_requests"]),
                    _share(row["share_of_prompt_tokens"]),
                ]
                for row in report.shares
            ],
        )
    )

    stat = report.settings["statistic"]
    out.append(
        f"\nTTFT by prompt length and path (mean exact; p50/p90 estimated from the buckets; verdict on the {stat})"
    )
    out.append(
        _table(
            ["prompt tokens", "direct n", "mean", "p50", "p90", "disagg n", "mean", "p50", "p90", "faster / why"],
            [
                [
                    row.span,
                    _number(row.direct.requests),
                    _seconds(row.direct.mean),
                    _seconds(row.direct.p50),
                    _seconds(row.direct.p90),
                    _number(row.disaggregated.requests),
                    _seconds(row.disaggregated.mean),
                    _seconds(row.disaggregated.p50),
                    _seconds(row.disaggregated.p90),
                    (f"{row.faster}: " if row.faster else "") + row.note,
                ]
                for row in report.ttft
            ],
        )
        if report.ttft
        else "  (no dpd_router_ttft_by_prompt_length_seconds samples)"
    )

    if report.phases:
        phases = sorted({phase for by_phase in report.phases.values() for phase in by_phase}, key=_phase_order)
        out.append("\nWhere the time to first token goes (mean per phase)")
        out.append(
            _table(
                ["path", *phases],
                [[path, *(_seconds(by_phase.get(ph)) for ph in phases)] for path, by_phase in report.phases.items()],
            )
        )
    if report.decisions:
        out.append("\nRouting decisions")
        out.append(
            _table(
                ["path", "reason", "requests"],
                [[d["path"], d["reason"], _number(d["requests"])] for d in report.decisions],
            )
        )

    if report.adaptive:
        out.append(
            "\nAdaptive threshold (threshold_mode adaptive), as scraped: the prompt length from which each decoder"
        )
        out.append("would disaggregate at its load then, and the costs learned (one row per router)")
        out.append(
            _table(
                ["decoder", "effective threshold"],
                [[row["decoder"], _threshold_text(row["tokens"])] for row in report.adaptive["thresholds"]],
            )
        )
        out.append(
            _table(
                ["model", "endpoint", "learned"],
                [
                    [row["model"], row["endpoint"] or "-", _cost_text(row["model"], row["terms"])]
                    for row in report.adaptive["costs"]
                ],
            )
        )

    rec = report.recommendation
    head = f"{rec.threshold} tokens" if rec.threshold is not None else "none"
    basis = f", {rec.basis}" if rec.basis != "none" else ""
    out.append(f"\nRecommended threshold: {head} ({rec.verdict.replace('_', ' ')}{basis})")
    out.append(f"  {rec.summary}")
    for line in rec.evidence:
        out.append(f"  - {line}")
    out.append(f"  rule: {rec.rule}")

    ratio = report.ratio
    out.append(
        f"\nRecommended prefill:decode ratio: {ratio.recommended or 'none'}"
        + (f" (now {ratio.current})" if ratio.current else "")
    )
    if ratio.ratio is not None:
        split = ""
        if ratio.split:
            engines = sum(ratio.split.values())
            split = f"; over the {engines} engines there are now: {ratio.split['prefill']} prefill + "
            split += f"{ratio.split['decode']} decode"
        out.append(
            f"  prefill work {ratio.prefill_work:,.1f} engine-s ({_number(ratio.prefill_prompt_tokens)} prompt "
            f"tokens), decode work {ratio.decode_work:,.1f} engine-s ({_number(ratio.output_tokens)} output + "
            f"{_number(ratio.direct_prompt_tokens)} direct prompt tokens): {ratio.ratio:.2f}{split}"
        )
    else:
        out.append("  no token counts in the scrape")
    at = ratio.at_recommended_threshold
    if at and at["ratio"] is not None:
        split_at = f" ({at['split']['prefill']} prefill + {at['split']['decode']} decode)" if at["split"] else ""
        out.append(
            f"  at the recommended threshold {at['threshold']}: {at['ratio']:.2f} -> {at['recommended']}{split_at}"
        )
    loads = [
        [role, str(load.engines), _number(load.waiting_per_engine, 1), _number(load.running_per_engine, 1),
         _share(load.kv_cache_usage), _number(load.router_in_flight_per_engine, 1)]
        for role, load in ratio.load.items()
    ]  # fmt: skip
    out.append(
        _table(["pool", "engines", "waiting/engine", "running/engine", "KV cache", "router calls/engine"], loads)
    )
    out.append(f"  load check: {ratio.load_check}")
    out.append(f"  heuristic: {ratio.heuristic}")
    return "\n".join(out) + "\n"


def _phase_order(phase: str) -> tuple[int, str]:
    order = ("queue", "tokenize", "prefill", "first_token")
    return (order.index(phase) if phase in order else len(order), phase)


# ------------------------------------------------------------------------------------------------- plot


def plot(report: Report, out: Path) -> None:
    """A PNG: on top, TTFT per path against prompt length (mean per bucket, with the p50-p90 band);
    below, the requests per prompt-length bucket and path (the distribution); the recommended and the
    current thresholds as vertical lines on both. Needs matplotlib (imported here, not at module load)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    rows = [row for row in report.ttft if row.upper is not None]
    fig, (ax, dist) = plt.subplots(2, 1, sharex=True, figsize=(10, 7), height_ratios=(3, 1.3))
    colours = {"direct": "tab:blue", "disaggregated": "tab:orange"}
    lefts = [row.lower if row.lower else row.upper / 2 for row in rows if row.upper]
    uppers = [row.upper for row in rows if row.upper]
    centres = [math.sqrt(lo * up) for lo, up in zip(lefts, uppers, strict=True)]
    bottom = [0.0] * len(rows)
    for name, colour in colours.items():
        stats = [getattr(row, name) for row in rows]
        pts = [(x, st) for x, st in zip(centres, stats, strict=True) if st.requests]
        if pts:
            xs = [x for x, _ in pts]
            ax.plot(xs, [st.mean for _, st in pts], marker="o", color=colour, label=f"{name}: mean", zorder=3)
            low = [st.p50 if st.p50 is not None else st.mean for _, st in pts]
            high = [st.p90 if st.p90 is not None else st.mean for _, st in pts]
            ax.fill_between(xs, low, high, color=colour, alpha=0.15, label=f"{name}: p50-p90", zorder=2)
        counts = [st.requests for st in stats]
        widths = [(up - lo) * 0.9 for lo, up in zip(lefts, uppers, strict=True)]
        dist.bar(lefts, counts, width=widths, bottom=bottom, align="edge", color=colour, alpha=0.6, label=name)
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    rec = report.recommendation
    for axis in (ax, dist):
        if rec.threshold is not None:
            label = f"recommended threshold {rec.threshold}" if axis is ax else None
            axis.axvline(rec.threshold, color="tab:green", linestyle="--", linewidth=2, label=label)
        for current in report.thresholds:
            axis.axvline(
                current, color="0.3", linestyle=":", label=f"current threshold {current}" if axis is ax else None
            )
    ax.set_xscale("log", base=2)
    ticks = sorted(set(lefts) | set(uppers))
    dist.xaxis.set_major_locator(FixedLocator(ticks))
    dist.xaxis.set_minor_locator(NullLocator())
    dist.set_xticklabels([f"{t / 1024:g}k" if t >= 1024 else f"{t:g}" for t in ticks])
    dist.set_xlabel("prompt tokens (prompt-length buckets of dpd_router_ttft_by_prompt_length_seconds)")
    ax.set_ylabel("time to first token (s)")
    dist.set_ylabel("requests")
    verdict = rec.verdict.replace("_", " ")
    threshold = f"recommended threshold {rec.threshold}" if rec.threshold is not None else "no recommendation"
    ax.set_title(f"TTFT by prompt length and path: {verdict} ({rec.basis}), {threshold}")
    ax.legend(loc="upper left", fontsize="small")
    dist.legend(loc="upper right", fontsize="small")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Read a dpd-router's own metrics (live or saved) and print the evidence for tuning it: the prompt-token "
        "distribution, the share of traffic above candidate thresholds, TTFT per path by prompt length, a "
        "recommended routing_threshold (where the disaggregated path's TTFT stops losing to the direct path's) "
        "and a prefill:decode ratio."
    )
    parser.epilog = (
        "examples: dpd-router advise --metrics http://router:8000 ; "
        "dpd-router advise --metrics http://router:8000 --window 600 --plot ttft.png ; "
        "curl -s http://router:8000/metrics > t0.prom; (later) dpd-router advise --metrics http://router:8000 "
        "--since t0.prom --json"
    )
    source = parser.add_argument_group("where the metrics come from (one of)")
    source.add_argument(
        "--metrics",
        action="append",
        metavar="URL",
        help="a router's /metrics URL (or its base URL); repeat for several replicas, which are summed",
    )
    source.add_argument(
        "--file",
        action="append",
        metavar="FILE",
        help="a saved scrape (Prometheus text, e.g. `curl -s ROUTER/metrics > FILE`); repeat for several replicas",
    )
    parser.add_argument(
        "--since",
        action="append",
        metavar="FILE",
        help="an earlier scrape of the same router(s): advise on the traffic since then only (repeatable)",
    )
    parser.add_argument(
        "--window",
        type=float,
        metavar="SECONDS",
        help="with --metrics: scrape twice, SECONDS apart, and advise on the traffic in between",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=DEFAULT_MIN_REQUESTS,
        help="requests each path needs in a prompt-length bucket to count as evidence "
        f"(default {DEFAULT_MIN_REQUESTS})",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="the disaggregated path does not lose while its TTFT is within this fraction of the direct path's "
        f"(default {DEFAULT_TOLERANCE})",
    )
    parser.add_argument(
        "--statistic", choices=STATISTICS, default="mean", help="the TTFT statistic compared (default mean)"
    )
    parser.add_argument(
        "--candidates",
        type=_int_list,
        default=DEFAULT_CANDIDATES,
        metavar="N,N,...",
        help="candidate thresholds for the traffic-share table (default 512,1024,2048,4096,8192,16384,32768)",
    )
    parser.add_argument(
        "--prefill-rate",
        type=float,
        default=DEFAULT_PREFILL_RATE,
        metavar="TOKENS/S",
        help=f"prompt tokens/s one prefill engine sustains (default {DEFAULT_PREFILL_RATE:g}: 8B model, one H100)",
    )
    parser.add_argument(
        "--decode-rate",
        type=float,
        default=DEFAULT_DECODE_RATE,
        metavar="TOKENS/S",
        help=f"output tokens/s one decode engine sustains at your ITL target (default {DEFAULT_DECODE_RATE:g})",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each /metrics (default 10)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="FILE", help="also write a PNG chart (needs matplotlib: the bench extra)")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, e.g. 1024,2048,4096") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected positive integers")
    return values


def metrics_url(url: str) -> str:
    """`http://host:port` or `.../metrics`: the /metrics URL."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.path in ("", "/"):
        return parts._replace(path="/metrics").geturl()
    return parts.geturl()


async def fetch_scrapes(urls: Sequence[str], wait: float = 10.0) -> list[str]:
    """The /metrics texts of the routers, fetched concurrently (each within `wait` seconds)."""
    import httpx

    async with httpx.AsyncClient(timeout=wait) as client:

        async def one(url: str) -> str:
            try:
                response = await client.get(url)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                raise AdviseError(f"cannot read {url}: {exc or type(exc).__name__}") from None
            return response.text

        return list(await asyncio.gather(*(one(url) for url in urls)))


def _combine(texts: Iterable[str]) -> Scrape:
    total = Scrape()
    for text in texts:
        total = total.plus(Scrape.parse(text))
    return total


async def collect(args: argparse.Namespace) -> tuple[Scrape, list[str]]:
    """The scrape to advise on, from the arguments, and a description of where it came from."""
    if bool(args.metrics) == bool(args.file):
        raise AdviseError("give either --metrics URL or --file FILE")
    if args.window is not None and not args.metrics:
        raise AdviseError("--window needs --metrics")
    sources: list[str]
    if args.metrics:
        urls = [metrics_url(url) for url in args.metrics]
        sources = list(urls)
        texts = await fetch_scrapes(urls, args.timeout)
        scrape = _combine(texts)
        if args.window is not None:
            await asyncio.sleep(args.window)
            scrape = _combine(await fetch_scrapes(urls, args.timeout)).minus(scrape)
            sources.append(f"traffic over {args.window:g} s")
    else:
        texts = [_read(path) for path in args.file]
        sources = list(args.file)
        scrape = _combine(texts)
    if scrape.empty:
        raise AdviseError(f"no dpd_router_* metrics in {', '.join(sources)}: is this a dpd-router /metrics?")
    if args.since:
        scrape = scrape.minus(_combine(_read(path) for path in args.since))
        sources.append("since " + ", ".join(args.since))
    return scrape, sources


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise AdviseError(f"cannot read {path}: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    """`dpd-router advise`: 0 on success, 1 when the metrics cannot be read, 2 on bad usage."""
    if args.plot and not matplotlib_available():
        print(
            f"dpd-router advise: --plot needs matplotlib, which is not installed: {PLOT_INSTALL_HINT}", file=sys.stderr
        )
        return 2
    if args.min_requests < 1 or args.tolerance < 0 or args.prefill_rate <= 0 or args.decode_rate <= 0:
        print("dpd-router advise: --min-requests must be >= 1, --tolerance >= 0, rates > 0", file=sys.stderr)
        return 2
    try:
        scrape, sources = asyncio.run(collect(args))
        options = Options(
            min_requests=args.min_requests,
            tolerance=args.tolerance,
            statistic=args.statistic,
            candidates=args.candidates,
            prefill_rate=args.prefill_rate,
            decode_rate=args.decode_rate,
        )
        report = analyse(scrape, options, sources)
    except AdviseError as exc:
        print(f"dpd-router advise: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_text(report), end="")
    if args.plot:
        plot(report, Path(args.plot))
        if not args.json:
            print(f"chart written to {args.plot}")
    return 0
