"""Scenario 4: the router's memory.

A. RSS of the dpd-router process while it relays 1,000 concurrent streams (a paced simulated
   decoder keeps them open: one token per stream every `--step` seconds), sampled every 0.25 s:
   idle after start, peak under load, and after the streams end (once the router has had a round of
   giving freed memory back).
B. The prefix index after a million distinct prompts: a fresh process builds the router's own
   `PrefixIndex` (default capacity, 1,000,000 blocks) from a million distinct prompts and reports
   its RSS growth and the cost per recorded prompt.
C. What a hostile round leaves: fuzzed bodies, a burst of streams and streams dropped mid-way, in turn on one
   router, its RSS after each against its settled size (`benchmarks/memory_probes.py`); with `--trace`, the
   lines of code that hold what each left, from a second run under tracemalloc.

    python -m benchmarks.memory                    # about 5 minutes here
    python -m benchmarks.memory --parts probes --trace
    python -m benchmarks.memory --parts probes --probes fuzz --rounds 4 --allocator malloc
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import loadgen, memory_probes, report, stack
from benchmarks.workload import PromptFactory
from dpd_router.startup.allocator import TRIM_INTERVAL
from dpd_sim.gpu import TimingModel
from dpd_sim.tokenizer_kit import ensure_tokenizer

NAME = "memory"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=60, help="tokens per stream")
    parser.add_argument("--step", type=float, default=0.5, help="the decoder's step: one token per stream per step")
    parser.add_argument("--prompts", type=int, default=1_000_000, help="distinct prompts for the prefix index")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=180.0)
    parser.add_argument(
        "--settle", type=float, default=TRIM_INTERVAL + 2.0,
        help="seconds after the streams before the size after them is read: a round of giving memory back",
    )  # fmt: skip
    parser.add_argument("--disconnects", type=int, default=200, help="streams the client drops mid-way (part C)")
    parser.add_argument(
        "--parts", nargs="+", choices=["streams", "index", "probes"], default=["streams", "index", "probes"]
    )
    parser.add_argument("--probes", nargs="+", choices=memory_probes.PROBES, default=list(memory_probes.PROBES))
    parser.add_argument("--rounds", type=int, default=10, help="identical rounds of the probes (part C)")
    parser.add_argument(
        "--allocator", choices=["pymalloc", "malloc"], default="pymalloc",
        help="Python's allocator in the router (part C): its arenas (default), or glibc's (PYTHONMALLOC=malloc)",
    )  # fmt: skip
    parser.add_argument("--trace", action="store_true", help="part C again under tracemalloc: what holds the memory")
    parser.add_argument("--trace-rounds", type=int, default=3, help="rounds under tracemalloc (slow: a few)")
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--render", action="store_true", help="write results.md again from --out's results.json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--index-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.streams, args.tokens, args.step, args.prompts, args.max_seconds = 50, 6, 0.05, 20_000, 30.0
        args.settle, args.disconnects, args.rounds, args.trace_rounds = 2.0, 20, 2, 2
    return args


async def streams(args: argparse.Namespace) -> dict[str, Any]:
    timing = TimingModel(0.0, 0.0, args.step, 0.0, 0.0)
    extra = ["--max-batch-size", str(args.streams + 64)]
    factory = PromptFactory(ensure_tokenizer())
    async with stack.engines(decode=1, timing=timing, extra_args=extra) as cluster:
        router = stack.dpd_router(decode=cluster.decode_urls, threshold=10**9)
        async with stack.running(router):
            warm = [loadgen.Request(i, "warm", factory.prompt(10_000_000 + i, 64), 2, 64) for i in range(20)]
            await loadgen.run([router.url], warm, concurrency=4, duration=30, progress=False)
            await asyncio.sleep(1.0)
            idle = stack.rss_bytes(router.pid)
            samples: list[tuple[float, int, int]] = []
            stop = asyncio.Event()

            async def sample() -> None:
                t0 = time.perf_counter()
                while not stop.is_set():
                    rss = stack.rss_bytes(router.pid) or 0
                    samples.append((time.perf_counter() - t0, rss, open_streams[0]))
                    await asyncio.sleep(0.25)

            open_streams = [0]
            requests = [
                loadgen.Request(i, "stream", factory.prompt(i, 64), args.tokens, 64) for i in range(args.streams)
            ]
            sampler = asyncio.create_task(sample())

            def ended(_record: loadgen.Record) -> None:
                open_streams[0] -= 1

            open_streams[0] = args.streams
            cpu0 = stack.cpu_seconds(router.pid) or 0.0
            result = await loadgen.run(
                [router.url], requests, concurrency=args.streams, duration=args.max_seconds, drain=30,
                label=f"{args.streams} streams", progress=not args.quiet, on_record=ended,
            )  # fmt: skip
            cpu = (stack.cpu_seconds(router.pid) or 0.0) - cpu0
            await asyncio.sleep(args.settle)
            stop.set()
            await sampler
            after = stack.rss_bytes(router.pid)
    summary = report.summarize(result.records, result.wall)
    return {
        "idle_rss": idle,
        "peak_rss": max(s[1] for s in samples),
        "after_rss": after,
        "samples": samples,
        "router_cpu_s": cpu,
        "summary": summary,
    }


def index_child(args: argparse.Namespace) -> dict[str, Any]:
    """Runs in its own process: RSS before and after recording `prompts` distinct prompts."""
    import random

    from dpd_router.config import Settings
    from dpd_router.prompt.tokenizer import Prompt
    from dpd_router.routing.prefix_index import PrefixIndex
    from dpd_router.routing.request import RoutingRequest

    class Where:
        def __init__(self, url: str) -> None:
            self.url = url

    defaults = Settings.model_fields
    capacity = defaults["prefix_index_capacity"].default
    block = defaults["block_size"].default
    index = PrefixIndex(block_size=block, capacity=capacity)
    decoders = [Where(f"http://10.0.0.{i}:8000") for i in range(4)]
    rng = random.Random(0)
    before = stack.rss_bytes(_pid()) or 0
    started = time.perf_counter()
    for i in range(args.prompts):
        tokens = [i & 0xFFFF, i >> 16] + [rng.randrange(4000) for _ in range(args.prompt_tokens - 2)]
        request = RoutingRequest(Prompt(tokens, len(tokens), 0.0))
        index.record(request, [decoders[i % 4]])
    seconds = time.perf_counter() - started
    after = stack.rss_bytes(_pid()) or 0
    return {
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "block_size": block,
        "capacity_blocks": capacity,
        "blocks_held": len(index),
        "rss_before": before,
        "rss_after": after,
        "bytes_per_block": (after - before) / max(len(index), 1),
        "us_per_prompt": seconds / args.prompts * 1e6,
    }


def _pid() -> int:
    import os

    return os.getpid()


def prefix_index(args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, "-m", "benchmarks.memory", "--index-only", "--prompts", str(args.prompts)]
    argv += ["--prompt-tokens", str(args.prompt_tokens)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1200, cwd=stack.ROOT)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def write(results: dict[str, Any], args: argparse.Namespace) -> str:
    md = [f"# Scenario 4: memory ({results['env']['when']}, {results['env']['commit']})", ""]
    s = results.get("streams")
    if s:
        summ = s["summary"]
        md += [
            f"## A. dpd-router RSS with {args.streams} concurrent streams",
            "",
            report.table(
                [
                    "idle MiB",
                    "peak MiB",
                    "after MiB",
                    "peak - idle per stream KiB",
                    "streams ok",
                    "errors",
                    "router CPU s",
                    "chunks/s",
                ],
                [
                    [
                        mib(s["idle_rss"]),
                        mib(s["peak_rss"]),
                        mib(s["after_rss"]),
                        f"{(s['peak_rss'] - s['idle_rss']) / 1024 / max(args.streams, 1):.1f}",
                        summ["ok"],
                        summ["errors"],
                        f"{s['router_cpu_s']:.1f}",
                        report.num(summ["chunks_per_s"], 0),
                    ]
                ],
            ),
            "",
        ]
    p = results.get("prefix_index")
    if p and "error" not in p:
        md += [
            f"## B. The prefix index after {p['prompts']:,} distinct prompts of {p['prompt_tokens']} tokens",
            "",
            report.table(
                ["blocks held", "capacity", "RSS before MiB", "RSS after MiB", "bytes per block", "µs per prompt"],
                [
                    [
                        f"{p['blocks_held']:,}",
                        f"{p['capacity_blocks']:,}",
                        mib(p["rss_before"]),
                        mib(p["rss_after"]),
                        f"{p['bytes_per_block']:.0f}",
                        f"{p['us_per_prompt']:.1f}",
                    ]
                ],
            ),
            "",
        ]
    elif p:
        md += ["## B. The prefix index", "", "```", p["error"], "```", ""]
    md += probes_section(results, args)
    md += [f"![{name}]({name})" for name in results.get("plots", [])]
    text = "\n".join(md) + "\n"
    (args.out / "results.md").write_text(text)
    return text


def probes_section(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    c = results.get("probes")
    if not c:
        return []
    settled = c["settled_rss"]
    rows = []
    for row in c["probes"]:
        what = ", ".join(f"{key}: {value}" for key, value in row["what"].items() if key != "server_errors")
        rows.append([
            str(row.get("round", 1)), row["probe"], what, f"{row['seconds']:.1f}", f"{row['router_cpu_s']:.1f}",
            mib(row["peak_rss"]), mib(row["after_rss"]), f"{row['after_rss'] / settled:.2f}x",
            "yes" if row["after_rss"] <= settle_bound(c) * settled else "**no**",
        ])  # fmt: skip
    rounds = max((row.get("round", 1) for row in c["probes"]), default=1)
    md = [
        f"## C. {rounds} hostile rounds: fuzzed bodies, a burst, dropped streams",
        "",
        f"Settled before the probes (after 20 warm-up requests and {args.settle:.0f} s): {mib(settled)} MiB. "
        f"Each probe's size after is read {args.settle:.0f} s after it ended.",
        "",
        *growth_lines(c),
        "",
        report.table(
            [
                "round",
                "probe",
                "what",
                "seconds",
                "router CPU s",
                "peak MiB",
                "after MiB",
                "after / settled",
                f"within {round((settle_bound(c) - 1) * 100)}%",
            ],
            rows,
        ),
        "",
    ]
    md += where_table(c)
    errors = [e for row in c["probes"] for e in row["what"].get("server_errors", [])]
    if errors:
        md += ["5xx or unanswered fuzz bodies:", "", *[f"- {e}" for e in errors], ""]
    t = results.get("probes_traced")
    if t:
        md += [
            "What is still allocated after each probe beyond the settled router (a second run, under tracemalloc; "
            "the largest lines of code by what they allocated that lives on):",
            "",
        ]
        for row in t["probes"]:
            md += [
                f"After {row['probe']} (round {row.get('round', 1)}): {row['python_alive_mib']:+.2f} MiB of Python "
                "objects in all.",
                "",
            ]
            md += [
                report.table(
                    ["allocated at", "KiB", "blocks"],
                    [[f"`{top['where']}`", f"{top['kib']:,.1f}", f"{top['blocks']:+,}"] for top in row["top"]],
                ),
                "",
            ]
    return md


# Growth of the size after a round, per round over the later half of the rounds, beyond which they show a leak.
LEAK_MIB_PER_ROUND = 1.0


def round_growth(c: dict[str, Any]) -> tuple[list[float], float | None, int]:
    """The size after each round's last probe (MiB), and its least-squares growth per round over the later
    half of the rounds, and how many rounds that is: a high-water mark (caches filling, the allocators' free
    lists and fragments) climbs at first and levels off; a leak goes on climbing. None: too few rounds."""
    last: dict[int, int] = {}
    for row in c["probes"]:
        last[row.get("round", 1)] = row["after_rss"]
    sizes = [last[r] / memory_probes.MIB for r in sorted(last)]
    later = sizes[len(sizes) // 2 :]
    if len(later) < 3:
        return sizes, None, len(later)
    xs = range(len(later))
    mean_x, mean_y = sum(xs) / len(later), sum(later) / len(later)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, later, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return sizes, slope, len(later)


def growth_lines(c: dict[str, Any]) -> list[str]:
    sizes, slope, rounds = round_growth(c)
    line = "Size after each round (MiB): " + ", ".join(f"{size:.1f}" for size in sizes) + "."
    if slope is None:
        return [line]
    verdict = (
        f"**Over the last {rounds} rounds it still grows {slope:.2f} MiB a round: not level yet** (a leak, or a "
        "high-water mark still being reached: the table of where the memory is tells which)."
        if slope > LEAK_MIB_PER_ROUND
        else f"Over the last {rounds} rounds it moves {slope:+.2f} MiB a round (a leak would go on above "
        f"{LEAK_MIB_PER_ROUND:g}): a high-water mark, reached in the first rounds, not a leak."
    )
    return [line, "", verdict]


def where_table(c: dict[str, Any]) -> list[str]:
    """Where the router's resident memory was, settled and after each probe (MiB)."""
    stages = [("settled", c.get("settled_where"))] + [
        (f"after {row['probe']} (round {row.get('round', 1)})", row.get("where")) for row in c["probes"]
    ]
    rows = []
    for stage, where in stages:
        if not where:
            continue
        resident, heaps, py = where.get("resident", {}), where.get("glibc", {}), where.get("pymalloc", {})
        arena = 1024 * 1024  # CPython's arena size
        cells = [
            resident.get("Rss"), resident.get("Anonymous"),
            (resident.get("Private_Clean") or 0) + (resident.get("Shared_Clean") or 0),
            heaps.get("heaps"), heaps.get("heaps_in_use"), heaps.get("heaps_free"), heaps.get("mmapped"),
            None if "arenas_now" not in py else py["arenas_now"] * arena, py.get("bytes_in_blocks"),
        ]  # fmt: skip
        rows.append([stage, *("-" if cell is None else mib(cell) for cell in cells)])
    if not rows:
        return []
    return [
        "Where the memory was (the router's /proc smaps_rollup, glibc's mallinfo2, CPython's allocator; MiB):",
        "",
        report.table(
            [
                "when",
                "resident",
                "anonymous",
                "file-backed",
                "glibc heaps",
                "in use",
                "free",
                "glibc mmapped",
                "Python arenas",
                "Python objects",
            ],
            rows,
        ),
        "",
    ]


