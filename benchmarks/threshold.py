"""Scenario 3: what the routing threshold does.

A. The crossover: a probe request's TTFT on each path (direct to the decoder, or prefiller ->
   decoder) against its prompt length, while background streams decode on the decoder, and the
   inter-token gaps those background streams suffer while the probe is served. Direct is cheaper
   for the probe (no KV hop); disaggregating spares everyone else the prefill stall.
B. A sweep: one mixed workload (prompt lengths spread over the thresholds, half of the requests
   sharing one of a few long documents as their prefix) through dpd-router at each threshold, in
   `static` mode (the whole prompt counts) and `cache_aware` mode (only what the decoder lacks).
   The adaptive threshold does not exist yet.

    python -m benchmarks.threshold          # about 12 minutes here
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import loadgen, report, stack
from benchmarks.workload import PromptFactory, Workload
from dpd_sim.tokenizer_kit import ensure_tokenizer

NAME = "threshold"
NEVER = 10**9


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.threshold", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--probes", type=int, default=5, help="probe requests per length and path")
    parser.add_argument("--background", type=int, default=8, help="background decode streams")
    parser.add_argument("--thresholds", type=int, nargs="+", default=[1024, 2048, 4096, 8192, NEVER])
    parser.add_argument("--modes", nargs="+", default=["static", "cache_aware"])
    parser.add_argument("--workload", default="U(256,12288)/(128,128)")
    parser.add_argument("--shared-docs", type=int, default=4, help="documents shared as prefixes")
    parser.add_argument("--doc-tokens", type=int, default=3072)
    parser.add_argument("--shared-fraction", type=float, default=0.5)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--timing", default="realistic")
    parser.add_argument("--max-seconds", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.lengths, args.probes, args.background = [64, 512], 1, 2
        args.thresholds, args.workload, args.requests, args.concurrency = [256, NEVER], "U(32,600)/(8,8)", 8, 3
        args.doc_tokens, args.timing, args.max_seconds = 128, "default", 30.0
    return args


def label_of(threshold: int) -> str:
    return "never" if threshold >= NEVER else str(threshold)


async def crossover(args: argparse.Namespace, cluster: Any, factory: PromptFactory) -> list[dict[str, Any]]:
    (p,), (d,) = cluster.prefill_urls, cluster.decode_urls
    routers = {
        "direct": stack.dpd_router(decode=[d], prefill=[p], threshold=NEVER, name="always-direct"),
        "disaggregated": stack.dpd_router(decode=[d], prefill=[p], threshold=1, name="always-disaggregated"),
    }
    rows: list[dict[str, Any]] = []
    async with stack.running(*routers.values()):
        stop = asyncio.Event()
        background = [
            loadgen.Request(i, "background", factory.prompt(900_000 + i, 64), 30_000, 64)
            for i in range(args.background * 4)
        ]
        bg_task = asyncio.create_task(
            loadgen.run([d], background, concurrency=args.background, duration=3600, progress=False, stop=stop)
        )
        await asyncio.sleep(1.0)
        try:
            for li, length in enumerate(args.lengths):
                for pi, path in enumerate(("direct", "disaggregated")[:: 1 if li % 2 == 0 else -1]):
                    del pi
                    probes = [
                        loadgen.Request(
                            i,
                            "probe",
                            factory.prompt(li * 1000 + i + (500 if path == "direct" else 0), length),
                            16,
                            length,
                        )
                        for i in range(args.probes)
                    ]
                    window_start = time.perf_counter()
                    result = await loadgen.run(
                        [routers[path].url], probes, concurrency=1, duration=args.max_seconds, progress=False
                    )
                    rows.append(
                        {"length": length, "path": path, "window": (window_start, time.perf_counter())}
                        | {"probe": report.summarize(result.records, result.wall)}
                    )
                    if not args.quiet:
                        ttft = rows[-1]["probe"]["ttft"]["p50"]
                        print(f"crossover L={length:6} {path:14} TTFT p50 {report.ms(ttft)} ms", file=sys.stderr)
        finally:
            stop.set()
            bg = await bg_task
    for row in rows:
        lo, hi = row.pop("window")
        gaps = []
        for record in bg.records:
            times = loadgen.token_times(record, bg.started)
            gaps += [b - a for a, b in itertools.pairwise(times) if lo <= b <= hi]
        row["background_itl"] = report.spread(gaps)
        row["background_gaps"] = len(gaps)
    return rows


def sweep_requests(args: argparse.Namespace, factory: PromptFactory, seed: int) -> list[loadgen.Request]:
    """The sweep's workload: lengths from `--workload`; a share of requests open with a shared document."""
    rng = random.Random(seed)
    requests = []
    for index, (_, tokens, out) in enumerate(Workload.parse(args.workload).draw(args.requests, seed)):
        shared = rng.random() < args.shared_fraction and tokens > args.doc_tokens + 64
        doc = rng.randrange(args.shared_docs) + 100 * seed if shared else None
        content = factory.prompt(seed * 10_000 + index, tokens, doc=doc, doc_tokens=args.doc_tokens)
        requests.append(loadgen.Request(index, "shared" if shared else "unique", content, out, tokens))
    return requests


