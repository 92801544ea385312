"""Scenario 2c: per-stage cost. Where dpd-router's CPU per request goes, stage by stage, beside the Python floor.

Two instant engines (benchmarks/instant_engine.py), a prefiller and a decoder, behind one dpd-router process
(a static threshold of 1,024 tokens: a long prompt takes both hops) and behind the Python floor
(benchmarks/floor_proxy.py: uvicorn, orjson and the router's engine pool, nothing of the router's own). wrk
drives five loads in turn (LOADS; every body differs: a request number starts its message), each twice a
round on the router: once for its CPU time per request (utime+stime from /proc over the requests wrk
completed), once under py-spy, which samples the router's
threads while they are on a CPU. Each sample goes to one stage: that of its innermost frame the stage map
(STAGE_MAP) names, the most specific entry winning; frames it does not name (the standard library, the
libraries every stage calls) count for their caller, and a sample none of whose frames is named is "other".
A stage's share is that of the samples, each thread's weighed by the CPU time the kernel counted for it in
the window (attribute() says why); its CPU per request is its share times the CPU per request. The floor
serves (a), (b) and (f) in the same rounds, timed and sampled the same way: its stages beside the router's say
which of the router's stages hold what it pays over the floor. Every timed run's CPU is told apart in the
process's own code (user) and the kernel's. The floor serves those loads once more slowed: spinning, on each
request, the Python the router's own code took over the floor's in that round, so its kernel time says what
a process that slow pays for the same reads and writes. vllm-router (plain), where its binary is given,
serves them too, timed only.

    python -m benchmarks.stages [--rounds 2] [--seconds 4] [--smoke] [--raw DIR] [--vllm-router PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks import capacity, report, stack
from benchmarks.stack import MODEL, Service
from benchmarks.workload import PromptFactory
from dpd_sim.tokenizer_kit import ensure_tokenizer

NAME = "stages"
THRESHOLD = 1024
OTHER = "other"


@dataclass(frozen=True)
class Load:
    """One kind of request, sent by wrk over and over at a concurrency."""

    key: str
    tokens: int
    stream: bool
    concurrency: int
    floor: bool  # the floor (and vllm-router, where it is installed) serves it too
    # Milliseconds between a stream's chunks (the instant engine's `instant_gap_ms`): each reaches the router
    # alone, as a real decoder's do, where without a gap they arrive together and are read a few at a time.
    gap_ms: float = 0.0

    @property
    def label(self) -> str:
        kind = "streamed 32 tokens" if self.stream else "whole"
        if self.gap_ms:
            kind += f" {self.gap_ms:g} ms apart"
        hops = ", two hops" if self.tokens >= THRESHOLD else ""
        return f"({self.key}) {kind}, {self.tokens:,}-token prompt{hops}, c={self.concurrency}"

    def body(self, factory: PromptFactory) -> bytes:
        content = factory.text(self.tokens, f"stages-{self.key}")  # no load's prompt a prefix of another's
        # A request number starts the message: every body differs (capacity.wrk_script), as traffic does.
        marked = capacity.COUNTER.decode() + " " + content
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": marked}]}
        body["max_tokens"] = 32 if self.stream else 8
        if self.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        if self.gap_ms:
            body["instant_gap_ms"] = self.gap_ms
        return orjson.dumps(body)


LOADS = (
    Load("a", 64, stream=False, concurrency=64, floor=True),
    Load("b", 64, stream=True, concurrency=64, floor=True),
    Load("c", 1600, stream=False, concurrency=64, floor=False),
    Load("d", 32768, stream=False, concurrency=1, floor=False),
    # Below the threshold, but its bytes (about 3,000) do not show it: its tokens are counted, as far as
    # its bound needs (most of it).
    Load("e", 640, stream=False, concurrency=64, floor=False),
    # (b) as a decoder paces it: every chunk read and relayed alone.
    Load("f", 64, stream=True, concurrency=64, floor=True, gap_ms=10.0),
)

# Stage -> the frames it owns: a module path as py-spy prints it (a file, or a package with its "/"),
# optionally ":function" (the qualified name py-spy prints). Keyed on modules, so it survives edits inside them.
# Libraries any stage calls (asyncio, anyio, httpx, aiohttp, multidict, pydantic, logging, ...) are named by
# none: their frames count for the stage that called them.
STAGE_MAP: dict[str, tuple[str, ...]] = {
    "listener & ASGI": (
        "uvicorn/", "httptools/", "h11/", "starlette/", "fastapi/",
        "dpd_router/server.py", "dpd_router/app.py", "dpd_router/api/guards.py", "dpd_router/api/answers.py",
        "dpd_router/api/departure.py",
    ),
    "key, limits & admission": (
        "dpd_router/api/auth.py", "dpd_router/api/limits.py", "dpd_router/api/redis_limits.py",
        "dpd_router/api/admission.py", "dpd_router/api/keys.py",
    ),
    "parse & checks": (
        "dpd_router/request/client_request.py", "dpd_router/prompt/context_window.py",
        "dpd_router/api/openai.py:_read_body", "dpd_router/api/openai.py:_resolve_model",
    ),
    "tokenize": (
        "dpd_router/prompt/tokenizer.py", "dpd_router/prompt/word_cache.py", "dpd_router/prompt/bounds.py",
        "dpd_router/prompt/template_sandbox.py", "transformers/", "tokenizers/",
        "jinja2/", "markupsafe/", "<template>",
    ),
    "plan": ("dpd_router/routing/", "dpd_router/pool/"),
    "engine call": (
        "dpd_router/pool/engine_pool.py", "dpd_router/pool/transport.py", "dpd_router/transfer/",
        "dpd_router/gateway/deadlines.py",
        "dpd_router/gateway/decode.py", "dpd_router/gateway/prefill.py", "dpd_router/gateway/concurrent.py",
        "dpd_router/gateway/head_first.py", "dpd_router/gateway/judge.py", "dpd_router/gateway/policy.py",
        "dpd_router/gateway/watch.py",
    ),
    "relay": ("dpd_router/gateway/relay.py", "dpd_router/gateway/answer.py"),
    "finish": (
        "dpd_router/record/", "dpd_router/gateway/completion.py", "dpd_router/routing/adaptive.py",
        "prometheus_client/", "opentelemetry/",
    ),
    # gateway/handler.py, api/openai.py's _serve, and the rest; the floor's app (its orjson calls count here).
    "handler's own steps": ("dpd_router/", "benchmarks/floor_proxy.py"),
    "background (probes, scrapes)": (
        "dpd_router/pool/health.py", "dpd_router/pool/scrape.py", "dpd_router/pool/discovery.py",
        "dpd_router/startup/", "dpd_router/routing/kv_sources/",
    ),
    # The loop's own frames, under everything: a sample ending in one is uvloop's C (polling, reading
    # sockets, dispatching callbacks and task steps), which has no Python frame of its own.
    "event loop": (
        "asyncio/runners.py", "asyncio/base_events.py", "uvloop/", "uvicorn/_compat.py", "uvicorn/main.py",
        "uvicorn/server.py:Server.run", "uvicorn/server.py:Server.serve", "uvicorn/server.py:Server._serve",
        "dpd_router/cli.py", "<frozen runpy>",
    ),
}  # fmt: skip
# A sample no frame of which is named, in a thread of these names (py-spy's --threads gives them): the stage.
THREAD_STAGES = {"tokenize": "tokenize"}  # the tokenizer's pools: their workers' own steps
STAGES = (*STAGE_MAP, OTHER)
_FRAME = re.compile(r"(?P<function>.*) \((?P<path>[^()]*)\)$")


@functools.cache
def stage_of_frame(frame: str) -> str | None:
    """The stage of one py-spy frame ("function (path)"): its most specific entry in STAGE_MAP (a function
    over its module, a longer path over a shorter), or None when no entry names it."""
    match = _FRAME.match(frame)
    if match is None:
        return None
    path, function = match["path"], match["function"]
    best: tuple[int, int] | None = None
    chosen = None
    for stage, entries in STAGE_MAP.items():
        for entry in entries:
            module, _, named = entry.partition(":")
            inside = path == module or (module.endswith("/") and path.startswith(module))
            if not inside or (named and named != function):
                continue
            rank = (1 if named else 0, len(module))
            if best is None or rank > best:
                best, chosen = rank, stage
    return chosen


_THREAD = re.compile(r"thread \((?P<tid>\w+)\)(?:: (?P<name>.*))?$")


def thread_of(stack_frames: tuple[str, ...]) -> tuple[str, str, tuple[str, ...]]:
    """The thread's id and name ("tokenize_0"; "" when py-spy did not say) and the sample's own frames."""
    match = _THREAD.match(stack_frames[0]) if stack_frames else None
    if match is None:
        return "", "", stack_frames
    return match["tid"], match["name"] or "", stack_frames[1:]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user and system) each thread of a process has used, by thread id."""
    seconds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def stage_of(stack_frames: tuple[str, ...]) -> str:
    """The stage of one sample (frames outermost first): that of its innermost named frame, else its thread's."""
    _, thread, frames = thread_of(stack_frames)
    for frame in reversed(frames):
        stage = stage_of_frame(frame)
        if stage is not None:
            return stage
    return next((stage for prefix, stage in THREAD_STAGES.items() if thread.startswith(prefix)), OTHER)


