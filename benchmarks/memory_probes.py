"""Scenario 4, part C: what hostile rounds leave in the router's memory, and whether it grows round after round.

One router (a prefiller and a decoder behind it, simulated, a threshold of 48 tokens so that both paths run)
is warmed up and left to settle, then takes `--rounds` identical rounds of three probes in turn, each probe
followed by the same settling time:
- *fuzz*: bodies built to cost memory: strings of 1-16 MiB in every field the router reads, nesting 1,000 to
  100,000 deep, 60,000 and 600,000 messages, 100,000 content parts, 20,000 tools, a body past the size limit,
  and two thousand small random bodies over every API;
- *burst*: concurrent streams (a paced decoder keeps them all open at once);
- *disconnects*: streams the client drops after their first tokens.
The router's RSS is read every 0.25 s: the settled size before the probes, each probe's peak, and the size
after each once it has settled (a round of the router's heap trimming). A size after that climbs round after
round is a leak; one that stops at the first round's is a high-water mark. With `--trace` the rounds run again
(`--trace-rounds`) on a router under tracemalloc (`benchmarks/traced_router.py`), and the lines of code that
allocated what is still alive after each probe, beyond the settled router, are listed: what holds the memory.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks import loadgen, stack
from benchmarks.workload import PromptFactory
from dpd_sim.gpu import TimingModel
from dpd_sim.tokenizer_kit import ensure_tokenizer

MODEL = stack.MODEL
PROBES = ("fuzz", "burst", "disconnects")
MIB = 1024 * 1024
BOUND = 1.2  # the issue's: within 20% of the settled size after every probe


# --- the fuzz bodies -------------------------------------------------------------------------------------


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _nested(depth: int, kind: str) -> bytes:
    """JSON nested `depth` deep, written as text: deeper than any encoder's recursion goes."""
    if kind == "list":
        return b"[" * depth + b'"x"' + b"]" * depth
    return b'{"a":' * depth + b'"x"' + b"}" * depth


def _with(body: dict[str, Any], raw: bytes) -> bytes:
    """`body` encoded, its one string `@` replaced by the JSON text `raw`."""
    return orjson.dumps(body).replace(b'"@"', raw, 1)


def _encode(body: Any) -> bytes:
    return orjson.dumps(body)


