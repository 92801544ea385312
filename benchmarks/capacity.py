"""Scenario 2b: router capacity. What a router costs per request when the engine costs nothing.

One engine that answers at once (benchmarks/instant_engine.py) behind each setup: the engine
directly, dpd-router (one process, and `--workers 2`), vllm-router (Rust) and, given a checkout,
production-stack's router. wrk (C, one thread) drives short chat completions, whole and streamed,
at concurrency 1 (the latency a router adds) and 64 (the requests per second it sustains), and a
32k-token prompt at concurrency 1 (what tokenizing a long prompt costs). Setups take turns within
each round; rows are medians over rounds. The router's CPU time per request (the process and its
children, from /proc, over the requests wrk completed) is the figure least moved by the load
generator and the engine sharing the machine's cores.

    python -m benchmarks.capacity [--rounds 3] [--seconds 6] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from benchmarks import report, stack, tools
from benchmarks.stack import MODEL, Service
from benchmarks.workload import PromptFactory
from dpd_sim.tokenizer_kit import ensure_tokenizer

NAME = "router_capacity"
# Setups in the order a round starts with (each round rotates it).
SETUPS = ("direct", "dpd-router", "dpd-router-w2", "vllm-router", "production-stack")


@dataclass(frozen=True)
class Cell:
    """One kind of load: whole or streamed answers, short or 32k-token prompts, at a concurrency."""

    stream: bool
    size: str
    concurrency: int

    @property
    def label(self) -> str:
        return f"{'stream' if self.stream else 'whole'} {self.size} c={self.concurrency}"


CELLS = (
    Cell(False, "short", 1),
    Cell(False, "short", 64),
    Cell(True, "short", 1),
    Cell(True, "short", 64),
    Cell(False, "32k", 1),
)


def ensure_wrk() -> str:
    """wrk from the system; Debian's package when it is missing and apt can install it (as root)."""
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing wrk (Debian package) ...", file=sys.stderr, flush=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, stdout=subprocess.DEVNULL)
        found = shutil.which("wrk")
    if not found:
        raise SystemExit("this benchmark needs wrk: `apt-get install wrk` (or your system's package)")
    return found


def bodies(factory: PromptFactory, long_tokens: int) -> dict[tuple[bool, str], bytes]:
    """The request body of each (stream, size): one fixed body, as a router sees a repeated request."""
    out = {}
    for size, content in (("short", factory.prompt(1, 64)), ("32k", factory.text(long_tokens, "capacity-long"))):
        for stream in (False, True):
            body: dict[str, Any] = {
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 8,
                "stream": stream,
            }
            if stream:
                body["stream_options"] = {"include_usage": True}
            out[(stream, size)] = orjson.dumps(body)
    return out


# Where a body's request number goes in `wrk_script`: every request's body differs from the others'.
COUNTER = b"@@N@@"