async def sweep(args: argparse.Namespace, cluster: Any, factory: PromptFactory) -> list[dict[str, Any]]:
    (p,), (d,) = cluster.prefill_urls, cluster.decode_urls
    runs = []
    configs = [(t, m) for t in args.thresholds for m in args.modes if not (t >= NEVER and m != args.modes[0])]
    for ci, (threshold, mode) in enumerate(configs):
        router = stack.dpd_router(
            decode=[d], prefill=[p], threshold=threshold, settings={"threshold_mode": mode}, name="sweep"
        )
        requests = sweep_requests(args, factory, seed=ci + 1)
        async with stack.running(router):
            label = f"threshold {label_of(threshold):>6} {mode:11}"
            result = await loadgen.run(
                [router.url], requests, concurrency=args.concurrency, duration=args.max_seconds, label=label,
                progress=not args.quiet,
            )  # fmt: skip
            decisions = await stack.route_decisions(router.url)
        runs.append(
            {"threshold": threshold, "mode": mode, "decisions": {k: int(v) for k, v in decisions.items() if v}}
            | {"summary": report.summarize_run(result)}
        )
    return runs


def write(results: dict[str, Any], args: argparse.Namespace) -> str:
    md = [f"# Scenario 3: the threshold ({results['env']['when']}, {results['env']['commit']})", ""]
    md.append(f"1 prefill + 1 decode simulated engine, `--timing {args.timing}`.\n")
    cross = results["crossover"]
    if cross:
        md += [
            f"## A. Probe TTFT per path vs prompt length, with {args.background} background streams decoding",
            "",
            "Each probe runs alone (concurrency 1); the background streams' gaps are those that ended while "
            "that length's probes ran.",
            "",
        ]
        rows = []
        for length in args.lengths:
            by = {r["path"]: r for r in cross if r["length"] == length}
            d, g = by.get("direct"), by.get("disaggregated")
            if not d or not g:
                continue
            rows.append(
                [
                    length,
                    report.ms(d["probe"]["ttft"]["p50"]),
                    report.ms(g["probe"]["ttft"]["p50"]),
                    report.ms((g["probe"]["ttft"]["p50"] or 0) - (d["probe"]["ttft"]["p50"] or 0)),
                    report.ms(d["background_itl"]["p99"]),
                    report.ms(g["background_itl"]["p99"]),
                    report.ms(d["background_itl"]["mean"], 2),
                    report.ms(g["background_itl"]["mean"], 2),
                ]
            )
        md += [
            report.table(
                [
                    "prompt tokens",
                    "TTFT direct ms",
                    "TTFT disagg ms",
                    "disagg costs ms",
                    "bg ITL p99 direct ms",
                    "bg ITL p99 disagg ms",
                    "bg ITL mean direct",
                    "bg ITL mean disagg",
                ],
                rows,
            ),
            "",
        ]
    runs = results["sweep"]
    if runs:
        md += [
            f"## B. Whole-run TTFT and ITL per threshold (`{args.workload}`, {args.requests} requests at "
            f"concurrency {args.concurrency}; {args.shared_fraction:.0%} share one of {args.shared_docs} "
            f"{args.doc_tokens}-token documents)",
            "",
        ]
        rows = []
        for run in runs:
            s = run["summary"]["all"]
            disagg = sum(v for k, v in run["decisions"].items() if k.startswith("disaggregated/"))
            rows.append(
                [
                    label_of(run["threshold"]),
                    run["mode"],
                    report.ms(s["ttft"]["p50"]),
                    report.ms(s["ttft"]["p99"]),
                    report.ms(s["itl"]["p50"]),
                    report.ms(s["itl"]["p99"]),
                    report.ms(s["tpot"]["p50"]),
                    f"{s['e2e']['p50']:.2f}",
                    report.num(s["out_tok_per_s"], 0),
                    disagg,
                    s["errors"],
                ]
            )
        md += [
            report.table(
                [
                    "threshold",
                    "mode",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "ITL p50 ms",
                    "ITL p99 ms",
                    "TPOT p50 ms",
                    "E2E p50 s",
                    "out tok/s",
                    "disaggregated",
                    "errors",
                ],
                rows,
            ),
            "",
            "Route decisions per run (path/reason: count):",
            "",
            *[f"- {label_of(r['threshold'])} {r['mode']}: {r['decisions']}" for r in runs],
            "",
        ]
    md += [f"![{name}]({name})" for name in results.get("plots", [])]
    text = "\n".join(md) + "\n"
    (args.out / "results.md").write_text(text)
    return text


