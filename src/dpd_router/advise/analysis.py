"""The report from a scrape: prompt lengths, traffic shares, TTFT by prompt length and path, phases,
decisions, the adaptive threshold's state, and the warnings that qualify the evidence."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from dpd_router.advise.arms import arms_report
from dpd_router.advise.bootstrap import Bootstrap
from dpd_router.advise.histogram import Histogram, combined, parse_bound
from dpd_router.advise.ratio import ratio_advice
from dpd_router.advise.report import PATHS, STATISTICS, LengthBucket, Options, PathStats, Report
from dpd_router.advise.scrape import SHADOW_ARM, AdviseError, Scrape
from dpd_router.advise.threshold import recommend
from dpd_router.advise.verdict import go_no_go, promotion_check
from dpd_router.record.metrics import PREFIX, PROMPT_LENGTH_BOUNDS

PROMPT_QUANTILES = (0.5, 0.75, 0.9, 0.95, 0.99)


def analyse(scrape: Scrape, options: Options | None = None, sources: Sequence[str] = ()) -> Report:
    """The whole report from a (possibly combined or differenced) scrape."""
    opts = options or Options()
    if opts.statistic not in STATISTICS:
        raise AdviseError(f"statistic must be one of {', '.join(STATISTICS)}")
    boot = Bootstrap(opts.resamples, opts.confidence, opts.seed)
    arms = arms_report(scrape, opts, boot)
    promotion = promotion_check(scrape, opts, boot)
    verdict = go_no_go(scrape, opts, boot)
    # The threshold and ratio advice is about the traffic the router serves: the shadow's copies repeat
    # some of it on other engines, so they are left out (every experiment arm is in: they share the pools).
    scrape = scrape.arms_only(lambda arm: arm != SHADOW_ARM)
    warnings: list[str] = []
    thresholds = sorted({int(v) for _, v in scrape.gauge_values(f"{PREFIX}_routing_threshold_tokens") if v == v})
    current = thresholds[0] if len(thresholds) == 1 else None
    models = scrape.models()
    if len(models) > 1:
        warnings.append(
            f"the scrape holds {len(models)} models ({', '.join(models)}): their requests are advised together, "
            "and their thresholds differ; --model NAME advises on one"
        )
    elif len(thresholds) > 1:
        warnings.append(f"the routers scraped run different thresholds ({', '.join(map(str, thresholds))})")

    requests = {path: 0.0 for path in PATHS}
    for (path, _), value in scrape.counters(f"{PREFIX}_requests_total", ("path", "outcome")).items():
        requests[path] = requests.get(path, 0.0) + value

    prompt_by_path = scrape.histograms(f"{PREFIX}_prompt_tokens", ("path",))
    prompt_all = combined(prompt_by_path.values())
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
    ratio = ratio_advice(scrape, prompt_by_path, prompt_all, opts, recommendation.threshold)
    adaptive = _adaptive(scrape)

    if prompt_all.count == 0:
        warnings.append("no requests in the scrape (or between the scrapes): nothing to advise on yet")
    elif not rows:
        warnings.append(
            f"no {PREFIX}_time_to_first_token_seconds samples by prompt_tokens (a router older than this advise?): "
            "TTFT by prompt length, and so the threshold, cannot be judged"
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
        arms=arms,
        promotion=promotion,
        verdict=verdict,
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
    by = scrape.by_prompt_length("time_to_first_token_seconds", ("path", "prompt_tokens"))
    labels = {label for (_, label) in by}
    finite = sorted({int(parse_bound(label)) for label in labels if label != "+Inf"} | set(PROMPT_LENGTH_BOUNDS))
    rows = []
    for label in sorted(labels, key=parse_bound):
        bound = parse_bound(label)
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


def _phases(scrape: Scrape) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for (path, phase), hist in sorted(scrape.histograms(f"{PREFIX}_phase_seconds", ("path", "phase")).items()):
        out.setdefault(path, {})[phase] = hist.mean
    return out