def read_stacks(raw: Path) -> Counter[tuple[str, ...]]:
    """py-spy's raw (collapsed) output: each stack, outermost frame first, and its samples."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        text, _, count = line.rpartition(" ")
        if count.isdigit():
            stacks[tuple(frame for frame in text.split(";") if frame)] += int(count)
    return stacks


def attribute(stacks: Counter[tuple[str, ...]], cpu: dict[str, float], rate: int, top: int = 25) -> dict[str, Any]:
    """Samples per stage, and each stage's share of the CPU time; the leaf functions (innermost frames) with
    most samples, each with its stage; per thread, its samples' seconds (at `rate` a second) and its CPU seconds.

    py-spy counts a thread that can run as on a CPU, waiting for a core or not, so on a busy machine its
    threads' samples outnumber their CPU time, unevenly. Each thread's samples are therefore weighed by the CPU
    time the kernel counted for it (`cpu`, by thread id): a stage's share is the sum over threads of the
    thread's part of the process's CPU time times the stage's part of the thread's samples.
    """
    by_thread: dict[str, Counter[str]] = {}
    names: dict[str, str] = {}
    leaves: Counter[str] = Counter()
    leaf_stages: dict[str, Counter[str]] = {}
    for stack_frames, count in stacks.items():
        stage = stage_of(stack_frames)
        tid, thread, frames = thread_of(stack_frames)
        by_thread.setdefault(tid, Counter())[stage] += count
        names[tid] = re.sub(r"_\d+$", "", thread) or "(unnamed)"
        leaf = frames[-1] if frames else "(no Python frame)"
        leaves[leaf] += count
        leaf_stages.setdefault(leaf, Counter())[stage] += count
    spent = {tid: seconds for tid, seconds in cpu.items() if seconds > 0}
    total = sum(spent.values())
    shares = dict.fromkeys(STAGES, 0.0)
    for tid, seconds in spent.items():
        counted = by_thread.get(tid) or Counter({OTHER: 1})  # CPU time of a thread py-spy never saw on a CPU
        for stage, count in counted.items():
            shares[stage] += seconds / total * count / counted.total()
    threads: dict[str, dict[str, float]] = {}
    for tid in {*by_thread, *spent}:
        seen = threads.setdefault(names.get(tid, "(not sampled)"), {"sampled_s": 0.0, "cpu_s": 0.0})
        seen["sampled_s"] += by_thread.get(tid, Counter()).total() / rate
        seen["cpu_s"] += spent.get(tid, 0.0)
    return {
        "samples": sum(leaves.values()),
        "stages": {stage: sum(counted[stage] for counted in by_thread.values()) for stage in STAGES},
        "shares": shares if total else None,
        "threads": threads,
        # Each leaf with the stage most of its samples went to (a library's frame counts for its caller's).
        "leaves": [[leaf, count, leaf_stages[leaf].most_common(1)[0][0]] for leaf, count in leaves.most_common(top)],
        "stage_leaves": {
            stage: [[leaf, n] for leaf, n in Counter({k: v[stage] for k, v in leaf_stages.items()}).most_common(5) if n]
            for stage in STAGES
        },
    }


# The router is started through this: a kernel with Yama's ptrace_scope 1 lets a process be traced by its
# ancestors only, and py-spy is not one; PR_SET_PTRACER_ANY (kept across the exec) lets it attach. Elsewhere
# the call fails harmlessly.
TRACEABLE = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def find_py_spy() -> str | None:
    """py-spy beside this interpreter (the test extra installs it), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass(frozen=True)
