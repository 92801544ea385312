"""Scenario 5: does `threshold_mode: adaptive` find the best static threshold, and follow a load change?

A. Sweep: a mixed streaming workload (mostly short chat, some long prompts) through dpd-router at
   each static threshold; the best is the one with the lowest short-request ITL p99 among those
   whose short-request TTFT p99 stays within the TTFT budget (`--ttft-budget`; when none does,
   the lowest short-request TTFT p99 wins and the report says so).
B. Convergence: adaptive started from deliberately bad thresholds (512 and 32768); the first
   `--warmup` requests are its warm-up, the rest are measured and compared with the best static
   run (pass: short ITL p99 within 10% of it and short TTFT p99 within the budget).
C. Load change: quiet -> busy -> quiet (concurrency per phase, `--phases`) for the best static
   threshold and for adaptive (started from that same threshold), the router's
   `dpd_router_adaptive_threshold_tokens` scraped every `--scrape` seconds.

One router process per run on the same simulated engines (1 prefill + 1 decode, `--timing
realistic`); every run has its own prompt seed, so no prefix cache carries over.

    python -m benchmarks.adaptive          # about 5 minutes here
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks import loadgen, report, stack
from benchmarks.workload import PromptFactory, Workload
from dpd_router.sim.tokenizer_kit import ensure_tokenizer

NAME = "adaptive"
WITHIN = 0.10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adaptive", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="short:0.85:U(128,1023)/(64,64),long:0.15:U(4096,16384)/(64,64)")
    parser.add_argument("--thresholds", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--bad-starts", type=int, nargs="+", default=[512, 32768])
    parser.add_argument("--requests", type=int, default=60, help="measured requests per sweep/convergence run")
    parser.add_argument("--warmup", type=int, default=30, help="adaptive warm-up requests before measuring")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--phases", type=int, nargs=3, default=[2, 24, 2], help="concurrency quiet busy quiet")
    parser.add_argument("--phase-requests", type=int, nargs=3, default=[16, 72, 16])
    parser.add_argument("--ttft-budget", type=float, default=1.0, help="short-request TTFT p99 budget, seconds")
    parser.add_argument("--scrape", type=float, default=0.5, help="seconds between metric scrapes")
    parser.add_argument("--timing", default="realistic")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="bound per run (and per phase)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["sweep", "converge", "change"])
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument(
        "--slo-variant", action=argparse.BooleanOptionalAction, default=True,
        help="also run the load change with adaptive and ttft_slo = the TTFT budget",
    )  # fmt: skip
    parser.add_argument("--render", action="store_true", help="rewrite results.md and plots from results.json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workload = "short:0.75:U(32,200)/(8,8),long:0.25:U(600,1200)/(8,8)"
        args.thresholds, args.bad_starts = [256, 4096], [256]
        args.requests, args.warmup, args.concurrency = 8, 4, 3
        args.phases, args.phase_requests = [1, 4, 1], [2, 8, 2]
        args.timing, args.max_seconds, args.ttft_budget, args.scrape = "default", 30.0, 5.0, 0.2
    return args


@contextlib.asynccontextmanager
async def started(service: stack.Service, wait: float = 240.0) -> AsyncIterator[stack.Service]:
    """Like stack.running, with a longer start-up wait (a router can take over a minute here under load)."""
    try:
        await service.start(wait=wait)
        yield service
    finally:
        await service.stop()


def adaptive_settings(**extra: object) -> dict[str, object]:
    return {"threshold_mode": "adaptive", **extra}


def requests_for(args: argparse.Namespace, factory: PromptFactory, count: int, seed: int) -> list[loadgen.Request]:
    return loadgen.build_requests(Workload.parse(args.workload), count, factory, seed=seed)


async def scrape(url: str, samples: list[dict[str, Any]], t0: float, every: float, stop: asyncio.Event) -> None:
    """`dpd_router_adaptive_threshold_tokens` (per decoder) every `every` seconds until `stop`."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=2.0) as client:
        while not stop.is_set():
            try:
                text = (await client.get(url + "/metrics")).text
            except httpx.HTTPError:
                text = ""
            now = time.perf_counter() - t0
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "dpd_router_adaptive_threshold_tokens":
                        value = sample.value
                        samples.append({"t": now, "decoder": sample.labels.get("decoder"), "tokens": value})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)


def short_stats(summary: dict[str, Any]) -> dict[str, Any]:
    return summary.get("short", summary["all"])


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