def wrk_script(body: bytes, directory: Path) -> Path:
    """The Lua script that makes wrk POST `body` as JSON (the body read from a file beside it). A body with
    `COUNTER` in it has a number there that counts up from a random start, request by request, so that no
    two bodies are the same (a benchmark that repeats one body measures a cache of that body).

    The start is drawn by each wrk run as it starts (from /dev/urandom), not written into the script: one
    script runs several times (a warm-up, the rounds, each setup), and a start fixed in it sent every run the
    bodies of the first, which a router's caches (its piece cache: prompt/tokenizer.py) then answered."""
    directory.mkdir(parents=True, exist_ok=True)
    body_path = directory / "body.json"
    script = body_path.with_suffix(".lua")
    head, marker, tail = body.partition(COUNTER)
    if not marker:
        body_path.write_bytes(body)
        script.write_text(
            'wrk.method = "POST"\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
            f'local f = io.open("{body_path}", "rb")\n'
            "wrk.body = f:read('*a')\n"
            "f:close()\n"
        )
        return script
    body_path.write_bytes(head)
    body_path.with_suffix(".tail").write_bytes(tail)
    script.write_text(
        f'local f = io.open("{body_path}", "rb")\n'
        "local head = f:read('*a')\n"
        "f:close()\n"
        f'f = io.open("{body_path.with_suffix(".tail")}", "rb")\n'
        "local tail = f:read('*a')\n"
        "f:close()\n"
        'local urandom = io.open("/dev/urandom", "rb")\n'
        "local n = 0\n"
        'for byte in urandom:read(5):gmatch(".") do n = n * 256 + byte:byte() end\n'
        "urandom:close()\n"
        'local headers = {["Content-Type"] = "application/json"}\n'
        "request = function()\n"
        "  n = n + 1\n"
        '  return wrk.format("POST", nil, headers, head .. n .. tail)\n'
        "end\n"
    )
    return script


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _seconds(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(number) * _UNITS[unit]


def parse_wrk(output: str) -> dict[str, Any]:
    """Requests, requests/s, latency percentiles and errors from wrk's `--latency` report."""
    percentiles = {f"p{q}": _seconds(v) for q, v in re.findall(r"^\s+(50|90|99)%\s+(\S+)", output, re.M)}
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", output)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    errors = (int(bad[1]) if bad else 0) + (sum(int(x) for x in socket.groups()) if socket else 0)
    return {
        "requests": int(done[1]) if done else 0,
        "req_per_s": float(rate[1]) if rate else 0.0,
        "errors": errors,
        **percentiles,
    }


def tree_cpu_split(pid: int) -> tuple[float, float]:
    """CPU seconds of a process and its live descendants (a supervisor's workers count), in user code and in
    the kernel."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    user = system = 0.0
    todo = [pid]
    while todo:
        current = todo.pop()
        user_s, system_s = stack.cpu_split(current) or (0.0, 0.0)
        user, system = user + user_s, system + system_s
        todo.extend(children.get(current, ()))
    return user, system


async def run_wrk(wrk: str, url: str, script: Path, cell: Cell, seconds: int, pid: int | None) -> dict[str, Any]:
    before = tree_cpu_split(pid) if pid else (0.0, 0.0)
    process = await asyncio.create_subprocess_exec(
        wrk, "-t1", f"-c{cell.concurrency}", f"-d{seconds}s", "--latency", "--timeout", "30s", "-s", str(script),
        url + "/v1/chat/completions",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output = (await process.communicate())[0].decode(errors="replace")
    summary = parse_wrk(output)
    if pid:
        after = tree_cpu_split(pid)
        user, system = after[0] - before[0], after[1] - before[1]
        done = summary["requests"]
        summary["cpu_ms_per_request"] = (user + system) * 1000 / done if done else None
        # The same time told apart: the process's own code (the interpreter) and the kernel's (its syscalls).
        summary["cpu_user_ms_per_request"] = user * 1000 / done if done else None
        summary["cpu_system_ms_per_request"] = system * 1000 / done if done else None
    if not summary["requests"]:
        summary["wrk_output"] = output[-800:]
    return summary


async def bring_up(args: argparse.Namespace) -> tuple[dict[str, Service], str]:
    engine = Service(
        "instant-engine",
        [sys.executable, "-m", "benchmarks.instant_engine", str(port := stack.free_port()), MODEL],
        port,
        ready_path="/v1/models",
    )
    await engine.start()
    url = engine.url
    huge = 10**9  # every request direct: the plain relay, what vllm-router's plain mode does too
    services: dict[str, Service] = {
        "dpd-router": stack.dpd_router(decode=[url], threshold=huge),
        "dpd-router-w2": stack.dpd_router(decode=[url], threshold=huge, name="dpd-router-w2", settings={"workers": 2}),
    }
    if not args.no_vllm_router:
        tools.ensure_venv("vllm-router")
        services["vllm-router"] = stack.vllm_router(workers=[url])
    if args.production_stack_src is not None:
        tools.ensure_production_stack(Path(args.production_stack_src))
        services["production-stack"] = stack.production_stack_router(workers=[url])
    await asyncio.gather(*(service.start() for service in services.values()))
    return {"instant-engine": engine, **services}, url


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    wrk = ensure_wrk()
    factory = PromptFactory(ensure_tokenizer())
    scratch = Path(tempfile.mkdtemp(prefix="capacity-"))
    scripts = {
        key: wrk_script(body, scratch / str(i))
        for i, (key, body) in enumerate(bodies(factory, args.long_tokens).items())
    }
    services, engine_url = await bring_up(args)
    urls = {name: service.url for name, service in services.items() if name != "instant-engine"}
    urls["direct"] = engine_url
    pids = {name: service.pid for name, service in services.items() if name != "instant-engine"}
    setups = [s for s in SETUPS if s in urls]
    cells = [c for c in CELLS if c.concurrency in args.concurrency]
    runs: list[dict[str, Any]] = []
    try:
        for setup in setups:  # warm every path (connections, tokenizer caches) before anything counts
            for cell in cells:
                await run_wrk(wrk, urls[setup], scripts[(cell.stream, cell.size)], cell, 1, None)
        for round_ in range(args.rounds):
            order = setups[round_ % len(setups) :] + setups[: round_ % len(setups)]
            for cell in cells:
                for setup in order:
                    script = scripts[(cell.stream, cell.size)]
                    summary = await run_wrk(wrk, urls[setup], script, cell, args.seconds, pids.get(setup))
                    if not args.quiet:
                        cpu = summary.get("cpu_ms_per_request")
                        print(
                            f"r{round_} {cell.label:18} {setup:16} {summary['req_per_s']:8.0f} req/s "
                            f"p50 {summary.get('p50', 0) * 1000:7.2f} ms  cpu {cpu or 0:.3f} ms/req "
                            f"errors {summary['errors']}",
                            file=sys.stderr,
                            flush=True,
                        )
                    runs.append({"setup": setup, "cell": cell.label, "round": round_, "summary": summary})
    finally:
        await asyncio.gather(*(service.stop() for service in services.values()))
        shutil.rmtree(scratch, ignore_errors=True)
    return runs


def median(runs: list[dict[str, Any]], setup: str, cell: str, key: str) -> float | None:
    values = [r["summary"].get(key) for r in runs if r["setup"] == setup and r["cell"] == cell]
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    cells = list(dict.fromkeys(r["cell"] for r in runs))
    setups = list(dict.fromkeys(s for s in SETUPS if any(r["setup"] == s for r in runs)))
    for cell in cells:
        direct = median(runs, "direct", cell, "p50")
        for setup in setups:
            p50 = median(runs, setup, cell, "p50")
            out.append(
                {
                    "cell": cell,
                    "setup": setup,
                    "req_per_s": median(runs, setup, cell, "req_per_s"),
                    "p50": p50,
                    "p99": median(runs, setup, cell, "p99"),
                    "added_p50": None if setup == "direct" or p50 is None or direct is None else p50 - direct,
                    "cpu_ms_per_request": median(runs, setup, cell, "cpu_ms_per_request"),
                    "errors": sum(r["summary"]["errors"] for r in runs if r["setup"] == setup and r["cell"] == cell),
                }
            )
    return out


def _find(table: list[dict[str, Any]], cell: str, setup: str) -> dict[str, Any] | None:
    return next((row for row in table if row["cell"] == cell and row["setup"] == setup), None)


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or not theirs else f"{ours / theirs:.2f}x"


def targets(table: list[dict[str, Any]]) -> list[list[str]]:
    """Issue #21's targets for the short-request rows, against vllm-router in the same run."""

    def value(cell: str, setup: str, key: str) -> float | None:
        row = _find(table, cell, setup)
        return None if row is None else row[key]

    out = []
    ours, theirs = (
        value("whole short c=1", "dpd-router", "added_p50"),
        value("whole short c=1", "vllm-router", "added_p50"),
    )
    out.append(["added p50, whole short c=1", "<= 1.5x vllm-router", _ratio(ours, theirs)])
    ours, theirs = (
        value("whole short c=64", "dpd-router", "req_per_s"),
        value("whole short c=64", "vllm-router", "req_per_s"),
    )
    out.append(["req/s, whole short c=64, one process", ">= 0.8x vllm-router", _ratio(ours, theirs)])
    cpu = value("whole short c=64", "dpd-router", "cpu_ms_per_request")
    out.append(["router CPU per whole short request (c=64)", "<= 0.4 ms", report.num(cpu, 3) + " ms"])
    cpu = value("stream short c=64", "dpd-router", "cpu_ms_per_request")
    out.append(["router CPU per streamed short request (c=64)", "<= 0.8 ms", report.num(cpu, 3) + " ms"])
    added = value("whole 32k c=1", "dpd-router", "added_p50")
    out.append(["added p50, 32k-token prompt c=1", "<= 10 ms", report.ms(added, 2) + " ms"])
    one, two = (
        value("whole short c=64", "dpd-router", "req_per_s"),
        value("whole short c=64", "dpd-router-w2", "req_per_s"),
    )
    out.append(["req/s, --workers 2 over one process (whole short c=64)", "(scale-out)", _ratio(two, one)])
    return out


def write(results: dict[str, Any], out: Path) -> str:
    table = results["rows"]
    lines = [
        f"# Scenario 2b: router capacity ({results['env']['when']}, {results['env']['commit']})",
        "",
        "One instant engine (benchmarks/instant_engine.py) behind each setup; wrk, one thread; "
        f"{results['args']['rounds']} interleaved rounds of {results['args']['seconds']} s a cell, medians. "
        "Added = setup p50 minus direct p50 in the same cell. "
        "Router CPU is the router's processes' CPU time over the requests served. "
        f"Machine: {results['env']['machine']}, shared by wrk, the engine and the router.",
        "",
        report.table(
            ["load", "setup", "req/s", "p50 ms", "p99 ms", "added p50 ms", "router CPU ms/req", "errors"],
            [
                [
                    row["cell"],
                    row["setup"],
                    report.num(row["req_per_s"], 0),
                    report.ms(row["p50"], 2),
                    report.ms(row["p99"], 2),
                    report.ms(row["added_p50"], 2),
                    report.num(row["cpu_ms_per_request"], 3),
                    row["errors"],
                ]
                for row in table
            ],
        ),
        "",
        "## Against issue #21's targets (same run)",
        "",
        report.table(["measure", "target", "measured"], targets(table)),
        "",
    ]
    text = "\n".join(lines)
    (out / "results.md").write_text(text)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=6, help="wrk's duration per setup and cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--long-tokens", type=int, default=32768)
    parser.add_argument("--no-vllm-router", action="store_true", help="skip vllm-router (no install)")
    parser.add_argument(
        "--production-stack-src",
        type=Path,
        default=os.environ.get("PRODUCTION_STACK_SRC"),
        help="a production-stack checkout: run its router too",
    )
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--smoke", action="store_true", help="one short round, no peers")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.seconds, args.no_vllm_router, args.long_tokens = 1, 1, True, 2048
        args.production_stack_src = None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    runs = asyncio.run(measure(args))
    results: dict[str, Any] = {"runs": runs, "rows": rows(runs)}
    args.out.mkdir(parents=True, exist_ok=True)
    report.finish(results, args, started=started, plot=list, write=lambda: write(results, args.out))


if __name__ == "__main__":
    main()