def big_strings(sizes: tuple[int, ...]) -> list[tuple[str, str, bytes]]:
    bodies = []
    for size in sizes:
        text = "memory " * (size // 7)
        bodies += [
            (
                "/v1/chat/completions",
                "big string: content",
                _encode(_chat(messages=[{"role": "user", "content": text}])),
            ),
            ("/v1/chat/completions", "big string: model", _encode(_chat(model=text))),
            ("/v1/chat/completions", "big string: stop", _encode(_chat(stop=[text]))),
            ("/v1/chat/completions", "big string: user", _encode(_chat(user=text))),
            (
                "/v1/chat/completions",
                "big string: a tool",
                _encode(_chat(tools=[{"type": "function", "function": {"name": "f", "description": text}}])),
            ),
            ("/v1/completions", "big string: prompt", _encode({"model": MODEL, "prompt": text, "max_tokens": 2})),
            (
                "/v1/messages",
                "big string: Messages",
                _encode({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}),
            ),
            (
                "/v1/responses",
                "big string: Responses",
                _encode({"model": MODEL, "input": text, "max_output_tokens": 2}),
            ),
        ]
    return bodies


def deep_nesting(depths: tuple[int, ...]) -> list[tuple[str, str, bytes]]:
    bodies = []
    for depth in depths:
        for kind in ("list", "dict"):
            deep = _nested(depth, kind)
            bodies += [
                (
                    "/v1/chat/completions",
                    "deep: content",
                    _with(_chat(messages=[{"role": "user", "content": "@"}]), deep),
                ),
                ("/v1/chat/completions", "deep: tools", _with(_chat(tools="@"), deep)),
                ("/v1/chat/completions", "deep: response_format", _with(_chat(response_format="@"), deep)),
            ]
    return bodies


def many_items(scale: float) -> list[tuple[str, str, bytes]]:
    def n(count: int) -> int:
        return max(1, int(count * scale))

    null = {"role": "user", "content": None}
    part = {"type": "text", "text": "a"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return [
        ("/v1/chat/completions", "many: null messages", _encode(_chat(messages=[null] * n(60_000)))),
        ("/v1/chat/completions", "many: null messages", _encode(_chat(messages=[null] * n(600_000)))),
        (
            "/v1/chat/completions",
            "many: parts",
            _encode(_chat(messages=[{"role": "user", "content": [part] * n(100_000)}])),
        ),
        ("/v1/chat/completions", "many: tools", _encode(_chat(tools=[tool] * n(20_000)))),
        ("/v1/chat/completions", "too large", b'{"model": "' + b"x" * (40 * MIB) + b'"}'),
    ]


def random_bodies(count: int, seed: int) -> list[tuple[str, str, bytes]]:
    """Small bodies of every API, valid or not, each field a plausible, edge or wrong-typed value."""
    rng = random.Random(seed)

    def scalar() -> Any:
        return rng.choice(
            [
                None,
                True,
                False,
                0,
                -1,
                3,
                2**63,
                1.5,
                1e308,
                "",
                "x" * rng.randrange(40),
                "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
            ]
        )

    def value(depth: int = 0) -> Any:
        roll = rng.random()
        if depth > 3 or roll < 0.5:
            return scalar()
        if roll < 0.75:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["a", "type", "text", "role", "content"]): value(depth + 1) for _ in range(rng.randrange(4))}

    def content() -> Any:
        return rng.choice(["hello " * rng.randrange(1, 40), [{"type": "text", "text": "hi"}], value()])

    fields = ["model", "stream", "max_tokens", "n", "temperature", "stop", "tools", "tool_choice", "response_format",
              "logprobs", "seed", "user", "stream_options", "kv_transfer_params"]  # fmt: skip
    bodies = []
    for _ in range(count):
        kind = rng.randrange(5)
        extra = {field: value() for field in rng.sample(fields, rng.randrange(4))}
        if kind == 0:
            body: Any = {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": rng.choice(["user", "system", "tool", 5]), "content": content()}],
                **extra,
            }
            path = "/v1/chat/completions"
        elif kind == 1:
            body = {"model": MODEL, "max_tokens": 2, "prompt": content(), **extra}
            path = "/v1/completions"
        elif kind == 2:
            body = {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": rng.choice(["user", "assistant", 1]), "content": content()}],
                **extra,
            }
            path = "/v1/messages"
        elif kind == 3:
            body = {"model": MODEL, "max_output_tokens": 2, "input": content(), **extra}
            path = "/v1/responses"
        else:
            path, body = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/messages"]), value()
        raw = _encode(body) if rng.random() > 0.1 else bytes(rng.randrange(256) for _ in range(rng.randrange(60)))
        bodies.append((path, "random", raw))
    return bodies


def fuzz_bodies(smoke: bool) -> list[tuple[str, str, bytes]]:
    if smoke:
        return big_strings((MIB,)) + deep_nesting((1_000,)) + many_items(0.05) + random_bodies(100, 0)
    return (
        big_strings((MIB, 4 * MIB, 16 * MIB))
        + deep_nesting((1_000, 10_000, 100_000))
        + many_items(1.0)
        + random_bodies(2_000, 0)
    )


# --- the probes ------------------------------------------------------------------------------------------


async def fuzz(url: str, args: argparse.Namespace) -> dict[str, Any]:
    bodies = fuzz_bodies(args.smoke)
    statuses: collections.Counter[str] = collections.Counter()
    server_errors: list[str] = []
    gate = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:

        async def send(path: str, kind: str, raw: bytes) -> None:
            async with gate:
                try:
                    answer = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
                    await answer.aread()
                except httpx.HTTPError as exc:
                    statuses["no answer"] += 1
                    server_errors.append(f"{kind} on {path}: {type(exc).__name__}")
                    return
                statuses[str(answer.status_code)] += 1
                if answer.status_code >= 500:
                    server_errors.append(f"{kind} on {path}: {answer.status_code} {answer.text[:200]}")

        await asyncio.gather(*(send(*body) for body in bodies))
    return {
        "bodies": len(bodies),
        "MiB sent": round(sum(len(raw) for _, _, raw in bodies) / MIB),
        "answers": ", ".join(f"{count} {status}" for status, count in sorted(statuses.items())),
        "server_errors": server_errors[:20],
    }


