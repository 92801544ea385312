"""Scenario 2: what the router itself costs, against going direct and against vllm-router.

One near-zero-latency simulated engine pair (no prefill time, a 1 ms decode step: what is left is
HTTP, JSON and tokenization; with a 0 ms step the engine spins on the 2 cores and collapses under
concurrency) is reached:
- `direct`: the decode engine itself;
- `dpd-router`: dpd-router on its direct path (threshold above every prompt);
- `vllm-router`: vllm-router 0.1.17 in plain mode (round robin over the one engine);
- `dpd-router-pd`: dpd-router with threshold 1 (every request prefiller -> decoder);
- `vllm-router-pd`: vllm-router in PD mode (every request prefiller -> decoder);
- `production-stack`, `production-stack-pd`: production-stack's Python router (round robin, and its
  `disaggregated_prefill` logic), when `--production-stack-src` names a checkout of its repository.
Added latency is a setup's percentile minus direct's, from runs adjacent in time; setups are
interleaved and repeated, and the tables give medians over repeats. Also: short requests while
32k-token prompts arrive (does tokenization stall the loop?) and streamed chunks/s at 256 streams.

    python -m benchmarks.router_overhead          # about 12 minutes here
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import loadgen, report, stack, tools
from benchmarks.workload import PromptFactory
from dpd_sim.gpu import TimingModel
from dpd_sim.tokenizer_kit import ensure_tokenizer

NAME = "router_overhead"
PLAIN = ("direct", "dpd-router", "vllm-router", "production-stack")
PD = ("dpd-router-pd", "vllm-router-pd", "production-stack-pd")
PEERS = ("vllm-router", "production-stack")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--short", default="D(64,8)", help="short requests (in genai-bench notation)")
    parser.add_argument("--long-tokens", type=int, default=32768)
    parser.add_argument("--long-out", type=int, default=8)
    parser.add_argument("--short-requests", type=int, nargs="+", default=[200, 640, 1024], help="per concurrency")
    parser.add_argument("--long-requests", type=int, nargs="+", default=[10, 64, 128], help="per concurrency")
    parser.add_argument("--stream-tokens", type=int, default=256, help="tokens per stream in the chunks/s test")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--engine-step", type=float, default=0.001, help="decode step of the fast engines (s)")
    parser.add_argument("--paced-step", type=float, default=0.05, help="decode step of the paced engine (s)")
    parser.add_argument("--tokenize-rate", type=float, default=1.0, help="32k prompts/s during the stall test")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-vllm-router", action="store_true", help="skip vllm-router (no install)")
    parser.add_argument(
        "--production-stack-src",
        type=Path,
        default=os.environ.get("PRODUCTION_STACK_SRC") or None,
        help="a checkout of vllm-project/production-stack: also measure its router (needs python3.12)",
    )
    parser.add_argument("--profile", type=float, default=20.0, help="py-spy the router this long at c=64 (0: off)")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.short_requests, args.long_requests = [1, 8], [20, 40], [2, 4]
        args.long_tokens, args.stream_tokens, args.streams, args.tokenize_rate = 2000, 16, 16, 5.0
        args.repeats, args.no_vllm_router, args.profile, args.max_seconds = 1, True, 0.0, 30.0
        args.production_stack_src = None
        args.paced_step = 0.005
    return args


class Prompts:
    """Short prompts made one by one; long ones share one body behind a unique head, so they differ from
    their first block (no prefix-cache hits anywhere) without making 32k tokens of text per request."""

    def __init__(self, factory: PromptFactory, long_tokens: int) -> None:
        self.factory = factory
        self.long_body = factory.text(long_tokens - 8, "long-body")

    def short(self, count: int, tokens: int, out: int, seed: int) -> list[loadgen.Request]:
        return [
            loadgen.Request(i, "short", self.factory.prompt(seed * 100_000 + i, tokens), out, tokens)
            for i in range(count)
        ]

    def long(self, count: int, out: int, seed: int, *, start: int = 0) -> list[loadgen.Request]:
        tokens = self.factory.count(self.long_body) + 8
        return [
            loadgen.Request(start + i, "long", f"Request {seed}-{i} of many: {self.long_body}", out, tokens)
            for i in range(count)
        ]


async def bring_up(args: argparse.Namespace, exits: list[Any]) -> dict[str, str]:
    extra = ["--max-model-len", str(args.long_tokens + 4096), "--max-batch-size", "1024"]
    fast_timing = TimingModel(0.0, 0.0, args.engine_step, 0.0, 0.0)
    fast = stack.engines(prefill=1, decode=1, timing=fast_timing, extra_args=extra)
    cluster = await fast.__aenter__()
    exits.append(fast)
    paced_timing = TimingModel(0.0, 0.0, args.paced_step, 0.0, 0.0)
    paced_cm = stack.engines(decode=1, timing=paced_timing, extra_args=extra)
    paced = await paced_cm.__aenter__()
    exits.append(paced_cm)
    (p,), (d,) = cluster.prefill_urls, cluster.decode_urls
    huge = 10**9
    services = {
        "dpd-router": stack.dpd_router(decode=[d], prefill=[p], threshold=huge),
        "dpd-router-pd": stack.dpd_router(decode=[d], prefill=[p], threshold=1, name="dpd-router-pd"),
        "dpd-router-paced": stack.dpd_router(decode=paced.decode_urls, threshold=huge, name="dpd-router-paced"),
    }
    if not args.no_vllm_router:
        tools.ensure_venv("vllm-router")
        services["vllm-router"] = stack.vllm_router(workers=[d])
        services["vllm-router-pd"] = stack.vllm_router(prefill=[p], decode=[d], name="vllm-router-pd")
        services["vllm-router-paced"] = stack.vllm_router(workers=paced.decode_urls, name="vllm-router-paced")
    if args.production_stack_src is not None:
        tools.ensure_production_stack(Path(args.production_stack_src))
        services["production-stack"] = stack.production_stack_router(workers=[d])
        services["production-stack-pd"] = stack.production_stack_router(
            prefill=[p], decode=[d], name="production-stack-pd"
        )
        services["production-stack-paced"] = stack.production_stack_router(
            workers=paced.decode_urls, name="production-stack-paced"
        )
    await asyncio.gather(*(service.start() for service in services.values()))
    exits.extend(services.values())
    urls = {name: service.url for name, service in services.items()}
    urls["direct"] = d
    urls["direct-paced"] = paced.decode_urls[0]
    urls["_pids"] = {name: service.pid for name, service in services.items()}  # type: ignore[assignment]
    return urls


def cpu_seconds(pid: int | None) -> float | None:
    """The CPU time (user and system, every thread) a process has used so far; None without one."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_run(
    url: str,
    requests: list[loadgen.Request],
    concurrency: int,
    args: argparse.Namespace,
    label: str,
    pid: int | None = None,
) -> dict[str, Any]:
    """One load run; with the router's `pid`, also its CPU milliseconds per request served."""
    before = cpu_seconds(pid)
    result = await loadgen.run(
        [url], requests, concurrency=concurrency, duration=args.max_seconds, label=label, progress=not args.quiet
    )
    after = cpu_seconds(pid)
    summary = report.summarize(result.records, result.wall)
    served = summary["ok"]
    summary["cpu_ms_per_request"] = (
        (after - before) * 1000 / served if before is not None and after is not None and served else None
    )
    return summary


