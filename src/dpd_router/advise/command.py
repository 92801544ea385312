"""`dpd-router advise` on the command line: its arguments, and the run that prints the report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from dpd_router.advise.analysis import analyse
from dpd_router.advise.collect import collect, observed_hours
from dpd_router.advise.plot import PLOT_INSTALL_HINT, matplotlib_available, plot
from dpd_router.advise.render import render_text
from dpd_router.advise.report import (
    DEFAULT_CANDIDATES,
    DEFAULT_CLASSES,
    DEFAULT_CONFIDENCE,
    DEFAULT_DECODE_RATE,
    DEFAULT_ITL_SLO,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_PREFILL_RATE,
    DEFAULT_RESAMPLES,
    DEFAULT_TOLERANCE,
    STATISTICS,
    Options,
)
from dpd_router.advise.scrape import AdviseError, Scrape
from dpd_router.record.metrics import PROMPT_LENGTH_BOUNDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Read a dpd-router's own metrics (live or saved) and print the evidence for tuning it: the prompt-token "
        "distribution, the share of traffic above candidate thresholds, TTFT per path by prompt length, a "
        "recommended routing_threshold (where the disaggregated path's TTFT stops losing to the direct path's) "
        "and a prefill:decode ratio; then the arms (A/B experiment arms, the shadow) side by side with bootstrap "
        "intervals and the winner per prompt-length class, the playbook's promotion check, and the go/no-go verdict."
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
        "--model",
        metavar="NAME",
        help="advise on one served model's requests (a router serving several labels them by `model`)",
    )
    parser.add_argument(
        "--compare-models",
        metavar="A,B",
        help="compare served models side by side as the arms are (the versions behind a model alias): their "
        "latencies by prompt-length class, which is better and how sure; the verdict reads them together",
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
    arms = parser.add_argument_group(
        "arms, promotion check and verdict (experiment arms and the shadow, from the metrics' arm label)"
    )
    arms.add_argument(
        "--classes",
        type=_int_list,
        default=DEFAULT_CLASSES,
        metavar="N,N,...",
        help="upper bounds of the prompt-length classes the arms are compared in, from the prompt-length buckets "
        f"({', '.join(map(str, PROMPT_LENGTH_BOUNDS))}); 2048 is always one (default 2048: up to 2048, and over)",
    )
    arms.add_argument(
        "--itl-slo",
        type=float,
        default=DEFAULT_ITL_SLO,
        metavar="SECONDS",
        help=f"the inter-token latency SLO: a gap above it is a miss (default {DEFAULT_ITL_SLO:g})",
    )
    arms.add_argument(
        "--hours",
        type=float,
        metavar="H",
        help="the hours of traffic the scrape holds, for the hours still needed to decide between arms (default: "
        "from --window, or the times of the --since and later scrapes; otherwise given as multiples of the traffic)",
    )
    arms.add_argument(
        "--confidence",
        type=float,
        default=DEFAULT_CONFIDENCE,
        help=f"the bootstrap intervals' confidence level (default {DEFAULT_CONFIDENCE:g})",
    )
    arms.add_argument(
        "--resamples",
        type=int,
        default=DEFAULT_RESAMPLES,
        help=f"bootstrap resamples per estimate (default {DEFAULT_RESAMPLES})",
    )
    arms.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0: the same numbers each run)")
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


def _arms_problem(args: argparse.Namespace) -> str | None:
    odd = [bound for bound in args.classes if bound not in PROMPT_LENGTH_BOUNDS]
    if odd:
        return (
            f"--classes takes prompt-length bucket bounds ({', '.join(map(str, PROMPT_LENGTH_BOUNDS))}), not "
            f"{', '.join(map(str, odd))}"
        )
    if args.itl_slo <= 0 or not 0 < args.confidence < 1 or args.resamples < 10:
        return "--itl-slo must be > 0, --confidence between 0 and 1, --resamples >= 10"
    if args.hours is not None and args.hours <= 0:
        return "--hours must be > 0"
    return None


def _check_models(scrape: Scrape, models: list[str]) -> None:
    served = scrape.models()
    for model in models:
        if model not in served:
            raise AdviseError(
                f"no requests of model {model!r} in the scrape (its models: {', '.join(served) or 'none labelled'})"
            )


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
    if args.compare_models is not None and (args.model is not None or len(args.compare_models.split(",")) < 2):
        print("dpd-router advise: --compare-models names two or more models, A,B (and no --model)", file=sys.stderr)
        return 2
    problem = _arms_problem(args)
    if problem:
        print(f"dpd-router advise: {problem}", file=sys.stderr)
        return 2
    try:
        scrape, sources = asyncio.run(collect(args))
        if args.model is not None:
            _check_models(scrape, [args.model])
            scrape = scrape.model_only(args.model)
        if args.compare_models is not None:
            compared = [name.strip() for name in args.compare_models.split(",") if name.strip()]
            _check_models(scrape, compared)
            scrape = scrape.models_as_arms(compared)
        options = Options(
            min_requests=args.min_requests,
            tolerance=args.tolerance,
            statistic=args.statistic,
            candidates=args.candidates,
            prefill_rate=args.prefill_rate,
            decode_rate=args.decode_rate,
            itl_slo=args.itl_slo,
            classes=args.classes,
            resamples=args.resamples,
            confidence=args.confidence,
            seed=args.seed,
        )
        options.observed_hours, options.hours_basis = observed_hours(args)
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
