"""The arms side by side: per arm, path and prompt-length class, TTFT p50/p95, ITL p99 and E2E p95 with
bootstrap intervals, and per class and metric the arm that wins, or "undecided" with the traffic a
significant difference would still take.

Arms are learnt from the `arm` label of the request metrics (see scrape.py). The experiment arms (and
"live") are the candidates; the shadow's copies are shown beside them but take no part in picking a
winner: the shadow is what the promotion check compares against (verdict.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpd_router.advise.bootstrap import Bootstrap, Estimate, interval, needed_observations
from dpd_router.advise.histogram import Histogram, combined, parse_bound
from dpd_router.advise.render import seconds_text
from dpd_router.advise.report import LONG_PROMPT_TOKENS, ArmClassStats, ArmsReport, Comparison, Options
from dpd_router.advise.scrape import SHADOW_ARM, Scrape, arm_of
from dpd_router.record.metrics import PROMPT_LENGTH_BOUNDS

ALL_PATHS = "all"
TTFT_FAMILY = "time_to_first_token_seconds"
ITL_FAMILY = "inter_token_latency_seconds"
E2E_FAMILY = "e2e_latency_seconds"
# (name, histogram by prompt length, quantile): what is compared per class.
METRICS = (
    ("ttft_p50", TTFT_FAMILY, 0.5),
    ("ttft_p95", TTFT_FAMILY, 0.95),
    ("itl_p99", ITL_FAMILY, 0.99),
    ("e2e_p95", E2E_FAMILY, 0.95),
)
FAMILIES = (TTFT_FAMILY, ITL_FAMILY, E2E_FAMILY)
# Beyond this multiple of the traffic seen, "more traffic" is no practical answer: the arms are alike.
MAX_TRAFFIC_FACTOR = 1000.0


@dataclass(frozen=True)
class RequestClass:
    """Prompts of more than `lower` tokens and at most `upper` (None: no upper bound)."""

    lower: int
    upper: int | None

    @property
    def span(self) -> str:
        if self.upper is None:
            return f">{self.lower}"
        return f"{self.lower + 1}-{self.upper}" if self.lower else f"1-{self.upper}"

    @property
    def long(self) -> bool:
        """Wholly above the playbook's 2k tokens."""
        return self.lower >= LONG_PROMPT_TOKENS

    def holds(self, bucket_label: str) -> bool:
        """Whether a `prompt_tokens` bucket (labelled with its upper bound) lies in this class."""
        bound = parse_bound(bucket_label)
        return bound > self.lower and (self.upper is None or bound <= self.upper)


def request_classes(bounds: Sequence[int]) -> list[RequestClass]:
    """The classes the bounds cut prompt lengths into; 2048 is always a cut (the verdict's line)."""
    cuts = sorted({b for b in bounds if b in PROMPT_LENGTH_BOUNDS} | {LONG_PROMPT_TOKENS})
    lowers = [0, *cuts]
    uppers: list[int | None] = [*cuts, None]
    return [RequestClass(lo, up) for lo, up in zip(lowers, uppers, strict=True)]


Select = Callable[[str, str], bool]  # (arm, path) -> included


