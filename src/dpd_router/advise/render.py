"""The report as plain-text tables."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpd_router.advise.bootstrap import Estimate
from dpd_router.advise.report import ArmsReport, Promotion, Report, Verdict


def seconds_text(value: float | None) -> str:
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
                    seconds_text(row.direct.mean),
                    seconds_text(row.direct.p50),
                    seconds_text(row.direct.p90),
                    _number(row.disaggregated.requests),
                    seconds_text(row.disaggregated.mean),
                    seconds_text(row.disaggregated.p50),
                    seconds_text(row.disaggregated.p90),
                    (f"{row.faster}: " if row.faster else "") + row.note,
                ]
                for row in report.ttft
            ],
        )
        if report.ttft
        else "  (no dpd_router_time_to_first_token_seconds samples by prompt_tokens)"
    )

    if report.phases:
        phases = sorted({phase for by_phase in report.phases.values() for phase in by_phase}, key=_phase_order)
        out.append("\nWhere the time to first token goes (mean per phase)")
        out.append(
            _table(
                ["path", *phases],
                [
                    [path, *(seconds_text(by_phase.get(ph)) for ph in phases)]
                    for path, by_phase in report.phases.items()
                ],
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

    if report.arms is not None and report.arms.stats:
        out.extend(_arms_text(report.arms))

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
    if report.promotion is not None:
        out.extend(_promotion_text(report.promotion))
    if report.verdict is not None:
        out.extend(_verdict_text(report.verdict))
    return "\n".join(out) + "\n"


ARM_METRICS = (("ttft_p50", "TTFT p50"), ("ttft_p95", "TTFT p95"), ("itl_p99", "ITL p99"), ("e2e_p95", "E2E p95"))


def _estimate_text(estimate: Estimate | None) -> str:
    if estimate is None or estimate.value is None:
        return "-"
    text = (">=" if estimate.capped else "") + seconds_text(estimate.value)
    if estimate.low is not None and estimate.high is not None:
        text += f" [{seconds_text(estimate.low)}, {seconds_text(estimate.high)}]"
    return text + ("" if estimate.enough else " *")


def _arms_text(arms: ArmsReport) -> list[str]:
    if arms.observed_hours is not None:
        hours = f"traffic over {arms.observed_hours:.2f} h ({arms.hours_basis})"
    else:
        hours = "duration unknown: give --hours, --since or --window for hours"
    out = [
        f"\nArms side by side, by prompt-length class ({', '.join(arms.arms)}; {arms.confidence:.0%} bootstrap "
        f"intervals over {arms.resamples} resamples; {hours})"
    ]
    out.append(
        _table(
            ["arm", "path", "prompt tokens", "requests", *(name for _, name in ARM_METRICS)],
            [
                [
                    row.arm,
                    row.path,
                    row.request_class,
                    _number(row.requests),
                    *(_estimate_text(row.metrics.get(key)) for key, _ in ARM_METRICS),
                ]
                for row in arms.stats
            ],
        )
    )
    out.append("  * fewer observations than the quantile needs to count (p95: 100, p99: 500, or --min-requests)")
    if arms.comparisons:
        out.append("  Winner per class (the best arm against the runner-up; the shadow is not a candidate):")
        out.extend(f"  - {c.note}" for c in arms.comparisons)
    elif len([arm for arm in arms.arms if arm != "shadow"]) < 2:
        out.append("  (one arm only: nothing to compare; configure experiment arms to compare routing settings)")
    return out


def _promotion_text(promotion: Promotion) -> list[str]:
    out = [
        "\nPromotion check (disaggregated P95 TTFT <= monolithic P95 TTFT + transfer overhead, per prompt-length "
        f"bucket over 2k tokens): {promotion.status.replace('_', ' ').upper()}",
        f"  {promotion.summary}",
        f"  transfer overhead: {seconds_text(promotion.transfer_overhead)} ({promotion.transfer_overhead_basis})",
    ]
    out.extend(f"  - {check.note}" for check in promotion.classes)
    return out


def _verdict_text(verdict: Verdict) -> list[str]:
    out = [f"\nVerdict: {verdict.decision.replace('_', ' ').upper()}", f"  {verdict.summary}"]
    out.extend(f"  - {reason}" for reason in verdict.reasons)
    out.append(
        f"  rule: DPD is the right tool when more than {verdict.long_prompt_share_needed:.0%} of requests have prompts "
        "over 2k tokens AND the ITL SLO misses (--itl-slo) come from long prompts prefilled on the decoders"
    )
    return out


def _phase_order(phase: str) -> tuple[int, str]:
    order = ("queue", "tokenize", "prefill", "first_token")
    return (order.index(phase) if phase in order else len(order), phase)


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
