"""Scenario: a conversation's tokenize stage, turn by turn.

An agent or a chat sends its whole history again every turn. Each conversation here is a loop of chat
completions through one dpd-router: every turn adds the previous answer and a new user message of
`--turn-tokens` tokens (distinct text in every message and every conversation), so turn N's prompt holds N
turns. The router's tokenize stage of each turn is read from its own `dpd_router_tokenize_seconds` histogram
(the growth of its sum over that one request), the median over the conversations.

- `pieces` (the default, `tokenize_piece_cache_chars` 8M): the pieces between the chat template's markers
  are kept with their encodings, so a turn encodes its new messages only;
- `no-pieces` (`tokenize_piece_cache_chars: 0`): every turn encodes as much of the whole history as its plan
  reads (a cache-aware threshold reads past the prefix cached on the decoder, the whole history).

One prefiller and two decoders, simulated; a byte-level BPE tokenizer (the simulator's) with its chat template.

    python -m benchmarks.conversation          # about two minutes here
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmarks import report, stack
from benchmarks.workload import PromptFactory
from dpd_sim.tokenizer_kit import ensure_tokenizer

NAME = "conversation"
SETUPS: dict[str, dict[str, object]] = {"pieces": {}, "no-pieces": {"tokenize_piece_cache_chars": 0}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.conversation", description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=5, help="conversations, one after another")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=650, help="each new user message (about 500 words)")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--threshold", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.conversations, args.turns, args.turn_tokens, args.output_tokens, args.threshold = 1, 3, 200, 4, 256
    return args


async def tokenize_seconds(client: httpx.AsyncClient) -> float:
    """The sum of the router's tokenize-stage histogram."""
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("dpd_router_tokenize_seconds_sum"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("the router's /metrics has no dpd_router_tokenize_seconds_sum")


async def conversation(
    client: httpx.AsyncClient, factory: PromptFactory, args: argparse.Namespace, key: str
) -> list[dict[str, Any]]:
    rows = []
    messages: list[dict[str, str]] = []
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": factory.text(args.turn_tokens, f"{key}-turn{turn}")})
        before = await tokenize_seconds(client)
        started = time.perf_counter()
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": stack.MODEL, "messages": messages, "max_tokens": args.output_tokens},
        )
        seconds = time.perf_counter() - started
        if answer.status_code != 200:
            raise RuntimeError(f"{key} turn {turn}: {answer.status_code} {answer.text[:300]}")
        body = answer.json()
        tokenize = await tokenize_seconds(client) - before
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or "ok"})
        rows.append(
            {"turn": turn, "prompt_tokens": body["usage"]["prompt_tokens"], "tokenize": tokenize, "e2e": seconds}
        )
    return rows


async def main(args: argparse.Namespace) -> dict[str, Any]:
    factory = PromptFactory(ensure_tokenizer())
    runs = []
    async with stack.engines(prefill=1, decode=2, timing="default") as cluster:
        for name, settings in SETUPS.items():
            router = stack.dpd_router(
                decode=cluster.decode_urls,
                prefill=cluster.prefill_urls,
                threshold=args.threshold,
                settings={**settings, "log_level": "warning"},
                name=name,
            )
            async with stack.running(router), httpx.AsyncClient(base_url=router.url, timeout=120) as client:
                run = uuid.uuid4().hex[:6]
                warm = argparse.Namespace(**{**vars(args), "turns": 2})
                await conversation(client, factory, warm, f"{name}-{run}-warm-up")  # templates compiled, pools open
                rows = []
                for index in range(args.conversations):
                    for row in await conversation(client, factory, args, f"{name}-{run}-c{index}"):
                        rows.append({**row, "conversation": index})
            runs.append({"setup": name, "turns": rows})
            if not args.quiet:
                print(f"{name}: {len(rows)} turns", file=sys.stderr)
    return {"runs": runs}


def by_turn(run: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for turn in range(1, args.turns + 1):
        rows = [row for row in run["turns"] if row["turn"] == turn]
        out.append(
            {
                "turn": turn,
                "prompt_tokens": statistics.median(row["prompt_tokens"] for row in rows),
                "tokenize_p50": statistics.median(row["tokenize"] for row in rows),
                "e2e_p50": statistics.median(row["e2e"] for row in rows),
            }
        )
    return out


def write_report(results: dict[str, Any], args: argparse.Namespace) -> str:
    summary = results["by_turn"]
    pieces, whole = summary["pieces"], summary["no-pieces"]
    rows = []
    for turn in range(args.turns):
        a, b = pieces[turn], whole[turn]
        rows.append(
            [
                a["turn"],
                f"{int(a['prompt_tokens']):,}",
                report.ms(a["tokenize_p50"], 2),
                f"{a['tokenize_p50'] / pieces[0]['tokenize_p50']:.2f}x",
                report.ms(b["tokenize_p50"], 2),
                f"{b['tokenize_p50'] / whole[0]['tokenize_p50']:.2f}x",
            ]
        )
    lines = [
        "# Scenario: a conversation's tokenize stage, turn by turn",
        "",
        f"{args.conversations} conversations one after another, {args.turns} turns each: every turn adds the answer"
        f" and a new user message of {args.turn_tokens} tokens; {args.output_tokens} output tokens a turn."
        f" Routing threshold {args.threshold} (cache-aware); 1 prefiller, 2 decoders (simulated). The tokenize"
        " stage is the router's own histogram's (wall time of reading the prompt, rendering included), the"
        " median over the conversations.",
        "",
        report.table(
            [
                "turn",
                "prompt tokens",
                "tokenize ms, pieces kept",
                "vs turn 1",
                "tokenize ms, no pieces",
                "vs turn 1",
            ],
            rows,
        ),
        "",
    ]
    text = "\n".join(lines)
    (args.out / "results.md").write_text(text)
    return text


def cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = stack.run_async(main(args))
    results["by_turn"] = {run["setup"]: by_turn(run, args) for run in results["runs"]}
    report.finish(results, args, started=started, plot=lambda: [], write=lambda: write_report(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
