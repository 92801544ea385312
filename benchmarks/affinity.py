"""Scenario: conversation affinity for agent loops on the Responses API.

Each agent runs a loop of steps through dpd-router's `/v1/responses`: the first step sends a long context
(a system prompt, a task and its documents), every later step only what is new (a tool's output, a few
hundred tokens) with `previous_response_id`, so the router expands the stored history into the whole
conversation. Every step's prompt is far over the routing threshold.

- `affinity` (the defaults: `threshold_mode: cache_aware`, decoders chosen by prefix affinity): a
  follow-up goes to the decoder that served the previous step, which holds its KV; only the new tokens
  are uncached there, under the threshold, so it is served direct: no prefill hop, no KV transfer.
- `no-affinity` (`threshold_mode: static`): the whole prompt counts, so every step takes the prefiller
  and a KV transfer again, as a router that counts only the prompt's length does.

Per step: TTFT (to the first `response.output_text.delta`), which path it took and which decoder served
it (from the engines' own records of each request id), and the prefill hops and transfers it cost.

    python -m benchmarks.affinity            # about a minute here
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks import report, stack
from benchmarks.workload import PromptFactory
from dpd_sim.tokenizer_kit import ensure_tokenizer

NAME = "affinity"
SETUPS = {"affinity": {"threshold_mode": "cache_aware"}, "no-affinity": {"threshold_mode": "static"}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.affinity", description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=4, help="agent loops run side by side")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--context-tokens", type=int, default=6000, help="the first step's input")
    parser.add_argument("--step-tokens", type=int, default=300, help="what each later step adds")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threshold", type=int, default=4096)
    parser.add_argument("--decoders", type=int, default=2)
    parser.add_argument("--timing", default="realistic")
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.agents, args.steps, args.context_tokens, args.step_tokens = 2, 3, 600, 40
        args.output_tokens, args.threshold, args.timing = 8, 256, "default"
    return args


async def step(
    client: httpx.AsyncClient, body: dict[str, Any], request_id: str
) -> tuple[str, float | None, int | None]:
    """One streamed step: its response id, TTFT and prompt tokens (the engine's count)."""
    started = time.perf_counter()
    ttft = None
    response: dict[str, Any] = {}
    headers = {"X-Request-Id": request_id}
    async with client.stream("POST", "/v1/responses", json={**body, "stream": True}, headers=headers) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"step {request_id}: {answer.status_code} {(await answer.aread())[:300]!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = orjson.loads(line[6:])
            if ttft is None and event.get("type") == "response.output_text.delta":
                ttft = time.perf_counter() - started
            if event.get("type") in ("response.completed", "response.incomplete"):
                response = event["response"]
    if "id" not in response:
        raise RuntimeError(f"step {request_id}: the stream ended without its completed or incomplete event")
    usage = response.get("usage") or {}
    return str(response["id"]), ttft, usage.get("input_tokens")


async def agent(
    router: str, factory: PromptFactory, args: argparse.Namespace, index: int, run: str
) -> list[dict[str, Any]]:
    rows = []
    previous = None
    async with httpx.AsyncClient(base_url=router, timeout=120) as client:
        for number in range(1, args.steps + 1):
            if previous is None:
                given = factory.text(args.context_tokens, f"{run}-agent{index}-context")
            else:
                given = factory.text(args.step_tokens, f"{run}-agent{index}-tool{number}")
            body: dict[str, Any] = {"model": stack.MODEL, "input": given, "max_output_tokens": args.output_tokens}
            if previous is not None:
                body["previous_response_id"] = previous
            request_id = f"{run}-a{index}-s{number}-{uuid.uuid4().hex[:6]}"
            previous, ttft, prompt_tokens = await step(client, body, request_id)
            rows.append(
                {"agent": index, "step": number, "request_id": request_id, "ttft": ttft, "prompt": prompt_tokens}
            )
    return rows


async def where_served(cluster: Any, rows: list[dict[str, Any]]) -> None:
    """Each step's path and decoder, from what the engines recorded under its request id."""
    seen: dict[str, list[tuple[str, str]]] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for url in [*cluster.prefill_urls, *cluster.decode_urls]:
            stats = (await client.get(f"{url}/sim/stats")).json()
            for entry in stats["recent"]:
                seen.setdefault(entry["request_id"], []).append((url, entry["kind"]))
    for row in rows:
        kinds = seen.get(row["request_id"], [])
        row["prefilled"] = any(kind == "remote_prefill" for _, kind in kinds)
        row["path"] = "disaggregated" if row["prefilled"] else "direct"
        decoders = [url for url, kind in kinds if url in cluster.decode_urls]
        row["decoder"] = cluster.decode_urls.index(decoders[0]) if decoders else None


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = ensure_tokenizer()
    factory = PromptFactory(tokenizer)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as store:
        async with stack.engines(prefill=1, decode=args.decoders, timing=args.timing) as cluster:
            for name, settings in SETUPS.items():
                router = stack.dpd_router(
                    decode=cluster.decode_urls,
                    prefill=cluster.prefill_urls,
                    threshold=args.threshold,
                    settings={**settings, "log_level": "warning", "responses_store": f"{store}/{name}.sqlite3"},
                    name=name,
                )
                async with stack.running(router):
                    run = f"{name}-{uuid.uuid4().hex[:4]}"
                    loops = [agent(router.url, factory, args, index, run) for index in range(args.agents)]
                    rows = [row for rows in await asyncio.gather(*loops) for row in rows]
                    decisions = await stack.route_decisions(router.url)
                await where_served(cluster, rows)
                runs.append({"setup": name, "steps": rows, "decisions": decisions})
                if not args.quiet:
                    print(f"{name}: {len(rows)} steps", file=sys.stderr)
    return {"runs": runs}


def by_step(run: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for number in range(1, args.steps + 1):
        rows = [row for row in run["steps"] if row["step"] == number]
        ttfts = [row["ttft"] for row in rows if row["ttft"] is not None]
        first = [row for row in run["steps"] if row["step"] == 1]
        same = [row["decoder"] == next(f["decoder"] for f in first if f["agent"] == row["agent"]) for row in rows]
        out.append(
            {
                "step": number,
                "prompt_tokens": statistics.median(row["prompt"] for row in rows if row["prompt"] is not None),
                "ttft_p50": statistics.median(ttfts) if ttfts else None,
                "ttft_max": max(ttfts) if ttfts else None,
                "direct": sum(row["path"] == "direct" for row in rows),
                "prefilled": sum(row["prefilled"] for row in rows),
                "same_decoder": sum(same),
                "agents": len(rows),
            }
        )
    return out


def ratio(new: float | None, base: float | None) -> str:
    return "-" if new is None or not base else f"{new / base:.2f}x"


def write_report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# Scenario: conversation affinity for agent loops (Responses API, `previous_response_id`)",
        "",
        f"{args.agents} agents side by side, {args.steps} steps each: the first sends {args.context_tokens} tokens,"
        f" every later one {args.step_tokens} new tokens with `previous_response_id` (the router expands the"
        f" stored history); {args.output_tokens} output tokens a step, streamed. Routing threshold"
        f" {args.threshold} tokens; 1 prefiller, {args.decoders} decoders (simulated, `{args.timing}` timing).",
        "",
        "TTFT is to the first `response.output_text.delta`; *direct* and *prefill hops* count the agents whose",
        "step took each path (the engines' own records); *same decoder* counts those served by the decoder",
        "that served their first step.",
        "",
    ]
    summary = {run["setup"]: by_step(run, args) for run in results["runs"]}
    results["by_step"] = summary
    rows = []
    for number in range(args.steps):
        with_affinity, without = summary["affinity"][number], summary["no-affinity"][number]
        rows.append(
            [
                with_affinity["step"],
                int(with_affinity["prompt_tokens"]),
                report.ms(with_affinity["ttft_p50"]),
                report.ms(without["ttft_p50"]),
                ratio(with_affinity["ttft_p50"], without["ttft_p50"]),
                f"{with_affinity['direct']}/{with_affinity['agents']}",
                f"{with_affinity['prefilled']} / {without['prefilled']}",
                f"{with_affinity['same_decoder']}/{with_affinity['agents']}",
            ]
        )
    headers = [
        "step",
        "prompt tokens (p50)",
        "TTFT p50 ms, affinity",
        "TTFT p50 ms, no affinity",
        "affinity / none",
        "direct, affinity",
        "prefill hops: affinity / none",
        "same decoder, affinity",
    ]
    lines += [report.table(headers, rows), ""]
    later = [row for row in summary["affinity"][1:]]
    later_without = [row for row in summary["no-affinity"][1:]]
    ttft_with = statistics.fmean(row["ttft_p50"] for row in later if row["ttft_p50"] is not None) if later else None
    ttft_without = (
        statistics.fmean(row["ttft_p50"] for row in later_without if row["ttft_p50"] is not None)
        if later_without
        else None
    )
    lines += [
        f"Steps 2-{args.steps}: mean of the per-step TTFT p50 {report.ms(ttft_with)} ms with affinity, "
        f"{report.ms(ttft_without)} ms without; prefill hops {sum(row['prefilled'] for row in later)} with, "
        f"{sum(row['prefilled'] for row in later_without)} without.",
        "",
        "Route decisions (`dpd_router_route_decisions_total`, path/reason):",
        "",
    ]
    for run in results["runs"]:
        lines.append(f"- {run['setup']}: " + ", ".join(f"{k} {int(v)}" for k, v in sorted(run["decisions"].items())))
    lines += ["", f"Command: `python -m benchmarks.affinity` ({results['seconds']:.0f} s)."]
    text = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(text)
    return text


def cli(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = stack.run_async(main(args))
    results["seconds"] = time.monotonic() - started
    text = write_report(results, args)
    report.finish(results, args, started=started, plot=list, write=lambda: "" if args.quiet else text)


if __name__ == "__main__":
    cli()