async def latency_runs(args: argparse.Namespace, urls: dict[str, Any], prompts: Prompts) -> list[dict[str, Any]]:
    setups = [s for s in (*PLAIN, *PD) if s in urls]
    short_in, short_out = (int(x) for x in args.short.strip("D()").split(","))
    runs = []
    for repeat in range(args.repeats):
        for ci, concurrency in enumerate(args.concurrency):
            for size in ("short", "long"):
                if size == "short":
                    requests = prompts.short(args.short_requests[ci], short_in, short_out, seed=repeat)
                else:
                    requests = prompts.long(args.long_requests[ci], args.long_out, seed=repeat)
                order = setups[repeat % len(setups) :] + setups[: repeat % len(setups)]
                for setup in order:
                    label = f"r{repeat} {setup:15} c={concurrency:<3} {size}"
                    pid = urls["_pids"].get(setup)
                    summary = await one_run(urls[setup], requests, concurrency, args, label, pid)
                    runs.append(
                        {"kind": "latency", "setup": setup, "size": size, "concurrency": concurrency}
                        | {"repeat": repeat, "summary": summary}
                    )
    return runs


async def tokenize_stall_runs(args: argparse.Namespace, urls: dict[str, Any], prompts: Prompts) -> list[dict[str, Any]]:
    """Short requests at concurrency 64 (or the largest below it) while 32k prompts arrive at a fixed rate."""
    concurrency = max(c for c in args.concurrency if c <= 64)
    short_in, short_out = (int(x) for x in args.short.strip("D()").split(","))
    count = args.short_requests[args.concurrency.index(concurrency)]
    runs = []
    for repeat in range(args.repeats):
        for setup in [s for s in PLAIN if s in urls]:
            shorts = prompts.short(count, short_in, short_out, seed=50 + repeat)
            longs = prompts.long(int(args.max_seconds * args.tokenize_rate), args.long_out, seed=60 + repeat)
            label = f"r{repeat} {setup:15} short c={concurrency} + 32k at {args.tokenize_rate}/s"
            short_result = await shorts_beside_longs(urls[setup], shorts, longs, concurrency, args, label)
            runs.append(
                {"kind": "tokenize_stall", "setup": setup, "concurrency": concurrency, "repeat": repeat}
                | {"summary": report.summarize(short_result.records, short_result.wall)}
            )
    return runs