async def one_run(
    args: argparse.Namespace,
    cluster: Any,
    factory: PromptFactory,
    *,
    threshold: int,
    settings: dict[str, object],
    seed: int,
    warmup: int,
    label: str,
) -> dict[str, Any]:
    (p,), (d,) = cluster.prefill_urls, cluster.decode_urls
    router = stack.dpd_router(decode=[d], prefill=[p], threshold=threshold, settings=settings, name="adaptive-bench")
    requests = requests_for(args, factory, warmup + args.requests, seed)
    async with started(router):
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        scraper = asyncio.create_task(scrape(router.url, samples, t0, args.scrape, stop))
        try:
            result = await loadgen.run(
                [router.url], requests, concurrency=args.concurrency, duration=args.max_seconds, label=label,
                progress=not args.quiet,
            )  # fmt: skip
        finally:
            stop.set()
            await scraper
        decisions = await stack.route_decisions(router.url)
    measured = [r for r in result.records if r.index >= warmup]
    warm = [r for r in result.records if r.index < warmup]
    ends = [r.start + r.e2e for r in measured if r.e2e is not None]
    wall = (max(ends) - min(r.start for r in measured)) if ends else result.wall
    summary = report.summarize_run(loadgen.RunResult(measured, result.started, wall))
    out = {
        "threshold": threshold,
        "settings": settings,
        "seed": seed,
        "warmup": warmup,
        "summary": summary,
        "decisions": {k: int(v) for k, v in decisions.items() if v},
        "threshold_samples": samples,
    }
    if warm:
        out["warmup_summary"] = report.summarize_run(loadgen.RunResult(warm, result.started, result.wall))
        out["warmup_seconds"] = max((r.start + (r.e2e or 0)) for r in warm)
    return out


def pick_best(runs: list[dict[str, Any]], budget: float) -> tuple[dict[str, Any], bool]:
    """Lowest short ITL p99 within the TTFT budget; else lowest short TTFT p99 (second item False)."""
    ok = [r for r in runs if (short_stats(r["summary"])["ttft"]["p99"] or math.inf) <= budget]
    if ok:
        return min(ok, key=lambda r: short_stats(r["summary"])["itl"]["p99"] or math.inf), True
    return min(runs, key=lambda r: short_stats(r["summary"])["ttft"]["p99"] or math.inf), False


async def load_change(
    args: argparse.Namespace,
    cluster: Any,
    factory: PromptFactory,
    *,
    threshold: int,
    adaptive: bool,
    seed: int,
    slo: float | None = None,
) -> dict[str, Any]:
    (p,), (d,) = cluster.prefill_urls, cluster.decode_urls
    settings = adaptive_settings() if adaptive else {"threshold_mode": "static"}
    if slo is not None:
        settings["ttft_slo"] = slo
    router = stack.dpd_router(decode=[d], prefill=[p], threshold=threshold, settings=settings, name="change")
    phases = []
    samples: list[dict[str, Any]] = []
    async with started(router):
        stop = asyncio.Event()
        t0 = time.perf_counter()
        scraper = asyncio.create_task(scrape(router.url, samples, t0, args.scrape, stop))
        try:
            for pi, (conc, count) in enumerate(zip(args.phases, args.phase_requests, strict=True)):
                name = ("quiet-1", "busy", "quiet-2")[pi]
                requests = requests_for(args, factory, count, seed * 10 + pi)
                begin = time.perf_counter() - t0
                label = f"{'adaptive' if adaptive else 'static'} {threshold} {name} c={conc}"
                result = await loadgen.run(
                    [router.url], requests, concurrency=conc, duration=args.max_seconds, label=label,
                    progress=not args.quiet,
                )  # fmt: skip
                end = time.perf_counter() - t0
                phases.append(
                    {"phase": name, "concurrency": conc, "start": begin, "end": end}
                    | {"summary": report.summarize_run(result)}
                    | {"itl_timeline": gap_timeline(result, t0)}
                )
        finally:
            stop.set()
            await scraper
        decisions = await stack.route_decisions(router.url)
    for phase in phases:
        values = [s["tokens"] for s in samples if phase["start"] <= s["t"] <= phase["end"]]
        fin = [v for v in values if math.isfinite(v)]
        phase["threshold_tokens"] = {
            "samples": len(values),
            "infinite": len(values) - len(fin),
            "median": report.percentile(fin, 50),
            "min": min(fin) if fin else None,
            "max": max(fin) if fin else None,
        }
    return {
        "mode": ("adaptive" if adaptive else "static") + (f"+slo{slo:g}s" if slo is not None else ""),
        "threshold": threshold,
        "phases": phases,
        "decisions": {k: int(v) for k, v in decisions.items() if v},
        "threshold_samples": samples,
    }


