"""The report as plain-text tables."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpd_router.advise.report import Report


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
        else "  (no dpd_router_ttft_by_prompt_length_seconds samples)"
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
