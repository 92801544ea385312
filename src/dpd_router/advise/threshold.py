"""The recommended routing threshold: where the disaggregated path's TTFT stops losing to the direct
path's (the rule is point 4 of the `dpd_router.advise` package docstring)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpd_router.advise.render import seconds_text
from dpd_router.advise.report import PATHS, LengthBucket, Options, PathStats, Recommendation
from dpd_router.record.metrics import PROMPT_LENGTH_BOUNDS

RULE = (
    "A prompt-length bucket counts when both paths have at least {min} requests in it. There the "
    "disaggregated path does not lose when its TTFT {stat} is at most {tol:.0%} above the direct path's. "
    "The threshold is the lower edge of the lowest counting bucket from which the disaggregated path does "
    "not lose in every counting bucket above; if it loses in the highest, keep those prompts direct. "
    "Without any counting bucket: the crossing of straight-line fits of TTFT against prompt length per "
    "path (extrapolated), else no recommendation."
)


def recommend(rows: Sequence[LengthBucket], opts: Options, current: int | None) -> Recommendation:
    """The threshold rule (the package docstring's point 4) over the TTFT-by-prompt-length buckets."""
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
        f"{row.span} tokens: direct {seconds_text(d)} (n={row.direct.requests}), disaggregated {seconds_text(g)} "
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