async def burst(url: str, args: argparse.Namespace) -> dict[str, Any]:
    factory = PromptFactory(ensure_tokenizer())
    requests = [loadgen.Request(i, "stream", factory.prompt(i, 64), args.tokens, 64) for i in range(args.streams)]
    result = await loadgen.run(
        [url], requests, concurrency=args.streams, duration=args.max_seconds, drain=30, label="burst", progress=False
    )
    errors = collections.Counter((record.error or "")[:80] for record in result.records if record.error)
    errors_text = "; ".join(f"{count} {error}" for error, count in errors.most_common()) or "none"
    return {"streams": args.streams, "ok": sum(1 for r in result.records if r.ok), "errors": errors_text}


async def disconnects(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Streams the client drops after the first two chunks: their connections closed under the router."""
    factory = PromptFactory(ensure_tokenizer())
    dropped = 0
    limits = httpx.Limits(max_connections=args.disconnects, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:

        async def one(i: int) -> bool:
            request = loadgen.Request(i, "dropped", factory.prompt(20_000_000 + i, 64), args.tokens, 64)
            async with client.stream(
                "POST", "/v1/chat/completions", content=loadgen.chat_body(request),
                headers={"Content-Type": "application/json"},
            ) as answer:  # fmt: skip
                chunks = 0
                async for _ in answer.aiter_raw():
                    chunks += 1
                    if chunks >= 2:
                        return True  # leaving the block closes the connection mid-stream
            return False

        results = await asyncio.gather(*(one(i) for i in range(args.disconnects)), return_exceptions=True)
        dropped = sum(1 for result in results if result is True)
    return {"streams": args.disconnects, "dropped mid-stream": dropped}


PROBE_RUNS: dict[str, Callable[[str, argparse.Namespace], Awaitable[dict[str, Any]]]] = {
    "fuzz": fuzz,
    "burst": burst,
    "disconnects": disconnects,
}


# --- the run ---------------------------------------------------------------------------------------------


class Sampler:
    """The router's RSS every 0.25 s; `peak_since` the largest since a mark."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self._t0 = time.perf_counter()

    async def run(self) -> None:
        while True:
            self.samples.append((time.perf_counter() - self._t0, stack.rss_bytes(self.pid) or 0))
            await asyncio.sleep(0.25)

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def peak_since(self, mark: float) -> int:
        return max((rss for t, rss in self.samples if t >= mark), default=0)


@asynccontextmanager
async def router_for_probes(args: argparse.Namespace, folder: Path, *, frames: int) -> AsyncIterator[stack.Service]:
    """The router, run by `benchmarks.traced_router` (files into `folder`; `frames` deep tracemalloc, 0 off)."""
    timing = TimingModel(0.0, 0.0, args.step, 0.0, 0.0)
    extra = ["--max-batch-size", str(max(args.streams, args.disconnects) + 64)]
    async with stack.engines(prefill=1, decode=1, timing=timing, extra_args=extra) as cluster:
        router = stack.dpd_router(
            prefill=cluster.prefill_urls, decode=cluster.decode_urls, threshold=48,
            settings={"prefill_strategy": "roundrobin", "responses_store": "off"},
        )  # fmt: skip
        router.argv[1:3] = ["-m", "benchmarks.traced_router"]
        router.env["DPD_BENCH_SNAPSHOTS"] = str(folder)
        router.env["DPD_BENCH_TRACE_FRAMES"] = str(frames)
        if getattr(args, "allocator", "pymalloc") == "malloc":
            router.env["PYTHONMALLOC"] = "malloc"  # Python's objects from glibc's heaps, which the router trims
        try:
            # tracing every allocation from the first import makes the start take minutes
            await router.start(wait=600.0 if frames else 60.0)
            yield router
        finally:
            await router.stop()


async def _file_from(router: stack.Service, sig: signal.Signals, path: Path) -> Path:
    """Signal the router and wait for the file it writes in answer."""
    os.kill(router.pid, sig)
    deadline = time.monotonic() + 300
    while not await asyncio.to_thread(path.exists):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {path.name} from the router:\n{router.log_tail()}")
        await asyncio.sleep(0.1)
    return path


async def _allocators(router: stack.Service, folder: Path, n: int) -> dict[str, dict[str, int]]:
    """Where the router's memory is: resident kinds, glibc's heaps, Python's arenas (bytes, arena counts)."""
    path = await _file_from(router, signal.SIGUSR2, folder / f"{n}.alloc.json")
    where: dict[str, dict[str, int]] = orjson.loads(await asyncio.to_thread(path.read_bytes))
    return where


async def _warm(url: str) -> None:
    factory = PromptFactory(ensure_tokenizer())
    warm = [loadgen.Request(i, "warm", factory.prompt(10_000_000 + i, 64 if i % 2 else 16), 2, 64) for i in range(20)]
    await loadgen.run([url], warm, concurrency=4, duration=30, progress=False)


async def measured(args: argparse.Namespace) -> dict[str, Any]:
    """The probes in turn on one router, its RSS before, during and after each."""
    with tempfile.TemporaryDirectory(prefix="dpd-memory-") as name:
        return await _measured(args, Path(name))


async def _measured(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    async with router_for_probes(args, folder, frames=0) as router:
        sampler = Sampler(router.pid)
        sampling = asyncio.create_task(sampler.run())
        try:
            await _warm(router.url)
            await asyncio.sleep(args.settle)
            settled = stack.rss_bytes(router.pid) or 0
            settled_where = await _allocators(router, folder, 1)
            rows = []
            rounds = [(round_, name) for round_ in range(1, args.rounds + 1) for name in args.probes]
            for n, (round_, name) in enumerate(rounds, start=2):
                mark = sampler.now()
                cpu0 = stack.cpu_seconds(router.pid) or 0.0
                started = time.perf_counter()
                what = await PROBE_RUNS[name](router.url, args)
                seconds = time.perf_counter() - started
                cpu = (stack.cpu_seconds(router.pid) or 0.0) - cpu0
                await asyncio.sleep(args.settle)
                after = stack.rss_bytes(router.pid) or 0
                rows.append({
                    "round": round_, "probe": name, "what": what, "seconds": seconds, "router_cpu_s": cpu,
                    "peak_rss": sampler.peak_since(mark), "after_rss": after,
                    "where": await _allocators(router, folder, n),
                })  # fmt: skip
                if not args.quiet:
                    print(
                        f"round {round_} {name}: peak {sampler.peak_since(mark) / MIB:.1f} MiB, "
                        f"after {after / MIB:.1f} MiB",
                        flush=True,
                    )
        finally:
            sampling.cancel()
    return {
        "settled_rss": settled, "settled_where": settled_where, "probes": rows, "samples": sampler.samples,
        "bound": BOUND,
    }  # fmt: skip


async def _snapshot(router: stack.Service, folder: Path, n: int) -> tracemalloc.Snapshot:
    return tracemalloc.Snapshot.load(str(await _file_from(router, signal.SIGUSR1, folder / f"{n}.snap")))


def _where(stat: tracemalloc.StatisticDiff) -> str:
    """The innermost frame, and the innermost of the router's own where that is another's."""
    frames = list(stat.traceback)  # most recent call last
    inner = frames[-1]
    own = next((f for f in reversed(frames) if "/dpd_router/" in f.filename), None)
    text = f"{_short(inner.filename)}:{inner.lineno}"
    if own is not None and own is not inner:
        text += f" (from {_short(own.filename)}:{own.lineno})"
    return text


def _short(filename: str) -> str:
    for marker in ("/site-packages/", "/src/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


async def traced(args: argparse.Namespace) -> dict[str, Any]:
    """The probes again under tracemalloc: what is still allocated after each, beyond the settled router."""
    with tempfile.TemporaryDirectory(prefix="dpd-memory-") as name:
        folder = Path(name)
        async with router_for_probes(args, folder, frames=16) as router:
            await _warm(router.url)
            await asyncio.sleep(args.settle)
            base = await _snapshot(router, folder, 1)
            rows = []
            rounds = [(round_, probe) for round_ in range(1, args.trace_rounds + 1) for probe in args.probes]
            for n, (round_, probe) in enumerate(rounds, start=2):
                await PROBE_RUNS[probe](router.url, args)
                await asyncio.sleep(args.settle)
                snap = await _snapshot(router, folder, n)
                diff = snap.compare_to(base, "traceback")
                grown = sum(d.size_diff for d in diff)
                places: dict[str, list[int]] = {}
                for d in diff:  # tracebacks that differ above the same lines, counted as one place
                    place = places.setdefault(_where(d), [0, 0])
                    place[0] += d.size_diff
                    place[1] += d.count_diff
                top = [
                    {"where": where, "kib": size / 1024, "blocks": count}
                    for where, (size, count) in sorted(places.items(), key=lambda item: -item[1][0])[:8]
                    if size > 0
                ]
                rows.append({"round": round_, "probe": probe, "python_alive_mib": grown / MIB, "top": top})
                if not args.quiet:
                    print(f"traced round {round_} {probe}: {grown / MIB:+.2f} MiB of Python objects alive", flush=True)
    return {"probes": rows}
