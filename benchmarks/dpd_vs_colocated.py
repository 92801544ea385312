"""Scenario 1: disaggregated prefill/decode against colocated serving, on simulated engines.

Setups, all with the same engine timing and each behind its own dpd-router process:
- `dpd`: 1 prefill + 1 decode engine; prompts at or above the threshold go prefiller -> decoder,
  with the router's defaults (its prefill-busy gate sends prompts direct when the prefill queue
  is deeper than 8);
- `dpd-nogate`: the same with the gate off (`prefill_busy_max_tokens: 0`): every long prompt is
  disaggregated, the seed's shape;
- `colocated-2`: 2 `both` engines, every request direct (equal engine count);
- `colocated-1`: 1 `both` engine (the seed's baseline shape).
Workloads: the seed's fixed `D(4096,256)` at concurrency 8/16/32, and the scaled finance mix.
Setups are interleaved within every repeat; the tables give medians over repeats.

    python -m benchmarks.dpd_vs_colocated                 # ours + genai-bench, about 25 minutes here
    python -m benchmarks.dpd_vs_colocated --tool harness  # our harness only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import loadgen, report, stack, tools
from benchmarks.workload import FINANCE_MIX_SCALED, PromptFactory, Workload
from dpd_sim.tokenizer_kit import ensure_tokenizer

SETUPS = ("dpd", "dpd-nogate", "colocated-2", "colocated-1")
DPD_SETUPS = ("dpd", "dpd-nogate")
BASELINES = ("colocated-1", "colocated-2")
NAME = "dpd_vs_colocated"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dpd_vs_colocated", description=__doc__.split("\n")[0])
    parser.add_argument("--tool", choices=("harness", "genai-bench", "both"), default="both")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument(
        "--merge",
        type=Path,
        default=None,
        help="an earlier results.json of this scenario: keep its runs of the (tool, setup) pairs not run now",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--fixed", default="D(4096,256)", help="the fixed-length workload")
    parser.add_argument("--mixed", default=FINANCE_MIX_SCALED, help="the mixed workload ('' to skip)")
    parser.add_argument("--mixed-concurrency", type=int, default=16)
    parser.add_argument("--mixed-requests", type=int, default=100)
    parser.add_argument("--requests-per-stream", type=int, default=4, help="fixed runs send this x concurrency")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--genai-repeats", type=int, default=1)
    parser.add_argument("--timing", default="realistic", help="engine timing preset (default: realistic)")
    parser.add_argument("--threshold", type=int, default=4096, help="dpd-router's routing_threshold")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="limit per run")
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and fast engines, seconds")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tool, args.concurrency, args.fixed = "harness", [2], "D(300,8)"
        args.mixed, args.mixed_concurrency, args.mixed_requests = "short:0.7:U(16,64)/(8,8),long:0.3:D(400,8)", 3, 10
        args.requests_per_stream, args.repeats, args.timing, args.threshold = 2, 1, "default", 256
        args.max_seconds = 30.0
    return args


async def bring_up(args: argparse.Namespace) -> tuple[dict[str, stack.Service], list[Any]]:
    """Every setup's engines and router, started once and left idle while another setup runs."""
    extra = ["--max-model-len", "40000", "--max-batch-size", "256"]
    clusters = [
        stack.engines(prefill=1, decode=1, timing=args.timing, extra_args=extra),
        stack.engines(prefill=1, decode=1, timing=args.timing, extra_args=extra),
        stack.engines(both=2, timing=args.timing, extra_args=extra),
        stack.engines(both=1, timing=args.timing, extra_args=extra),
    ]
    started = [await cluster.__aenter__() for cluster in clusters]
    dpd, nogate, colo2, colo1 = started
    routers = {
        "dpd": stack.dpd_router(prefill=dpd.prefill_urls, decode=dpd.decode_urls, threshold=args.threshold),
        "dpd-nogate": stack.dpd_router(
            prefill=nogate.prefill_urls,
            decode=nogate.decode_urls,
            threshold=args.threshold,
            settings={"prefill_busy_max_tokens": 0},
        ),
        "colocated-2": stack.dpd_router(decode=colo2.both_urls, threshold=args.threshold),
        "colocated-1": stack.dpd_router(decode=colo1.both_urls, threshold=args.threshold),
    }
    await asyncio.gather(*(router.start() for router in routers.values()))
    return routers, clusters