async def shorts_beside_longs(
    url: str,
    shorts: list[loadgen.Request],
    longs: list[loadgen.Request],
    concurrency: int,
    args: argparse.Namespace,
    label: str,
) -> loadgen.RunResult:
    """Short requests at a fixed concurrency while long ones arrive at a fixed rate, until the shorts end."""
    stop = asyncio.Event()
    background = asyncio.create_task(
        loadgen.run([url], longs, rate=args.tokenize_rate, duration=args.max_seconds, progress=False, stop=stop)
    )
    try:
        return await loadgen.run(
            [url], shorts, concurrency=concurrency, duration=args.max_seconds, label=label, progress=not args.quiet
        )
    finally:
        stop.set()
        await asyncio.gather(background, return_exceptions=True)


async def streaming_runs(args: argparse.Namespace, urls: dict[str, Any], prompts: Prompts) -> list[dict[str, Any]]:
    """Chunks/s relayed at `streams` concurrent streams: engine as fast as it goes, and paced."""
    runs = []
    for repeat in range(args.repeats):
        for pace, suffix in (("max", ""), ("paced", "-paced")):
            for setup in PLAIN:
                key = setup + suffix
                if key not in urls:
                    continue
                requests = prompts.short(args.streams, 32, args.stream_tokens, seed=90 + repeat)
                label = f"r{repeat} {setup:15} {args.streams} streams ({pace})"
                summary = await one_run(urls[key], requests, args.streams, args, label, urls["_pids"].get(key))
                runs.append({"kind": "streaming", "pace": pace, "setup": setup, "repeat": repeat, "summary": summary})
    return runs