def gap_timeline(result: loadgen.RunResult, t0: float, window: float = 2.0) -> list[dict[str, float | None]]:
    """Short requests' ITL p99 and TTFT p50 per `window` seconds, on the load-change run's clock."""
    buckets: dict[int, tuple[list[float], list[float]]] = {}
    for record in result.records:
        if record.cls != "short" or not record.ok:
            continue
        times = loadgen.token_times(record, result.started)
        for a, b in itertools.pairwise(times):
            buckets.setdefault(int((b - t0) // window), ([], []))[0].append(b - a)
        if times:
            buckets.setdefault(int((times[0] - t0) // window), ([], []))[1].append(record.ttft or 0.0)
    return [
        {"t": (k + 0.5) * window, "itl_p99": report.percentile(g, 99), "ttft_p50": report.percentile(f, 50)}
        for k, (g, f) in sorted(buckets.items())
    ]


def fmt_threshold(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if not math.isfinite(value) else f"{value:,.0f}"


def run_row(name: str, run: dict[str, Any]) -> list[Any]:
    s, a = short_stats(run["summary"]), run["summary"]["all"]
    disagg = sum(v for k, v in run["decisions"].items() if k.startswith("disaggregated/"))
    long_ttft = run["summary"].get("long", {}).get("ttft", {}).get("p50")
    return [
        name,
        report.ms(s["itl"]["p99"]),
        report.ms(s["itl"]["p50"]),
        report.ms(s["ttft"]["p50"]),
        report.ms(s["ttft"]["p99"]),
        report.ms(long_ttft),
        report.num(a["out_tok_per_s"], 0),
        disagg,
        a["errors"],
    ]


RUN_HEADERS = [
    "run",
    "short ITL p99 ms",
    "short ITL p50 ms",
    "short TTFT p50 ms",
    "short TTFT p99 ms",
    "long TTFT p50 ms",
    "out tok/s",
    "disaggregated",
    "errors",
]


def write(results: dict[str, Any], args: argparse.Namespace) -> str:
    md = [f"# Scenario 5: the adaptive threshold ({results['env']['when']}, {results['env']['commit']})", ""]
    md += [
        f"1 prefill + 1 decode simulated engine, `--timing {args.timing}`; workload `{args.workload}`, "
        f"streaming. TTFT budget: short-request TTFT p99 <= {args.ttft_budget * 1000:.0f} ms. "
        f"One run per configuration on a loaded 2-core machine: differences under ~10-20% are noise. "
        f"Total {results['seconds']:.0f} s.",
        "",
    ]
    sweep = results.get("sweep") or []
    if sweep:
        best = results["best"]
        md += [f"## A. Static sweep ({args.requests} requests at concurrency {args.concurrency})", ""]
        rows = [run_row(f"static {r['threshold']}", r) for r in sweep]
        md += [report.table(RUN_HEADERS, rows), ""]
        md += [
            f"Best static: **{best['threshold']}** "
            + ("(within the TTFT budget)" if best["within_budget"] else "(no threshold met the budget: lowest TTFT)"),
            "",
        ]
    conv = results.get("converge") or []
    if conv:
        md += [
            f"## B. Adaptive from a bad start ({args.warmup} warm-up requests, then {args.requests} measured)",
            "",
        ]
        rows = [run_row(f"adaptive from {r['threshold']}", r) for r in conv]
        if sweep:
            rows.insert(0, run_row(f"best static {results['best']['threshold']}", results["best"]["run"]))
        md += [report.table(RUN_HEADERS, rows), ""]
        verdict_rows = [
            [
                r["threshold"],
                f"{r['warmup_seconds']:.1f}" if "warmup_seconds" in r else "-",
                r["verdict"]["itl_vs_best"],
                "yes" if r["verdict"]["ttft_within_budget"] else "no",
                "**yes**" if r["verdict"]["reached"] else "**no**",
                fmt_threshold(r["verdict"]["threshold_median_measured"]),
            ]
            for r in conv
        ]
        headers = [
            "start threshold",
            "warm-up s",
            "short ITL p99 vs best",
            "TTFT in budget",
            "within 10%",
            "effective threshold (median, measured part)",
        ]
        md += [report.table(headers, verdict_rows), ""]
    change = results.get("change") or []
    if change:
        md += [
            f"## C. Load change (concurrency {' -> '.join(map(str, args.phases))}, "
            f"{' / '.join(map(str, args.phase_requests))} requests)",
            "",
        ]
        rows = []
        for run in change:
            for phase in run["phases"]:
                s = short_stats(phase["summary"])
                a = phase["summary"]["all"]
                th = phase["threshold_tokens"]
                rows.append(
                    [
                        f"{run['mode']} {run['threshold']}",
                        f"{phase['phase']} (c={phase['concurrency']})",
                        report.ms(s["itl"]["p99"]),
                        report.ms(s["ttft"]["p50"]),
                        report.ms(s["ttft"]["p99"]),
                        report.ms(phase["summary"].get("long", {}).get("ttft", {}).get("p50")),
                        report.num(a["out_tok_per_s"], 0),
                        fmt_threshold(th["median"])
                        + (f" ({th['infinite']}/{th['samples']} inf)" if th["infinite"] else "")
                        + ("" if run["mode"].startswith("adaptive") else f"; routes at static {run['threshold']}"),
                        a["errors"],
                    ]
                )
        headers = [
            "run",
            "phase",
            "short ITL p99 ms",
            "short TTFT p50 ms",
            "short TTFT p99 ms",
            "long TTFT p50 ms",
            "out tok/s",
            "metric adaptive_threshold_tokens, median",
            "errors",
        ]
        md += [report.table(headers, rows), ""]
        md += ["Route decisions per run (path/reason: count):", ""]
        md += [f"- {r['mode']} {r['threshold']}: {r['decisions']}" for r in change] + [""]
    if conv:
        md += ["Route decisions, convergence runs:", ""]
        md += [f"- adaptive from {r['threshold']}: {r['decisions']}" for r in conv] + [""]
    md += [f"![{name}]({name})" for name in results.get("plots", [])]
    text = "\n".join(md) + "\n"
    (args.out / "results.md").write_text(text)
    return text


def plotted_threshold(tokens: float) -> float:
    """+Inf (the router would not disaggregate at all) drawn at 2^16 tokens, above max_threshold."""
    return tokens if math.isfinite(tokens) else 65536.0


def plot(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    plt = report.plotting()
    if plt is None:
        return []
    written = []
    change = results.get("change") or []
    if change:
        fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
        for ci, run in enumerate(change):
            label = f"{run['mode']} {run['threshold']}"
            xs = [s["t"] for s in run["threshold_samples"]]
            ys = [plotted_threshold(s["tokens"]) for s in run["threshold_samples"]]
            if run["mode"].startswith("adaptive"):
                axes[0].plot(xs, ys, label=label, drawstyle="steps-post", color=f"C{ci}")
            else:
                axes[0].axhline(run["threshold"], linestyle="--", color=f"C{ci}", label=label)
            timeline = [p for ph in run["phases"] for p in ph["itl_timeline"]]
            axes[1].plot(
                [p["t"] for p in timeline],
                [(p["itl_p99"] or math.nan) * 1000 for p in timeline],
                marker=".",
                label=label,
                color=f"C{ci}",
            )
            axes[2].plot(
                [p["t"] for p in timeline],
                [(p["ttft_p50"] or math.nan) * 1000 for p in timeline],
                marker=".",
                label=label,
                color=f"C{ci}",
            )
            for phase in run["phases"]:
                if phase["phase"] == "busy":
                    for ax in axes:
                        ax.axvspan(
                            phase["start"],
                            phase["end"],
                            alpha=0.06,
                            color="C1" if run["mode"].startswith("adaptive") else "C0",
                        )
        axes[0].set_yscale("log", base=2)
        axes[0].set_title(
            "effective threshold (tokens; adaptive scraped, static dashed; 2^16 = +Inf, never disaggregate)"
        )
        axes[1].set_title("short requests' ITL p99 per 2 s (ms)")
        axes[2].set_title("short requests' TTFT p50 per 2 s (ms)")
        axes[2].set_xlabel("seconds since the run started (shaded: busy phase)")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = args.out / "load_change.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    sweep = results.get("sweep") or []
    conv = results.get("converge") or []
    if sweep:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        xs = [str(r["threshold"]) for r in sweep]
        axes[0].plot(xs, [short_stats(r["summary"])["itl"]["p99"] * 1000 for r in sweep], marker="o", label="static")
        axes[1].plot(xs, [short_stats(r["summary"])["ttft"]["p99"] * 1000 for r in sweep], marker="o", label="static")
        axes[1].axhline(args.ttft_budget * 1000, color="red", linestyle=":", label="TTFT budget")
        for i, run in enumerate(conv):
            s = short_stats(run["summary"])
            kw = {"color": f"C{i + 1}", "linestyle": "--", "label": f"adaptive from {run['threshold']}"}
            axes[0].axhline(s["itl"]["p99"] * 1000, **kw)
            axes[1].axhline(s["ttft"]["p99"] * 1000, **kw)
        for ax, title in zip(axes, ("short ITL p99 (ms)", "short TTFT p99 (ms)"), strict=True):
            ax.set_xlabel("static routing threshold (tokens)")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = args.out / "sweep.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    if conv:
        fig, ax = plt.subplots(figsize=(11, 3.5))
        for run in conv:
            xs = [s["t"] for s in run["threshold_samples"]]
            ys = [plotted_threshold(s["tokens"]) for s in run["threshold_samples"]]
            ax.plot(xs, ys, drawstyle="steps-post", label=f"adaptive from {run['threshold']}")
        if sweep:
            ax.axhline(results["best"]["threshold"], color="grey", linestyle="--", label="best static")
        ax.set_yscale("log", base=2)
        ax.set_title("effective threshold during the convergence runs (tokens; 2^16 = +Inf)")
        ax.set_xlabel("seconds since the run started")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = args.out / "convergence.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


def verdict(run: dict[str, Any], best: dict[str, Any] | None, budget: float) -> dict[str, Any]:
    s = short_stats(run["summary"])
    measured_from = run.get("warmup_seconds", 0.0)
    fin = [x["tokens"] for x in run["threshold_samples"] if x["t"] >= measured_from and math.isfinite(x["tokens"])]
    out: dict[str, Any] = {
        "ttft_within_budget": (s["ttft"]["p99"] or math.inf) <= budget,
        "threshold_median_measured": report.percentile(fin, 50),
        "itl_vs_best": "-",
        "reached": False,
    }
    if best is not None:
        base = short_stats(best["summary"])["itl"]["p99"]
        ratio = (s["itl"]["p99"] or math.inf) / base if base else math.inf
        out["itl_ratio"] = ratio
        out["itl_vs_best"] = f"{ratio:.2f}x"
        out["reached"] = ratio <= 1 + WITHIN and out["ttft_within_budget"]
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    factory = PromptFactory(ensure_tokenizer())
    extra = ["--max-model-len", "40000"]
    results: dict[str, Any] = {}
    seed = 500
    async with stack.engines(prefill=1, decode=1, timing=args.timing, extra_args=extra) as cluster:
        best_run = None
        if "sweep" not in args.skip:
            sweep = []
            for threshold in args.thresholds:
                seed += 1
                run = await one_run(
                    args, cluster, factory, threshold=threshold, settings={"threshold_mode": "static"}, seed=seed,
                    warmup=0, label=f"static {threshold:>6}",
                )  # fmt: skip
                sweep.append(run)
                if not args.quiet:
                    s = short_stats(run["summary"])
                    print(f"static {threshold}: short ITL p99 {report.ms(s['itl']['p99'])} ms, "
                          f"TTFT p99 {report.ms(s['ttft']['p99'])} ms", file=sys.stderr)  # fmt: skip
            results["sweep"] = sweep
            best_run, within = pick_best(sweep, args.ttft_budget)
            results["best"] = {"threshold": best_run["threshold"], "within_budget": within, "run": best_run}
        if "converge" not in args.skip:
            conv = []
            for start in args.bad_starts:
                seed += 1
                run = await one_run(
                    args, cluster, factory, threshold=start, settings=adaptive_settings(), seed=seed,
                    warmup=args.warmup, label=f"adaptive from {start:>6}",
                )  # fmt: skip
                run["verdict"] = verdict(run, best_run, args.ttft_budget)
                conv.append(run)
                if not args.quiet:
                    print(f"adaptive from {start}: {run['verdict']}", file=sys.stderr)
            results["converge"] = conv
        if "change" not in args.skip:
            base = best_run["threshold"] if best_run is not None else args.thresholds[0]
            change = []
            variants = [(False, None), (True, None)] + ([(True, args.ttft_budget)] if args.slo_variant else [])
            for adaptive, slo in variants:
                seed += 1
                run = await load_change(args, cluster, factory, threshold=base, adaptive=adaptive, seed=seed, slo=slo)
                change.append(run)
            results["change"] = change
    results["env"] = report.environment()
    results["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results["seconds"] = time.monotonic() - started
    results["plots"] = plot(results, args)
    report.write_json(args.out / "results.json", results)
    print(write(results, args))
    return results


def render(args: argparse.Namespace) -> None:
    import json

    results = json.loads((args.out / "results.json").read_text())
    for key, value in results["args"].items():
        if key not in ("out", "render"):
            setattr(args, key, value)
    results["plots"] = plot(results, args)
    report.write_json(args.out / "results.json", results)
    print(write(results, args))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        render(args)
        return 0
    stack.run_async(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