async def run_harness(
    router: stack.Service, requests: list[loadgen.Request], concurrency: int, args: argparse.Namespace, label: str
) -> dict[str, Any]:
    before = await stack.route_decisions(router.url)
    result = await loadgen.run(
        [router.url],
        requests,
        concurrency=concurrency,
        duration=args.max_seconds,
        drain=60.0,
        label=label,
        progress=not args.quiet,
    )
    after = await stack.route_decisions(router.url)
    out = {"summary": report.summarize_run(result), "decisions": stack.decisions_delta(before, after)}
    short_gaps = [round(g, 5) for r in result.records if r.cls == "short" and r.ok for g in r.gaps]
    if short_gaps:
        out["short_gaps"] = short_gaps[:: max(1, len(short_gaps) // 5000)]
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    factory = PromptFactory(ensure_tokenizer())
    fixed = Workload.parse(args.fixed)
    mixed = Workload.parse(args.mixed) if args.mixed else None
    tools_used = ["harness", "genai-bench"] if args.tool == "both" else [args.tool]
    if "genai-bench" in tools_used:
        tools.ensure_venv("genai-bench")
    routers, clusters = await bring_up(args)
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for ci, concurrency in enumerate(args.concurrency):
                count = concurrency * args.requests_per_stream
                requests = loadgen.build_requests(fixed, count, factory, seed=1000 * repeat + concurrency)
                for si in range(len(args.setups)):
                    setup = args.setups[(si + repeat + ci) % len(args.setups)]
                    label = f"r{repeat} {setup} c={concurrency} {args.fixed}"
                    out = await run_harness(routers[setup], requests, concurrency, args, label)
                    runs.append(
                        {"tool": "harness", "workload": "fixed", "setup": setup, "concurrency": concurrency}
                        | {"repeat": repeat, **out}
                    )
            if mixed is not None:
                requests = loadgen.build_requests(
                    mixed, args.mixed_requests, factory, seed=7 + repeat, prompt_seed=1000 * repeat + 999
                )
                for si in range(len(args.setups)):
                    setup = args.setups[(si + repeat) % len(args.setups)]
                    label = f"r{repeat} {setup} c={args.mixed_concurrency} mixed"
                    out = await run_harness(routers[setup], requests, args.mixed_concurrency, args, label)
                    runs.append(
                        {"tool": "harness", "workload": "mixed", "setup": setup}
                        | {"concurrency": args.mixed_concurrency, "repeat": repeat, **out}
                    )
        if "genai-bench" in tools_used:
            for repeat in range(args.genai_repeats):
                for ci, concurrency in enumerate(args.concurrency):
                    for si in range(len(args.setups)):
                        setup = args.setups[(si + repeat + ci) % len(args.setups)]
                        print(f"genai-bench r{repeat} {setup} c={concurrency} {args.fixed} ...", file=sys.stderr)
                        metrics = await tools.genai_bench(
                            routers[setup].url,
                            args.fixed,
                            concurrency,
                            max_requests=concurrency * args.requests_per_stream,
                            max_minutes=max(1, int(args.max_seconds // 60)),
                        )
                        runs.append(
                            {"tool": "genai-bench", "workload": "fixed", "setup": setup, "concurrency": concurrency}
                            | {"repeat": repeat, "summary": {"all": tools.genai_summary(metrics)}}
                        )
    finally:
        await asyncio.gather(*(router.stop() for router in routers.values()), return_exceptions=True)
        for cluster in clusters:
            await cluster.__aexit__(None, None, None)
    return {"runs": runs}


def aggregate(runs: list[dict[str, Any]], tool: str, workload: str, group: str = "all") -> dict[tuple[str, int], Any]:
    """Median over repeats of every metric, per (setup, concurrency)."""
    keys = {(r["setup"], r["concurrency"]) for r in runs if r["tool"] == tool and r["workload"] == workload}
    out: dict[tuple[str, int], Any] = {}
    for setup, concurrency in keys:
        summaries = [
            r["summary"][group]
            for r in runs
            if r["tool"] == tool
            and r["workload"] == workload
            and r["setup"] == setup
            and r["concurrency"] == concurrency
            and group in r["summary"]
        ]
        if not summaries:
            continue
        merged: dict[str, Any] = {"repeats": len(summaries), "errors": sum(s["errors"] or 0 for s in summaries)}
        for key in ("req_per_s", "out_tok_per_s"):
            merged[key] = report.median_of(s[key] for s in summaries)
        for metric in ("ttft", "tpot", "itl", "e2e"):
            merged[metric] = {q: report.median_of(s[metric][q] for s in summaries) for q in ("p50", "p90", "p99")}
        out[(setup, concurrency)] = merged
    return out


def fixed_tables(runs: list[dict[str, Any]], tool: str, concurrencies: list[int]) -> str:
    agg = aggregate(runs, tool, "fixed")
    if not agg:
        return ""
    rows = []
    for concurrency in concurrencies:
        for setup in SETUPS:
            m = agg.get((setup, concurrency))
            if m is None:
                continue
            rows.append(
                [
                    setup,
                    concurrency,
                    ms(m["ttft"]["p50"]),
                    ms(m["tpot"]["p50"]),
                    ms(m["tpot"]["p99"]),
                    ms(m["itl"]["p99"]),
                    f"{m['e2e']['p50']:.2f}",
                    report.num(m["out_tok_per_s"], 0),
                    report.num(m["req_per_s"], 2),
                    m["errors"],
                    m["repeats"],
                ]
            )
    main = report.table(
        [
            "setup",
            "conc",
            "TTFT p50 ms",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "ITL p99 ms",
            "E2E p50 s",
            "out tok/s",
            "req/s",
            "errors",
            "repeats",
        ],
        rows,
    )
    rel_rows = []
    for concurrency in concurrencies:
        for variant, base in [(v, b) for v in DPD_SETUPS for b in BASELINES]:
            dpd, b = agg.get((variant, concurrency)), agg.get((base, concurrency))
            if dpd is None or b is None:
                continue
            rel_rows.append(
                [
                    f"{variant} vs {base}",
                    concurrency,
                    report.pct_change(dpd["tpot"]["p50"], b["tpot"]["p50"]),
                    report.pct_change(dpd["out_tok_per_s"], b["out_tok_per_s"], lower_is_better=False),
                    report.pct_change(dpd["e2e"]["p50"], b["e2e"]["p50"]),
                    report.pct_change(dpd["ttft"]["p50"], b["ttft"]["p50"]),
                ]
            )
    relative = report.table(
        ["DPD", "conc", "TPOT p50", "output throughput", "E2E p50", "TTFT p50 (negative = DPD slower)"], rel_rows
    )
    return f"{main}\n\nDPD's change (positive = better), the seed's format:\n\n{relative}"


def mixed_table(runs: list[dict[str, Any]]) -> str:
    groups = sorted({g for r in runs if r["workload"] == "mixed" for g in r["summary"]})
    if not groups:
        return ""
    rows = []
    for setup in SETUPS:
        agg_all = aggregate(runs, "harness", "mixed", "all")
        concurrency = next((c for s, c in agg_all if s == setup), None)
        if concurrency is None:
            continue
        m = agg_all[(setup, concurrency)]
        short = aggregate(runs, "harness", "mixed", "short").get((setup, concurrency)) if "short" in groups else None
        long_ = aggregate(runs, "harness", "mixed", "long").get((setup, concurrency)) if "long" in groups else None
        rows.append(
            [
                setup,
                concurrency,
                ms(short["itl"]["p50"]) if short else "-",
                ms(short["itl"]["p99"]) if short else "-",
                ms(short["ttft"]["p50"]) if short else "-",
                ms(long_["ttft"]["p50"]) if long_ else "-",
                ms(m["tpot"]["p50"]),
                f"{m['e2e']['p50']:.2f}",
                report.num(m["out_tok_per_s"], 0),
                m["errors"],
            ]
        )
    table = report.table(
        [
            "setup",
            "conc",
            "short ITL p50 ms",
            "short ITL p99 ms",
            "short TTFT p50 ms",
            "long TTFT p50 ms",
            "TPOT p50 ms",
            "E2E p50 s",
            "out tok/s",
            "errors",
        ],
        rows,
    )
    agg_short = aggregate(runs, "harness", "mixed", "short")
    changes = []
    for variant, base in [(v, b) for v in DPD_SETUPS for b in BASELINES]:
        d = next((v for (s, _), v in agg_short.items() if s == variant), None)
        b = next((v for (s, _), v in agg_short.items() if s == base), None)
        if d and b:
            changes.append(
                f"short requests' ITL p99, {variant} vs {base}: {report.pct_change(d['itl']['p99'], b['itl']['p99'])}"
            )
    return table + ("\n\n" + "; ".join(changes) if changes else "")


def ms(value: float | None) -> str:
    return report.ms(value, 1)


def targets(runs: list[dict[str, Any]], concurrencies: list[int]) -> list[str]:
    lines = []
    agg = aggregate(runs, "harness", "fixed")
    lo, hi = min(concurrencies), max(concurrencies)
    for setup in SETUPS:
        a, b = agg.get((setup, lo)), agg.get((setup, hi))
        if a and b and a["tpot"]["p50"] and b["tpot"]["p50"]:
            lines.append(f"TPOT p50 {setup}: x{b['tpot']['p50'] / a['tpot']['p50']:.2f} from concurrency {lo} to {hi}")
    agg_short = aggregate(runs, "harness", "mixed", "short")
    for variant, base in [(v, b) for v in DPD_SETUPS for b in BASELINES]:
        d = next((v for (s, _), v in agg_short.items() if s == variant), None)
        b = next((v for (s, _), v in agg_short.items() if s == base), None)
        if d and b and b["itl"]["p99"]:
            change = (b["itl"]["p99"] - d["itl"]["p99"]) / b["itl"]["p99"]
            verdict = "met" if change >= 0.60 else "missed"
            lines.append(f"short ITL p99, {variant} vs {base}: {change * 100:+.0f}% (target +60%: {verdict})")
    return lines


def plot(runs: list[dict[str, Any]], concurrencies: list[int], out: Path) -> list[str]:
    plt = report.plotting()
    if plt is None:
        return []
    written = []
    agg = aggregate(runs, "harness", "fixed")
    if agg:
        fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
        panels = [
            ("TPOT p50 (ms)", lambda m: m["tpot"]["p50"] * 1000),
            ("output tokens/s", lambda m: m["out_tok_per_s"]),
            ("TTFT p50 (s)", lambda m: m["ttft"]["p50"]),
            ("E2E p50 (s)", lambda m: m["e2e"]["p50"]),
        ]
        for ax, (title, get) in zip(axes, panels, strict=True):
            for setup in SETUPS:
                xs = [c for c in concurrencies if (setup, c) in agg]
                ax.plot(xs, [get(agg[(setup, c)]) for c in xs], marker="o", label=setup)
            ax.set_title(title)
            ax.set_xlabel("concurrency")
            ax.set_xticks(concurrencies)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle("DPD (1P+1D) vs colocated, fixed-length prompts, simulated engines (medians over repeats)")
        fig.tight_layout()
        path = out / "fixed.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    mixed = [r for r in runs if r["workload"] == "mixed"]
    if mixed:
        fig, ax = plt.subplots(figsize=(7, 4))
        for setup in SETUPS:
            gaps = sorted(g for r in mixed if r["setup"] == setup for g in r.get("short_gaps", []))
            if gaps:
                ys = [1 - i / len(gaps) for i in range(len(gaps))]
                ax.plot([g * 1000 for g in gaps], ys, label=setup)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("inter-token gap of short requests (ms, log)")
        ax.set_ylabel("fraction of gaps at least this long (log)")
        ax.set_title("Mixed workload: the tail of the short requests' inter-token gaps")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / "mixed_short_itl_cdf.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


def write(results: dict[str, Any], args: argparse.Namespace) -> str:
    runs = results["runs"]
    sections = [f"# Scenario 1: DPD vs colocated ({results['env']['when']}, {results['env']['commit']})", ""]
    sections.append(f"Engines: `--timing {args.timing}`; router threshold {args.threshold}; ")
    sections.append(f"fixed `{args.fixed}`, {args.requests_per_stream} requests per stream; repeats {args.repeats}.\n")
    if results.get("merged"):
        merged = results["merged"]
        sections.append(
            f"Merged: {merged['runs']} runs of other setups or tools are kept from the run of {merged['when']} "
            f"(`--merge`); only the setups {', '.join(args.setups)} ({args.tool}) were measured now.\n"
        )
    for tool in ("harness", "genai-bench"):
        text = fixed_tables(runs, tool, args.concurrency)
        if text:
            sections += [f"## Fixed `{args.fixed}`, {tool}", "", text, ""]
    text = mixed_table(runs)
    if text:
        sections += [f"## Mixed workload (harness), `{args.mixed}`", "", text, ""]
    lines = targets(runs, args.concurrency)
    if lines:
        sections += ["## Targets", "", *[f"- {line}" for line in lines], ""]
    sections += [f"![{name}]({name})" for name in results.get("plots", [])]
    markdown = "\n".join(sections) + "\n"
    (args.out / "results.md").write_text(markdown)
    return markdown


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = await measure(args)
    if args.merge is not None:
        earlier = json.loads(args.merge.read_text())
        tools_run = ("harness", "genai-bench") if args.tool == "both" else (args.tool,)
        measured = {(tool, setup) for tool in tools_run for setup in args.setups}
        kept = [run for run in earlier["runs"] if (run["tool"], run["setup"]) not in measured]
        results["runs"] += kept
        results["merged"] = {"from": str(args.merge), "when": earlier["env"]["when"], "runs": len(kept)}
    report.finish(
        results,
        args,
        started=started,
        plot=lambda: plot(results["runs"], args.concurrency, args.out),
        write=lambda: write(results, args),
    )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = stack.run_async(main_async(args))
    return 0 if all(r["summary"]["all"]["errors"] == 0 for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