class Breakdown:
    """The by-prompt-length histograms of a scrape, grouped by arm, path and request class."""

    def __init__(self, scrape: Scrape, classes: Sequence[RequestClass]) -> None:
        self.classes = list(classes)
        self._series: dict[str, dict[tuple[str, str, int], list[Histogram]]] = {}
        self.arm_paths: set[tuple[str, str]] = set()
        for family in FAMILIES:
            grouped: dict[tuple[str, str, int], list[Histogram]] = defaultdict(list)
            by = scrape.by_prompt_length(family, ("arm", "path", "prompt_tokens"))
            for (arm, path, label), hist in by.items():
                index = next((i for i, c in enumerate(self.classes) if c.holds(label)), None)
                if index is None or hist.count <= 0:
                    continue
                grouped[(arm_of(arm), path, index)].append(hist)
                self.arm_paths.add((arm_of(arm), path))
            self._series[family] = grouped

    def hist(self, family: str, index: int, select: Select) -> Histogram | None:
        found = [
            hist
            for (arm, path, i), hists in self._series.get(family, {}).items()
            if i == index and select(arm, path)
            for hist in hists
        ]
        return combined(found) if found else None

    def streams(self, index: int, select: Select) -> float:
        """Streamed requests in the class (one TTFT each): the independent units its ITL gaps come from."""
        hist = self.hist(TTFT_FAMILY, index, select)
        return 0.0 if hist is None else hist.count

    def requests(self, index: int, select: Select) -> float:
        """Requests in the class: E2E observations (every request), else TTFT ones (streamed requests)."""
        for family in (E2E_FAMILY, TTFT_FAMILY):
            hist = self.hist(family, index, select)
            if hist is not None:
                return hist.count
        return 0.0


def arms_report(scrape: Scrape, opts: Options, boot: Bootstrap) -> ArmsReport:
    classes = request_classes(opts.classes)
    breakdown = Breakdown(scrape, classes)
    arms = sorted({arm for arm, _ in breakdown.arm_paths}, key=lambda a: (a == SHADOW_ARM, a))
    stats: list[ArmClassStats] = []
    # Per candidate arm and class, its whole traffic (all paths): the estimates compared, and their replicates.
    whole: dict[tuple[str, int], dict[str, Estimate]] = {}
    replicates: dict[tuple[str, int, str], list[float]] = {}
    candidates = [arm for arm in arms if arm != SHADOW_ARM]
    for arm in arms:
        paths = sorted(path for a, path in breakdown.arm_paths if a == arm)
        for index, request_class in enumerate(classes):
            served = [path for path in paths if breakdown.requests(index, select_path(arm, path)) > 0]
            units = [(path, select_path(arm, path)) for path in served]
            if arm in candidates and served:
                units.append((ALL_PATHS, select_arm(arm)))
            for path, select in units:
                metrics: dict[str, Estimate] = {}
                for family in FAMILIES:
                    wanted = [(name, q) for name, f, q in METRICS if f == family]
                    found = boot.estimates(
                        breakdown.hist(family, index, select),
                        [(q, needed_observations(q, opts.min_requests)) for _, q in wanted],
                        f"{arm}|{path}|{request_class.span}|{family}",
                        units=breakdown.streams(index, select) if family == ITL_FAMILY else None,
                    )
                    for (name, _), (estimate, values) in zip(wanted, found, strict=True):
                        metrics[name] = estimate
                        if path == ALL_PATHS:
                            replicates[(arm, index, name)] = values
                if path == ALL_PATHS:
                    whole[(arm, index)] = metrics
                if path != ALL_PATHS or len(served) > 1:  # an arm's one path in a class is its whole traffic there
                    stats.append(
                        ArmClassStats(arm, path, request_class.span, breakdown.requests(index, select), metrics)
                    )
    comparisons = []
    if len(candidates) >= 2:
        for index, request_class in enumerate(classes):
            for name, _, q in METRICS:
                needed = needed_observations(q, opts.min_requests)
                empty = Estimate(None, None, None, 0.0, needed)
                estimates = {arm: whole[(arm, index)][name] if (arm, index) in whole else empty for arm in candidates}
                if all(e.value is None for e in estimates.values()):
                    continue
                comparisons.append(
                    _compare(request_class.span, name, estimates, replicates, index, opts, boot.confidence)
                )
    return ArmsReport(
        arms=arms,
        classes=[c.span for c in classes],
        observed_hours=opts.observed_hours,
        hours_basis=opts.hours_basis,
        stats=stats,
        comparisons=comparisons,
        confidence=boot.confidence,
        resamples=boot.resamples,
    )


def select_path(arm: str, path: str) -> Select:
    return lambda a, p: a == arm and p == path