class Spied:
    """What py-spy saw in one window: its stacks, the samples it dropped, and each thread's CPU seconds."""

    stacks: Counter[tuple[str, ...]]
    dropped: int | None
    cpu: dict[str, float]


@dataclass
class Profiler:
    """py-spy over the router while one load runs: raw stacks of its threads while they are on a CPU."""

    binary: str
    pid: int
    rate: int
    directory: Path
    keep: bool = False  # the raw files stay in `directory` (--raw)
    # py-spy reads the stacks without pausing the router: a few samples come out torn (dropped, or with frames
    # of no stage), but a paused thread waiting on a lock is often taken for a busy one (--blocking).
    blocking: bool = False

    async def during(
        self, name: str, seconds: int, run: Awaitable[dict[str, Any]], *, pid: int | None = None
    ) -> tuple[dict[str, Any], Spied]:
        """`run`'s result (a wrk run of `seconds`), and the stacks of the router (or of process `pid`) sampled
        meanwhile."""
        pid = self.pid if pid is None else pid
        raw = self.directory / f"{name}.txt"
        before = thread_cpu(pid)
        spy = await asyncio.create_subprocess_exec(
            self.binary, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", str(self.rate),
            "--format", "raw", "--nolineno", "--threads", *([] if self.blocking else ["--nonblocking"]),
            "--output", str(raw),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        summary = await run
        output = (await spy.communicate())[0].decode(errors="replace")
        if spy.returncode != 0 or not raw.exists():
            raise SystemExit(
                f"py-spy could not sample the router (exit {spy.returncode}): {output[-600:]}\n"
                "It needs ptrace: root, or CAP_SYS_PTRACE in a container, and a kernel that allows it"
                " (see /proc/sys/kernel/yama/ptrace_scope)."
            )
        counted = re.search(r"Samples: (\d+) Errors: (\d+)", output)
        after = thread_cpu(pid)
        cpu = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
        spied = Spied(read_stacks(raw), int(counted[2]) if counted else None, cpu)
        if not self.keep:
            raw.unlink()
        return summary, spied


ENGINE = (sys.executable, "-m", "benchmarks.instant_engine")


async def bring_up(vllm_router: Path | None) -> dict[str, Service]:
    """The two engines, then the router over both, the floor over the decoder, and vllm-router (plain, over the
    decoder) where its binary is given."""
    prefiller, decoder = (
        Service(name, [*ENGINE, str(port := stack.free_port()), MODEL, "--stream-tokens", "32"], port, "/v1/models")
        for name in ("prefiller", "decoder")
    )
    await asyncio.gather(prefiller.start(), decoder.start())
    router = stack.dpd_router(
        prefill=[prefiller.url], decode=[decoder.url], threshold=THRESHOLD, settings={"threshold_mode": "static"}
    )
    router.argv = [sys.executable, "-c", TRACEABLE, *router.argv[1:]]
    floor_port = stack.free_port()
    floor_argv = [sys.executable, "-c", TRACEABLE, "-m", "benchmarks.floor_proxy", str(floor_port), decoder.url]
    floor = Service("floor", floor_argv, floor_port)
    services = {"prefiller": prefiller, "decoder": decoder, "router": router, "floor": floor}
    if vllm_router is not None:
        peer = stack.vllm_router(workers=[decoder.url])
        peer.argv[0] = str(vllm_router)
        services["vllm-router"] = peer
    try:
        await asyncio.gather(*(services[name].start() for name in services if name not in ("prefiller", "decoder")))
    except BaseException:
        await asyncio.gather(*(service.stop() for service in services.values()))
        raise
    return services


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    wrk = capacity.ensure_wrk()
    pyspy = find_py_spy()
    if pyspy is None:
        raise SystemExit("this benchmark needs py-spy: `pip install py-spy` (the project's test extra has it)")
    factory = PromptFactory(ensure_tokenizer())
    scratch = Path(tempfile.mkdtemp(prefix="stages-"))
    loads = [*LOADS[:3], replace(LOADS[3], tokens=args.long_tokens), *LOADS[4:]]
    scripts = {load.key: capacity.wrk_script(load.body(factory), scratch / load.key) for load in loads}
    services = await bring_up(args.vllm_router)
    router, floor, peer = services["router"], services["floor"], services.get("vllm-router")
    if args.raw is not None:
        args.raw.mkdir(parents=True, exist_ok=True)
    profiler = Profiler(pyspy, router.pid, args.rate, args.raw or scratch, args.raw is not None, args.blocking)
    stacks: dict[str, Counter[tuple[str, ...]]] = {load.key: Counter() for load in loads}
    cpu: dict[str, dict[str, float]] = {load.key: {} for load in loads}  # by thread, in the py-spy windows
    floor_stacks: dict[str, Counter[tuple[str, ...]]] = {load.key: Counter() for load in loads if load.floor}
    floor_cpu: dict[str, dict[str, float]] = {key: {} for key in floor_stacks}
    runs: list[dict[str, Any]] = []

    def drive(service: Service, load: Load, seconds: int, *, count: bool = True) -> Awaitable[dict[str, Any]]:
        """wrk's run of `load` on `service`, with the service's CPU per request when `count`."""
        cell = capacity.Cell(load.stream, load.key, load.concurrency)
        pid = service.pid if count else None
        return capacity.run_wrk(wrk, service.url, scripts[load.key], cell, seconds, pid)

    try:
        for load in loads:  # warm every path (connections, tokenizer caches) before anything counts
            await drive(router, load, 1, count=False)
            if load.floor:
                await drive(floor, load, 1, count=False)
                if peer is not None:
                    await drive(peer, load, 1, count=False)
        for round_ in range(args.rounds):
            for load in loads:
                # The CPU per request from a window of its own: py-spy's reads slow the router a little.
                before = await stack.route_decisions(router.url)
                summary = await drive(router, load, args.seconds)
                runs.append(_run("dpd-router", load, round_, summary, args))
                name = f"{load.key}-r{round_}"
                summary, spied = await profiler.during(name, args.seconds, drive(router, load, args.seconds))
                stacks[load.key].update(spied.stacks)
                for tid, seconds in spied.cpu.items():
                    cpu[load.key][tid] = cpu[load.key].get(tid, 0.0) + seconds
                decisions = stack.decisions_delta(before, await stack.route_decisions(router.url))
                extra = {"decisions": decisions, "pyspy_dropped": spied.dropped}
                runs.append(_run("dpd-router, py-spy", load, round_, summary, args) | extra)
                if load.floor:
                    runs.append(_run("floor", load, round_, await drive(floor, load, args.seconds), args))
                    run = drive(floor, load, args.seconds)
                    summary, spied = await profiler.during(f"{name}-floor", args.seconds, run, pid=floor.pid)
                    floor_stacks[load.key].update(spied.stacks)
                    for tid, seconds in spied.cpu.items():
                        floor_cpu[load.key][tid] = floor_cpu[load.key].get(tid, 0.0) + seconds
                    runs.append(_run("floor, py-spy", load, round_, summary, args) | {"pyspy_dropped": spied.dropped})
                    # The floor at the router's rate: as much Python spun a request as the router's own code
                    # took over the floor's in this round, so its kernel time is that of as slow a process.
                    burn = _router_excess_us(runs, load.key, round_)
                    await _slow(floor, burn)
                    summary = await drive(floor, load, args.seconds)
                    await _slow(floor, 0)
                    runs.append(_run("floor, slowed", load, round_, summary, args) | {"burn_us": burn})
                    if peer is not None:
                        runs.append(_run("vllm-router", load, round_, await drive(peer, load, args.seconds), args))
    finally:
        await asyncio.gather(*(service.stop() for service in services.values()))
        shutil.rmtree(scratch, ignore_errors=True)
    profiles = {key: attribute(counted, cpu[key], args.rate) for key, counted in stacks.items()}
    floor_profiles = {key: attribute(counted, floor_cpu[key], args.rate) for key, counted in floor_stacks.items()}
    loads_seen = [vars(load) | {"label": load.label} for load in loads]
    return {"loads": loads_seen, "runs": runs, "profiles": profiles, "floor_profiles": floor_profiles}


def _router_excess_us(runs: list[dict[str, Any]], load: str, round_: int) -> int:
    """Microseconds of its own code (user CPU) the router took a request over the floor's, in a round's windows
    without py-spy."""

    def user(setup: str) -> float:
        (run,) = (r for r in runs if r["setup"] == setup and r["load"] == load and r["round"] == round_)
        return float(run["summary"].get("cpu_user_ms_per_request") or 0.0)

    return max(round((user("dpd-router") - user("floor")) * 1000), 0)


async def _slow(floor: Service, burn_us: int) -> None:
    """Have the floor spin `burn_us` microseconds of Python on each request (0: none)."""
    async with httpx.AsyncClient(timeout=10) as client:
        (await client.get(floor.url + "/", params={"burn_us": burn_us})).raise_for_status()


def _run(setup: str, load: Load, round_: int, summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    if not args.quiet:
        print(
            f"r{round_} {load.label:52} {setup:17} {summary['req_per_s']:8.0f} req/s  "
            f"cpu {summary.get('cpu_ms_per_request') or 0:.3f} ms/req  errors {summary['errors']}",
            file=sys.stderr,
            flush=True,
        )
    return {"setup": setup, "load": load.key, "round": round_, "summary": summary}


def median(runs: list[dict[str, Any]], setup: str, load: str, key: str = "cpu_ms_per_request") -> float | None:
    values = [r["summary"].get(key) for r in runs if r["setup"] == setup and r["load"] == load]
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def columns(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The table's columns: (column key, setup, load key): each load on the router, the floor beside it."""
    found = []
    for load in results["loads"]:
        found.append((load["key"], "dpd-router", load["key"]))
        if load["key"] in results.get("floor_profiles", {}):
            found.append((f"{load['key']}-floor", "floor", load["key"]))
    return found


def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row a stage: per column (a load on the router, or on the floor), the stage's share of the
    process's CPU time and its CPU ms per request."""
    rows = []
    for stage in STAGES:
        row: dict[str, Any] = {"stage": stage}
        for column, setup, load in columns(results):
            profiles = results["profiles"] if setup == "dpd-router" else results["floor_profiles"]
            shares = profiles[load]["shares"]
            share = None if shares is None else shares[stage]
            total = median(results["runs"], setup, load)
            row[column] = {"share": share, "cpu_ms": None if share is None or total is None else share * total}
        rows.append(row)
    return rows


USER_KERNEL = ("user", "system")  # the CPU time's parts in a run's summary (cpu_user_ms_per_request, ...)
DETAIL = (
    "load", "setup", "req/s", "p50 ms", "CPU ms/req", "user", "kernel", "errors", "samples", "sampled ÷ CPU time",
    "decisions (slowed: Python spun a request)",
)  # fmt: skip


def write(results: dict[str, Any], out: Path) -> str:
    loads, args = results["loads"], results["args"]
    mode = "pausing it for each (--blocking)" if args["blocking"] else "without pausing it"
    lines = [
        f"# Scenario 2c: per-stage cost ({results['env']['when']}, {results['env']['commit']})",
        "",
        "CPU ms per request by stage, and the stage's share of the process's CPU time: py-spy's samples of "
        f"its threads on a CPU ({args['rate']} a second, {mode}), each thread's weighed by its CPU time "
        "in the window. Two instant engines (a prefiller and a decoder), one dpd-router "
        f"process (static threshold {THRESHOLD} tokens), the Python floor (benchmarks/floor_proxy.py: uvicorn, "
        "orjson, the router's engine pool) on the decoder, sampled the same way for the loads it serves (its "
        "app and orjson count as handler's steps); "
        f"wrk, one thread; {args['rounds']} rounds of {args['seconds']} s a load and setup. CPU per request: "
        "the median over rounds of windows without py-spy; samples pooled over the rounds' py-spy windows. "
        f"Machine: {results['env']['machine']}, shared by wrk, the engines and the router.",
        "",
        report.table(["stage", *_column_labels(results)], _stage_rows(results)),
        "",
        report.table(DETAIL, _detail_rows(results)),
        "",
        f"## Top 10 leaf functions, {loads[0]['label']}",
        "",
        "The innermost frame of each sample, and the stage most of its samples went to (a library's frame counts "
        "for its caller's).",
        "",
        report.table(["leaf (innermost frame)", "stage", "samples", "share"], _leaf_rows(results["profiles"]["a"])),
        "",
    ]
    text = "\n".join(lines)
    (out / "results.md").write_text(text)
    return text


def _column_labels(results: dict[str, Any]) -> list[str]:
    labels = {load["key"]: load["label"] for load in results["loads"]}
    return [labels[load] if setup == "dpd-router" else f"({load}) on the floor" for _, setup, load in columns(results)]


def _stage_rows(results: dict[str, Any]) -> list[list[str]]:
    runs, shown = results["runs"], columns(results)

    def cell(value: dict[str, Any]) -> str:
        return "-" if value["share"] is None else f"{report.num(value['cpu_ms'], 3)} ({value['share'] * 100:.0f}%)"

    rows = [[row["stage"], *(cell(row[column]) for column, _, _ in shown)] for row in results["table"]]
    rows.append(["**total**", *(report.num(median(runs, setup, load), 3) for _, setup, load in shown)])
    kernel = "cpu_system_ms_per_request"
    in_kernel = (report.num(median(runs, setup, load, kernel), 3) for _, setup, load in shown)
    rows.append(["of it, in the kernel", *in_kernel])
    if any(run["setup"] == "floor, slowed" for run in runs):
        # The floor spinning the router's own extra time a request: what as slow a process pays in the kernel.
        slow = "floor, slowed"
        slowed = [
            (median(runs, slow, load), median(runs, slow, load, kernel)) if setup == "floor" else None
            for _, setup, load in shown
        ]
        cells = ["" if cpu is None else f"{report.num(cpu[0], 3)} ({report.num(cpu[1], 3)} kernel)" for cpu in slowed]
        rows.append(["**floor slowed to the router's rate**, total", *cells])
    if any(run["setup"] == "vllm-router" for run in runs):
        peer = [median(runs, "vllm-router", load) if setup == "dpd-router" else None for _, setup, load in shown]
        rows.append(["**vllm-router (plain), total**", *("" if cpu is None else report.num(cpu, 3) for cpu in peer)])
    return rows


def _detail_rows(results: dict[str, Any]) -> list[list[Any]]:
    """Per load and setup: rate, latency, CPU, errors; for the py-spy windows, what was sampled and how much of
    the threads' CPU time the samples account for, and where the router sent the requests."""
    rows: list[list[Any]] = []
    for load in results["loads"]:
        key, profile = load["key"], results["profiles"][load["key"]]
        for setup in ("dpd-router", "dpd-router, py-spy", "floor", "floor, py-spy", "floor, slowed", "vllm-router"):
            mine = [r for r in results["runs"] if r["setup"] == setup and r["load"] == key]
            if not mine:
                continue
            row = [load["label"], setup, report.num(median(mine, setup, key, "req_per_s"), 0)]
            row += [report.ms(median(mine, setup, key, "p50"), 2), report.num(median(mine, setup, key), 3)]
            row += [report.num(median(mine, setup, key, f"cpu_{part}_ms_per_request"), 3) for part in USER_KERNEL]
            row.append(sum(r["summary"]["errors"] for r in mine))
            if not setup.endswith("py-spy"):
                spun = [r["burn_us"] for r in mine if "burn_us" in r]
                rows.append([*row, "-", "-", ", ".join(f"{us} us" for us in spun) or "-"])
                continue
            if setup == "floor, py-spy":
                profile = results["floor_profiles"][key]
            dropped = sum(r["pyspy_dropped"] or 0 for r in mine)
            sampled = sum(t["sampled_s"] for t in profile["threads"].values())
            spent = sum(t["cpu_s"] for t in profile["threads"].values())
            decisions: Counter[str] = Counter()
            for run in mine:
                decisions.update(run.get("decisions", {}))
            row += [f"{profile['samples']} (+{dropped} dropped)", f"{sampled / spent:.2f}" if spent else "-"]
            rows.append([*row, ", ".join(f"{name} {count}" for name, count in decisions.most_common())])
    return rows


def _leaf_rows(profile: dict[str, Any]) -> list[list[Any]]:
    total = profile["samples"] or 1
    return [[f"`{leaf}`", stage, count, f"{count / total * 100:.1f}%"] for leaf, count, stage in profile["leaves"][:10]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=int, default=4, help="wrk's (and py-spy's) duration per load")
    parser.add_argument("--rate", type=int, default=250, help="py-spy's samples a second")
    parser.add_argument("--long-tokens", type=int, default=32768, help="load (d)'s prompt")
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw stacks here, a file a load and round")
    parser.add_argument(
        "--vllm-router",
        type=Path,
        default=stack.vllm_router_binary() if stack.vllm_router_binary().exists() else None,
        help="vllm-router's binary (pip install vllm-router in a venv of its own): its CPU per request on the loads "
        "the floor serves, beside the router's (default: benchmarks/.venvs/vllm-router's, where installed)",
    )
    parser.add_argument(
        "--blocking",
        action="store_true",
        help="py-spy pauses the router for each sample: no torn stacks, but idle threads then count as busy",
    )
    parser.add_argument("--smoke", action="store_true", help="one round of 1 s a load, (d) at 2,048 tokens")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.seconds, args.long_tokens = 1, 1, 2048
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    results = asyncio.run(measure(args))
    results["table"] = table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    report.finish(results, args, started=started, plot=list, write=lambda: write(results, args.out))


if __name__ == "__main__":
    main()
