"""`dpd-router advise` on the command line: its arguments, and the run that prints the report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from dpd_router.advise.analysis import analyse
from dpd_router.advise.collect import collect
from dpd_router.advise.plot import PLOT_INSTALL_HINT, matplotlib_available, plot
from dpd_router.advise.render import render_text
from dpd_router.advise.report import (
    DEFAULT_CANDIDATES,
    DEFAULT_DECODE_RATE,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_PREFILL_RATE,
    DEFAULT_TOLERANCE,
    STATISTICS,
    Options,
)
from dpd_router.advise.scrape import AdviseError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Read a dpd-router's own metrics (live or saved) and print the evidence for tuning it: the prompt-token "
        "distribution, the share of traffic above candidate thresholds, TTFT per path by prompt length, a "
        "recommended routing_threshold (where the disaggregated path's TTFT stops losing to the direct path's) "
        "and a prefill:decode ratio."
    )
    parser.epilog = (
        "examples: dpd-router advise --metrics http://router:8000 ; "
        "dpd-router advise --metrics http://router:8000 --window 600 --plot ttft.png ; "
        "curl -s http://router:8000/metrics > t0.prom; (later) dpd-router advise --metrics http://router:8000 "
        "--since t0.prom --json"
    )
    source = parser.add_argument_group("where the metrics come from (one of)")
    source.add_argument(
        "--metrics",
        action="append",
        metavar="URL",
        help="a router's /metrics URL (or its base URL); repeat for several replicas, which are summed",
    )
    source.add_argument(
        "--file",
        action="append",
        metavar="FILE",
        help="a saved scrape (Prometheus text, e.g. `curl -s ROUTER/metrics > FILE`); repeat for several replicas",
    )
    parser.add_argument(
        "--since",
        action="append",
        metavar="FILE",
        help="an earlier scrape of the same router(s): advise on the traffic since then only (repeatable)",
    )
    parser.add_argument(
        "--window",
        type=float,
        metavar="SECONDS",
        help="with --metrics: scrape twice, SECONDS apart, and advise on the traffic in between",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=DEFAULT_MIN_REQUESTS,
        help="requests each path needs in a prompt-length bucket to count as evidence "
        f"(default {DEFAULT_MIN_REQUESTS})",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="the disaggregated path does not lose while its TTFT is within this fraction of the direct path's "
        f"(default {DEFAULT_TOLERANCE})",
    )
    parser.add_argument(
        "--statistic", choices=STATISTICS, default="mean", help="the TTFT statistic compared (default mean)"
    )
    parser.add_argument(
        "--candidates",
        type=_int_list,
        default=DEFAULT_CANDIDATES,
        metavar="N,N,...",
        help="candidate thresholds for the traffic-share table (default 512,1024,2048,4096,8192,16384,32768)",
    )
    parser.add_argument(
        "--prefill-rate",
        type=float,
        default=DEFAULT_PREFILL_RATE,
        metavar="TOKENS/S",
        help=f"prompt tokens/s one prefill engine sustains (default {DEFAULT_PREFILL_RATE:g}: 8B model, one H100)",
    )
    parser.add_argument(
        "--decode-rate",
        type=float,
        default=DEFAULT_DECODE_RATE,
        metavar="TOKENS/S",
        help=f"output tokens/s one decode engine sustains at your ITL target (default {DEFAULT_DECODE_RATE:g})",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each /metrics (default 10)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="FILE", help="also write a PNG chart (needs matplotlib: the bench extra)")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, e.g. 1024,2048,4096") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected positive integers")
    return values


def run(args: argparse.Namespace) -> int:
    """`dpd-router advise`: 0 on success, 1 when the metrics cannot be read, 2 on bad usage."""
    if args.plot and not matplotlib_available():
        print(
            f"dpd-router advise: --plot needs matplotlib, which is not installed: {PLOT_INSTALL_HINT}", file=sys.stderr
        )
        return 2
    if args.min_requests < 1 or args.tolerance < 0 or args.prefill_rate <= 0 or args.decode_rate <= 0:
        print("dpd-router advise: --min-requests must be >= 1, --tolerance >= 0, rates > 0", file=sys.stderr)
        return 2
    try:
        scrape, sources = asyncio.run(collect(args))
        options = Options(
            min_requests=args.min_requests,
            tolerance=args.tolerance,
            statistic=args.statistic,
            candidates=args.candidates,
            prefill_rate=args.prefill_rate,
            decode_rate=args.decode_rate,
        )
        report = analyse(scrape, options, sources)
    except AdviseError as exc:
        print(f"dpd-router advise: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_text(report), end="")
    if args.plot:
        plot(report, Path(args.plot))
        if not args.json:
            print(f"chart written to {args.plot}")
    return 0