def plot(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    plt = report.plotting()
    if plt is None:
        return []
    written = []
    cross = results["crossover"]
    if cross:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for path in ("direct", "disaggregated"):
            rows = sorted((r for r in cross if r["path"] == path), key=lambda r: r["length"])
            xs = [r["length"] for r in rows]
            axes[0].plot(xs, [(r["probe"]["ttft"]["p50"] or 0) * 1000 for r in rows], marker="o", label=path)
            axes[1].plot(xs, [(r["background_itl"]["p99"] or 0) * 1000 for r in rows], marker="o", label=path)
        for ax, title in zip(axes, ("probe TTFT p50 (ms)", "background streams' ITL p99 (ms)"), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("probe prompt tokens")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = args.out / "crossover.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    runs = results["sweep"]
    if runs:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        for mode in args.modes:
            rows = [r for r in runs if r["mode"] == mode or r["threshold"] >= NEVER]
            xs = [label_of(r["threshold"]) for r in rows]
            axes[0].plot(xs, [r["summary"]["all"]["ttft"]["p50"] * 1000 for r in rows], marker="o", label=mode)
            axes[1].plot(xs, [r["summary"]["all"]["itl"]["p99"] * 1000 for r in rows], marker="o", label=mode)
        for ax, title in zip(axes, ("TTFT p50 (ms)", "ITL p99 (ms)"), strict=True):
            ax.set_xlabel("routing threshold (tokens)")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = args.out / "sweep.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    factory = PromptFactory(ensure_tokenizer())
    extra = ["--max-model-len", "40000"]
    results: dict[str, Any] = {}
    async with stack.engines(prefill=1, decode=1, timing=args.timing, extra_args=extra) as cluster:
        results["crossover"] = await crossover(args, cluster, factory)
    async with stack.engines(prefill=1, decode=1, timing=args.timing, extra_args=extra) as cluster:
        results["sweep"] = await sweep(args, cluster, factory)
    report.finish(results, args, started=started, plot=lambda: plot(results, args), write=lambda: write(results, args))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stack.run_async(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