def settle_bound(c: dict[str, Any]) -> float:
    return float(c.get("bound", memory_probes.BOUND))


def plot(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    plt = report.plotting()
    s = results.get("streams")
    if plt is None or not s:
        return []
    fig, ax = plt.subplots(figsize=(8, 4))
    ts = [x[0] for x in s["samples"]]
    ax.plot(ts, [x[1] / 2**20 for x in s["samples"]], label="router RSS (MiB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    twin = ax.twinx()
    twin.plot(ts, [x[2] for x in s["samples"]], color="grey", linestyle="--", label="open streams")
    twin.set_ylabel("open streams")
    ax.set_title(f"dpd-router RSS while relaying {args.streams} concurrent streams")
    ax.grid(alpha=0.3)
    fig.legend(loc="lower right")
    fig.tight_layout()
    path = args.out / "rss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:  # the report again from a run's results.json (a change to how it is written)
        results = json.loads((args.out / "results.json").read_text())
        print(write(results, argparse.Namespace(**{**vars(args), **results["args"], "out": args.out})))
        return 0
    if args.index_only:
        print(json.dumps(index_child(args)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {}
    if "streams" in args.parts:
        results["streams"] = stack.run_async(streams(args))
    if "index" in args.parts:
        results["prefix_index"] = prefix_index(args)
    if "probes" in args.parts:
        results["probes"] = stack.run_async(memory_probes.measured(args))
        if args.trace:
            results["probes_traced"] = stack.run_async(memory_probes.traced(args))
    report.finish(results, args, started=started, plot=lambda: plot(results, args), write=lambda: write(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