async def profile_router(args: argparse.Namespace, urls: dict[str, Any], prompts: Prompts, out: Path) -> dict[str, Any]:
    """py-spy the dpd-router process while short requests run at concurrency 64; top frames by samples."""
    pyspy = tools.venv_binary("genai-bench", "py-spy")
    if args.profile <= 0:
        return {}
    if not pyspy.exists():
        tools.ensure_venv("genai-bench")
    pid = urls["_pids"]["dpd-router"]
    raw = Path(tempfile.mkdtemp(prefix="py-spy-")) / "profile_dpd_router_c64.txt"
    short_in, short_out = (int(x) for x in args.short.strip("D()").split(","))
    requests = prompts.short(100_000, short_in, short_out, seed=77)[: int(args.profile * 600)]
    spy = await asyncio.create_subprocess_exec(
        str(pyspy), "record", "--pid", str(pid), "--duration", str(int(args.profile)), "--rate", "200",
        "--format", "raw", "--output", str(raw), "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await asyncio.sleep(1.0)
    run = asyncio.create_task(one_run(urls["dpd-router"], requests, 64, args, "profiling dpd-router c=64"))
    _, err = await spy.communicate()
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    if not raw.exists():
        return {"error": err.decode(errors="replace")[-500:]}
    try:
        return summarize_profile(raw)
    finally:
        shutil.rmtree(raw.parent, ignore_errors=True)


def summarize_profile(raw: Path, top: int = 25) -> dict[str, Any]:
    """Inclusive and self sample counts per function from py-spy's collapsed stacks."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1] if " (" in f else f for f in stack_text.split(";")]
        frames = [_short_frame(f) for f in frames if f]
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        if frames:
            own[frames[-1]] += count
    return {
        "samples": total,
        "inclusive": [(frame, n) for frame, n in inclusive.most_common(top)],
        "self": [(frame, n) for frame, n in own.most_common(top)],
    }


def _short_frame(frame: str) -> str:
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    for marker in ("site-packages/", "src/", "lib/python3.11/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    where = where.rsplit(":", 1)[0]
    return f"{name} ({where})"


def medians(runs: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    chosen = [r["summary"] for r in runs if all(r.get(k) == v for k, v in match.items())]
    if not chosen:
        return None
    return {
        "repeats": len(chosen),
        "errors": sum(s["errors"] for s in chosen),
        "req_per_s": report.median_of(s["req_per_s"] for s in chosen),
        "chunks_per_s": report.median_of(s["chunks_per_s"] for s in chosen),
        "cpu_ms_per_request": report.median_of(s.get("cpu_ms_per_request") for s in chosen),
        **{m: {q: report.median_of(s[m][q] for s in chosen) for q in ("p50", "p99")} for m in ("e2e", "ttft", "itl")},
    }


def added(runs: list[dict[str, Any]], setup: str, q: str, metric: str = "e2e", **match: Any) -> float | None:
    """Median over repeats of (setup's percentile - direct's percentile) from the same repeat."""
    diffs = []
    for run in runs:
        if run["setup"] != setup or any(run.get(k) != v for k, v in match.items()):
            continue
        base = next(
            (
                r
                for r in runs
                if r["setup"] == "direct"
                and r["repeat"] == run["repeat"]
                and all(r.get(k) == v for k, v in match.items())
            ),
            None,
        )
        if base is not None and run["summary"][metric][q] is not None and base["summary"][metric][q] is not None:
            diffs.append(run["summary"][metric][q] - base["summary"][metric][q])
    return report.median_of(diffs)


def cpu_ms(m: dict[str, Any]) -> float | None:
    """A median CPU time per request in seconds (report.ms prints seconds as milliseconds)."""
    value = m.get("cpu_ms_per_request")
    return None if value is None else value / 1000


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.2f}x"


def write(results: dict[str, Any], args: argparse.Namespace) -> str:
    runs = results["runs"]
    lat = [r for r in runs if r["kind"] == "latency"]
    setups = [s for s in (*PLAIN, *PD) if any(r["setup"] == s for r in lat)]
    md = [f"# Scenario 2: router overhead ({results['env']['when']}, {results['env']['commit']})", ""]
    md.append(
        f"Near-zero-latency simulated engines (decode step {args.engine_step * 1000:g} ms); "
        f"short `{args.short}`, long `D({args.long_tokens},{args.long_out})`; "
        f"{args.repeats} interleaved repeats, medians. Added = setup minus direct, same repeat. "
        "PD rows pay a second engine hop (prefill) that direct does not; compare them with each other.\n"
    )
    rows = []
    for size in ("short", "long"):
        for concurrency in args.concurrency:
            for setup in setups:
                m = medians(lat, setup=setup, size=size, concurrency=concurrency)
                if m is None:
                    continue
                a50 = added(lat, setup, "p50", size=size, concurrency=concurrency)
                a99 = added(lat, setup, "p99", size=size, concurrency=concurrency)
                rows.append(
                    [size, concurrency, setup, report.ms(m["e2e"]["p50"], 2), report.ms(m["e2e"]["p99"], 2)]
                    + ([report.ms(a50, 2), report.ms(a99, 2)] if setup != "direct" else ["", ""])
                    + [report.num(m["req_per_s"], 0), report.ms(cpu_ms(m), 2), m["errors"]]
                )
    md += [
        "## Latency per request (E2E of a streamed request), added latency, and the router's CPU per request",
        "",
        report.table(
            [
                "prompt",
                "conc",
                "setup",
                "E2E p50 ms",
                "E2E p99 ms",
                "added p50 ms",
                "added p99 ms",
                "req/s",
                "router CPU ms/req",
                "errors",
            ],
            rows,
        ),
        "",
    ]
    ratio_rows = []
    for size in ("short", "long"):
        for concurrency in args.concurrency:
            pairs = [(f"dpd-router{mode}", f"{peer}{mode}") for peer in PEERS for mode in ("", "-pd")]
            for ours, theirs in pairs:
                for q in ("p50", "p99"):
                    a = added(lat, ours, q, size=size, concurrency=concurrency)
                    b = added(lat, theirs, q, size=size, concurrency=concurrency)
                    if a is not None and b is not None:
                        pair = f"{ours} / {theirs}"
                        ratio_rows.append([size, concurrency, pair, q, report.ms(a, 2), report.ms(b, 2), ratio(a, b)])
    if ratio_rows:
        md += [
            "## dpd-router's added latency relative to its peers' (same run)",
            "",
            report.table(["prompt", "conc", "pair", "pct", "ours ms", "theirs ms", "ratio"], ratio_rows),
            "",
        ]
    stall = [r for r in runs if r["kind"] == "tokenize_stall"]
    if stall:
        rows = []
        for setup in [s for s in PLAIN if any(r["setup"] == s for r in stall)]:
            m = medians(stall, setup=setup)
            rows.append(
                [setup, report.ms(m["e2e"]["p50"], 2), report.ms(m["e2e"]["p99"], 2)]
                + (
                    [report.ms(added(stall, setup, "p50"), 2), report.ms(added(stall, setup, "p99"), 2)]
                    if setup != "direct"
                    else ["", ""]
                )
                + [report.num(m["req_per_s"], 0), m["errors"]]
            )
        md += [
            f"## Short requests while {args.long_tokens}-token prompts arrive at {args.tokenize_rate}/s",
            "",
            report.table(
                ["setup", "E2E p50 ms", "E2E p99 ms", "added p50 ms", "added p99 ms", "req/s", "errors"], rows
            ),
            "",
        ]
    streaming = [r for r in runs if r["kind"] == "streaming"]
    if streaming:
        rows = []
        for pace in ("max", "paced"):
            base = medians(streaming, setup="direct", pace=pace)
            for setup in PLAIN:
                m = medians(streaming, setup=setup, pace=pace)
                if m is None:
                    continue
                share = ratio(m["chunks_per_s"], base["chunks_per_s"]) if base else "-"
                itl = m["itl"]
                chunks = report.num(m["chunks_per_s"], 0)
                rows.append(
                    [
                        pace,
                        setup,
                        chunks,
                        share,
                        report.ms(itl["p50"], 2),
                        report.ms(itl["p99"], 2),
                        report.ms(cpu_ms(m), 2),
                        m["errors"],
                    ]
                )
        md += [
            f"## Streamed chunks/s at {args.streams} concurrent streams of {args.stream_tokens} tokens",
            "",
            "`max`: the engine steps as fast as it can; `paced`: one decode step every "
            f"{args.paced_step * 1000:.0f} ms (so {args.streams / args.paced_step:,.0f} chunks/s offered).",
            "",
            report.table(
                [
                    "engine",
                    "setup",
                    "chunks/s",
                    "of direct",
                    "ITL p50 ms",
                    "ITL p99 ms",
                    "router CPU ms/stream",
                    "errors",
                ],
                rows,
            ),
            "",
        ]
    targets = []
    c64 = 64 if 64 in args.concurrency else max(args.concurrency)
    a50, a99 = (
        added(lat, "dpd-router", "p50", size="short", concurrency=c64),
        added(lat, "dpd-router", "p99", size="short", concurrency=c64),
    )
    if a50 is not None and a99 is not None:
        ok = a50 <= 0.001 and a99 <= 0.005
        targets.append(
            f"direct path added latency at c={c64}: p50 {a50 * 1000:.2f} ms (target ≤ 1), p99 {a99 * 1000:.2f} ms "
            f"(target ≤ 5): {'met' if ok else 'missed'}"
        )
    b50 = added(lat, "vllm-router", "p50", size="short", concurrency=c64)
    if a50 is not None and b50 is not None and b50 > 0:
        targets.append(
            f"vs vllm-router at c={c64}: {a50 / b50:.2f}x its added p50 (target ≤ 1.5x): "
            f"{'met' if a50 <= 1.5 * b50 else 'missed'}"
        )
    if stall:
        s99 = added(stall, "dpd-router", "p99")
        if s99 is not None:
            targets.append(
                f"short p99 added latency while {args.long_tokens}-token prompts arrive: {s99 * 1000:.2f} ms "
                f"(target ≤ 5): {'met' if s99 <= 0.005 else 'missed'}"
            )
    for pace in ("max", "paced"):
        d, b = medians(streaming, setup="dpd-router", pace=pace), medians(streaming, setup="direct", pace=pace)
        if d and b and b["chunks_per_s"]:
            share = d["chunks_per_s"] / b["chunks_per_s"]
            targets.append(
                f"relayed chunks/s at {args.streams} streams ({pace} engine): {share * 100:.0f}% of direct "
                f"(target ≥ 95%): {'met' if share >= 0.95 else 'missed'}"
            )
    if targets:
        md += ["## Targets", "", *[f"- {t}" for t in targets], ""]
    prof = results.get("profile") or {}
    if prof.get("samples"):
        md += [
            f"## Profile: dpd-router at c=64, short prompts (py-spy, {prof['samples']} samples)",
            "",
            report.table(
                ["inclusive samples", "%", "function"],
                [[n, f"{100 * n / prof['samples']:.0f}", f"`{f}`"] for f, n in prof["inclusive"]],
            ),
            "",
            report.table(
                ["self samples", "%", "function"],
                [[n, f"{100 * n / prof['samples']:.0f}", f"`{f}`"] for f, n in prof["self"]],
            ),
            "",
        ]
    md += [f"![{name}]({name})" for name in results.get("plots", [])]
    text = "\n".join(md) + "\n"
    (args.out / "results.md").write_text(text)
    return text


def plot(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    plt = report.plotting()
    lat = [r for r in results["runs"] if r["kind"] == "latency"]
    if plt is None or not lat:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, size in zip(axes, ("short", "long"), strict=True):
        setups = [s for s in (*PLAIN, *PD) if s != "direct" and any(r["setup"] == s for r in lat)]
        width = 0.8 / max(len(setups), 1)
        for i, setup in enumerate(setups):
            values = [added(lat, setup, "p50", size=size, concurrency=c) for c in args.concurrency]
            xs = [j + i * width for j in range(len(args.concurrency))]
            ax.bar(xs, [(v or 0) * 1000 for v in values], width, label=setup)
        ax.set_xticks([j + width * (len(setups) - 1) / 2 for j in range(len(args.concurrency))])
        ax.set_xticklabels([f"c={c}" for c in args.concurrency])
        ax.set_ylabel("added E2E p50 (ms)")
        ax.set_title(f"{size} prompts")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    fig.suptitle("Latency added over direct (medians of interleaved repeats)")
    fig.tight_layout()
    path = args.out / "added_latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    prompts = Prompts(PromptFactory(ensure_tokenizer()), args.long_tokens)
    exits: list[Any] = []
    results: dict[str, Any] = {"runs": []}
    try:
        urls = await bring_up(args, exits)
        results["runs"] += await latency_runs(args, urls, prompts)
        results["runs"] += await tokenize_stall_runs(args, urls, prompts)
        results["runs"] += await streaming_runs(args, urls, prompts)
        results["profile"] = await profile_router(args, urls, prompts, args.out)
    finally:
        for item in reversed(exits):
            if isinstance(item, stack.Service):
                await item.stop()
            else:
                await item.__aexit__(None, None, None)
    report.finish(results, args, started=started, plot=lambda: plot(results, args), write=lambda: write(results, args))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stack.run_async(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
