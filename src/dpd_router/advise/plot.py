"""The report as a PNG chart (matplotlib, from the `bench` extra, imported only when drawing)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dpd_router.advise.report import ArmClassStats, ArmsReport, Report

PLOT_INSTALL_HINT = "pip install 'dpd-router[bench]'  (or: pip install matplotlib)"


def plot(report: Report, out: Path) -> None:
    """A PNG: on top, TTFT per path against prompt length (mean per bucket, with the p50-p90 band);
    below, the requests per prompt-length bucket and path (the distribution); the recommended and the
    current thresholds as vertical lines on both; when the scrape has arms (experiment arms, a shadow), a
    last row with their TTFT p95 and ITL p99 per prompt-length class side by side, with the bootstrap
    intervals. Needs matplotlib (imported here, not at module load)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    rows = [row for row in report.ttft if row.upper is not None]
    series = _arm_series(report.arms)
    if len(series) > 1:
        fig, axes = plt.subplot_mosaic(
            [["ttft", "ttft"], ["dist", "dist"], ["arms_ttft", "arms_itl"]],
            figsize=(10, 10.5),
            height_ratios=(3, 1.3, 2.2),
        )
        ax, dist = axes["ttft"], axes["dist"]
        dist.sharex(ax)
        assert report.arms is not None
        for axis, metric, title in (
            (axes["arms_ttft"], "ttft_p95", "TTFT p95"),
            (axes["arms_itl"], "itl_p99", "ITL p99"),
        ):
            _arm_bars(axis, report.arms.classes, series, metric, f"{title} by arm and prompt-length class")
    else:
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
    dist.set_xlabel("prompt tokens (the prompt_tokens buckets of dpd_router_time_to_first_token_seconds)")
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


def _arm_series(arms: ArmsReport | None) -> dict[str, dict[str, ArmClassStats]]:
    """Per bar series (an arm's whole traffic, or a shadow path), its row per class."""
    if arms is None:
        return {}
    series: dict[str, dict[str, ArmClassStats]] = {}
    for row in arms.stats:
        if row.arm == "shadow":
            series.setdefault(f"shadow {row.path}", {})[row.request_class] = row
            continue
        chosen = series.setdefault(row.arm, {})
        # an arm's "all" row when it served a class on several paths; its one path's row otherwise
        if row.path == "all" or row.request_class not in chosen:
            chosen[row.request_class] = row
    return series


def _arm_bars(
    axis: Any, classes: list[str], series: dict[str, dict[str, ArmClassStats]], metric: str, title: str
) -> None:
    width = 0.8 / len(series)
    for i, (name, by_class) in enumerate(series.items()):
        xs, values, below, above = [], [], [], []
        for position, request_class in enumerate(classes):
            row = by_class.get(request_class)
            estimate = row.metrics.get(metric) if row else None
            if estimate is None or estimate.value is None:
                continue
            xs.append(position - 0.4 + width * (i + 0.5))
            values.append(estimate.value)
            below.append(estimate.value - (estimate.low if estimate.low is not None else estimate.value))
            above.append((estimate.high if estimate.high is not None else estimate.value) - estimate.value)
        if xs:
            axis.bar(xs, values, width=width * 0.9, yerr=[below, above], capsize=3, label=name, alpha=0.8)
    axis.set_xticks(range(len(classes)))
    axis.set_xticklabels([f"{c} tokens" for c in classes])
    axis.set_ylabel("seconds")
    axis.set_title(title, fontsize="medium")
    axis.legend(fontsize="small")
    axis.grid(True, axis="y", alpha=0.3)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