def select_arm(arm: str) -> Select:
    return lambda a, _: a == arm


def _compare(
    span: str,
    metric: str,
    estimates: dict[str, Estimate],
    replicates: dict[tuple[str, int, str], list[float]],
    index: int,
    opts: Options,
    confidence: float,
) -> Comparison:
    ranked = sorted(estimates, key=lambda arm: (estimates[arm].value is None, estimates[arm].value or 0.0, arm))
    best, runner_up = ranked[0], ranked[1]
    a, b = estimates[best], estimates[runner_up]
    hours = opts.observed_hours
    label = f"{metric.replace('_', ' ').upper()} in {span}"
    row = Comparison(
        request_class=span,
        metric=metric,
        status="not_enough_data",
        best=best,
        runner_up=runner_up,
        best_value=a.value,
        runner_up_value=b.value,
        difference=None,
        difference_low=None,
        difference_high=None,
        winner=None,
        more_hours=None,
        traffic_factor=None,
        note="",
    )
    if not (a.enough and b.enough):
        lacking = [(arm, e) for arm, e in ((best, a), (runner_up, b)) if not e.enough]
        short = ", ".join(f"{arm} {e.count:,.0f} < {e.needed}" for arm, e in lacking)
        if all(e.count > 0 for _, e in lacking):
            row.traffic_factor = max(e.needed / e.count for _, e in lacking)  # counts grow with the traffic
        row.more_hours = _more(hours, row.traffic_factor)
        row.note = f"{label}: not enough data ({short} observations); " + _wait_text(
            hours, row.traffic_factor, "to reach it"
        )
        return row
    assert a.value is not None and b.value is not None
    row.difference = difference = b.value - a.value
    best_values = replicates.get((best, index, metric), [])
    runner_up_values = replicates.get((runner_up, index, metric), [])
    low, high = interval([rb - ra for ra, rb in zip(best_values, runner_up_values, strict=False)], confidence)
    row.difference_low, row.difference_high = low, high
    capped = " (a quantile in the +Inf bucket: only a bound)" if a.capped or b.capped else ""
    measured = f"{_ms(difference)} ({confidence:.0%} CI {_ms(low)} to {_ms(high)})"
    if low is not None and low > 0:
        row.status, row.winner, row.more_hours, row.traffic_factor = "winner", best, 0.0, 1.0
        row.note = f"{label}: {best} wins, {_ms(a.value)} against {runner_up}'s {_ms(b.value)}, by {measured}{capped}"
        return row
    row.status = "undecided"
    factor: float | None = None
    if difference > 0 and low is not None:
        # The interval's half-width shrinks as 1/sqrt(traffic): its lower end crosses 0 at this multiple.
        factor = ((difference - low) / difference) ** 2
    head = f"{label}: undecided, {best} {_ms(a.value)} vs {runner_up} {_ms(b.value)}, difference {measured}; "
    if factor is None or factor > MAX_TRAFFIC_FACTOR:
        row.note = head + "no difference seen: more traffic is unlikely to separate them" + capped
        return row
    row.traffic_factor, row.more_hours = factor, _more(hours, factor)
    row.note = head + _wait_text(hours, factor, "for it to be significant") + capped
    return row


def _more(hours: float | None, factor: float | None) -> float | None:
    if hours is None or factor is None:
        return None
    return max(hours * (factor - 1.0), 0.0)


def _wait_text(hours: float | None, factor: float | None, purpose: str) -> str:
    if factor is None:
        return "no traffic in it yet: no estimate of how long it would take"
    if hours is None:
        return (
            f"about {factor:.1f}x the traffic in this scrape is needed {purpose} (give --hours, --since or --window "
            "to have it in hours)"
        )
    return f"about {max(hours * (factor - 1.0), 0.0):.1f} more hours of this traffic are needed {purpose}"


def _ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return ("-" if value < 0 else "") + seconds_text(abs(value))
