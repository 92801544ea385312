"""Scenario 6: A/B threshold arms, and does `dpd-router advise` pick the winner two static runs pick?

A. One router, two experiment arms over the same engines: `t2048` (routing_threshold 2048) and `t8192`
   (8192), half the traffic each, sticky by session: every request carries a session id in the router's
   session header (`session_header`, default `x-session-id`), a session being a few requests of one user.
   The scaled seed mix goes through it at a fixed concurrency for a bounded run. The router's /metrics is
   saved before the run, at checkpoints during it and after it, and `dpd-router advise --file SCRAPE
   --since BEFORE --hours H --json` reads each: per prompt-length class and metric (TTFT p50/p95, ITL p99,
   E2E p95) the arm that wins, or "undecided" / "not enough data" with the traffic still needed.
B. Two static runs of the same workload (the same prompt lengths, new prompt text, half the A/B run's
   requests each, so each matches an arm's share): one router at 2048, one at 8192. The load generator's
   own client-side numbers per class, with a bootstrap interval of their difference (requests resampled):
   the static winner per class and metric, or "tie" when the interval holds 0.
C. Per class and metric, advise's answer at the end of A beside the static winner.

The arms share one decoder, so a stall that one arm's direct long prompts put on the decoder hits both
arms' streams alike: A measures what a threshold does to a request's own latency (its path), the static
runs that and what it does to everyone else's. Where only the latter differs, the arms look alike and
advise rightly says so; the static runs are the reference for that part.

One 1 prefill + 1 decode simulated cluster (`--timing realistic`) serves all three runs, one after the
other; prompts never repeat, so no prefix cache carries over.

    python -m benchmarks.arms          # about 12 minutes here (bounded: 240 s + 2 x 120 s of traffic)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks import loadgen, report, stack
from benchmarks.workload import FINANCE_MIX_SCALED, PromptFactory, Workload
from dpd_router.advise.bootstrap import interval
from dpd_router.config import Settings
from dpd_sim.tokenizer_kit import ensure_tokenizer

NAME = "arms"
METRICS = (  # advise's metrics: (name, what, quantile)
    ("ttft_p50", "ttft", 50.0),
    ("ttft_p95", "ttft", 95.0),
    ("itl_p99", "itl", 99.0),
    ("e2e_p95", "e2e", 95.0),
)
SESSION_HEADER = str(Settings.model_fields["session_header"].default)
LINE = 2048  # advise always cuts its classes here (the playbook's long prompts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.arms", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default=FINANCE_MIX_SCALED)
    parser.add_argument("--thresholds", type=int, nargs=2, default=[2048, 8192], help="the two arms' thresholds")
    parser.add_argument(
        "--classes", default="2048,8192",
        help="advise's --classes (prompt-length class bounds); the client-side numbers use the same classes",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=480, help="requests of the A/B run (each static run: half)")
    parser.add_argument("--session-requests", type=int, default=4, help="requests per session (user)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ramp", type=float, default=5.0, help="seconds over which the workers start")
    parser.add_argument(
        "--checkpoints", type=float, nargs="*", default=[0.25, 0.5],
        help="shares of the A/B run's requests after which its metrics are saved and advised on (besides the end)",
    )  # fmt: skip
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (advise's and ours)")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--timing", default="realistic")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="bound of the A/B run (static runs: half)")
    parser.add_argument("--out", type=Path, default=report.RESULTS / NAME)
    parser.add_argument("--render", action="store_true", help="rewrite results.md and plots from results.json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workload = "short:0.5:U(32,200)/(8,8),long:0.5:U(600,1200)/(8,8)"
        args.thresholds, args.classes, args.requests, args.concurrency = [256, 4096], "256", 16, 4
        args.session_requests, args.ramp, args.checkpoints, args.resamples = 2, 0.2, [0.5], 100
        args.timing, args.max_seconds = "default", 30.0
    args.class_bounds = sorted({int(b) for b in args.classes.split(",") if b.strip()} | {LINE})
    return args


def arm_name(threshold: int) -> str:
    return f"t{threshold}"


def class_spans(bounds: Sequence[int]) -> list[tuple[str, int, int | None]]:
    """advise's prompt-length classes: (span, lower, upper), prompts of more than `lower` tokens, at most `upper`."""
    lowers, uppers = [0, *bounds], [*bounds, None]
    return [
        (f">{lo}" if up is None else (f"{lo + 1}-{up}" if lo else f"1-{up}"), lo, up)
        for lo, up in zip(lowers, uppers, strict=True)
    ]


def span_of(tokens: int, spans: Sequence[tuple[str, int, int | None]]) -> str:
    return next(span for span, lo, up in spans if tokens > lo and (up is None or tokens <= up))


def build_requests(args: argparse.Namespace, factory: PromptFactory, count: int, prompt_seed: int) -> list[Any]:
    """The seed mix's first `count` lengths (the same draw for every run), new prompt text per `prompt_seed`,
    and a session id per request: consecutive requests belong to different sessions, as users interleave."""
    requests = loadgen.build_requests(
        Workload.parse(args.workload), count, factory, seed=7, prompt_seed=prompt_seed
    )  # fmt: skip
    sessions = max(count // args.session_requests, 1)
    for request in requests:
        request.headers = {SESSION_HEADER: f"user-{prompt_seed}-{request.index % sessions}"}
    return requests


async def save_scrape(url: str, path: Path) -> Path:
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(url + "/metrics")
    response.raise_for_status()
    await asyncio.to_thread(path.write_text, response.text)
    return path


async def advise(args: argparse.Namespace, *extra: str) -> tuple[int, str, str]:
    """`dpd-router advise` as a subprocess, as an operator runs it."""
    argv = [sys.executable, "-m", "dpd_router.cli", "advise", "--classes", ",".join(map(str, args.class_bounds))]
    argv += ["--resamples", str(args.resamples), "--confidence", str(args.confidence), *extra]
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=stack.ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode or 0, out.decode(), err.decode()


async def arms_run(args: argparse.Namespace, cluster: Any, factory: PromptFactory) -> dict[str, Any]:
    """A: one router, the two arms; advise on its scrapes at each checkpoint and at the end."""
    (p,), (d,) = cluster.prefill_urls, cluster.decode_urls
    share = 1.0 / len(args.thresholds)
    arms = [{"name": arm_name(t), "share": share, "routing_threshold": t} for t in args.thresholds]
    router = stack.dpd_router(
        decode=[d], prefill=[p], threshold=args.thresholds[0], name="arms",
        settings={"threshold_mode": "static", "experiments": json.dumps({"sticky_by": "session", "arms": arms})},
    )  # fmt: skip
    requests = build_requests(args, factory, args.requests, prompt_seed=1)
    marks = sorted({max(1, round(c * len(requests))) for c in args.checkpoints if 0 < c < 1})
    scrapes_dir = args.out / "scrapes"
    scrapes_dir.mkdir(parents=True, exist_ok=True)
    done = 0
    reached = {mark: asyncio.Event() for mark in marks}

    def on_record(_record: loadgen.Record) -> None:
        nonlocal done
        done += 1
        for mark, event in reached.items():
            if done >= mark:
                event.set()

    checkpoints: list[dict[str, Any]] = []
    async with stack.running(router):
        before = await save_scrape(router.url, scrapes_dir / "before.prom")
        t0 = time.monotonic()

        async def checkpoint(mark: int) -> None:
            await reached[mark].wait()
            path = await save_scrape(router.url, scrapes_dir / f"at-{mark}.prom")
            checkpoints.append({"requests_done": mark, "scrape": path, "hours": (time.monotonic() - t0) / 3600})

        watchers = [asyncio.create_task(checkpoint(mark)) for mark in marks]
        result = await loadgen.run(
            [router.url], requests, concurrency=args.concurrency, duration=args.max_seconds, ramp=args.ramp,
            label="A/B arms", progress=not args.quiet, on_record=on_record,
        )  # fmt: skip
        checkpoints.sort(key=lambda point: point["requests_done"])
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await settle(router.url)
        after = await save_scrape(router.url, scrapes_dir / "after.prom")
        checkpoints.append(
            {"requests_done": len(result.records), "scrape": after, "hours": (time.monotonic() - t0) / 3600}
        )
        arm_requests = await requests_by_arm(router.url)
    for point in checkpoints:
        code, out, err = await advise(
            args, "--file", str(point["scrape"]), "--since", str(before), "--hours", f"{point['hours']:.6f}", "--json"
        )
        if code != 0:
            raise RuntimeError(f"advise failed ({code}): {err[-2000:]}")
        full = json.loads(out)
        point["arms"], point["promotion"], point["verdict"] = full["arms"], full["promotion"], full["verdict"]
        if point is not checkpoints[-1]:
            await asyncio.to_thread(Path(point["scrape"]).unlink)  # before and after stay, to advise on again
        point["scrape"] = Path(point["scrape"]).name
    final = checkpoints[-1]
    plot_args = ["--plot", str(args.out / "advise.png")] if report.plotting() is not None else []
    code, text, err = await advise(
        args, "--file", str(after), "--since", str(before), "--hours", f"{final['hours']:.6f}", *plot_args
    )
    if code != 0:
        raise RuntimeError(f"advise failed ({code}): {err[-2000:]}")
    (args.out / "advise.md").write_text(advise_page(text, final["hours"], args))
    return {
        "arms": arms,
        "arm_requests": arm_requests,
        "summary": report.summarize_run(result),
        "checkpoints": checkpoints,
        "advise_plot": "advise.png" if plot_args else None,
    }


def advise_page(text: str, hours: float, args: argparse.Namespace) -> str:
    """advise's text report on the whole A/B run, as a page beside results.md."""
    command = (
        f"dpd-router advise --file scrapes/after.prom --since scrapes/before.prom --hours {hours:.6f} "
        f"--classes {','.join(map(str, args.class_bounds))} --resamples {args.resamples} --confidence {args.confidence}"
    )
    return f"# dpd-router advise on the A/B run\n\n`{command}`\n\n```text\n{text.rstrip()}\n```\n"


async def settle(url: str, within: float = 30.0) -> None:
    """Wait until the router has recorded every request (a client can see [DONE] before it does)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and await gauge(url, "dpd_router_in_flight_requests") > 0:  # noqa: ASYNC110 - polling the router over HTTP
        await asyncio.sleep(0.1)


async def gauge(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(url + "/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def requests_by_arm(url: str) -> dict[str, int]:
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(url + "/metrics")).text
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "dpd_router_requests_total" and s.value:
                counts[s.labels["arm"]] = counts.get(s.labels["arm"], 0) + int(s.value)
    return counts


async def static_runs(args: argparse.Namespace, cluster: Any, factory: PromptFactory) -> list[dict[str, Any]]:
    """B: the same workload through one router per threshold, half the A/B run's requests each."""
    (p,), (d,) = cluster.prefill_urls, cluster.decode_urls
    runs = []
    for index, threshold in enumerate(args.thresholds):
        router = stack.dpd_router(
            decode=[d], prefill=[p], threshold=threshold, settings={"threshold_mode": "static"}, name="static"
        )
        requests = build_requests(args, factory, max(args.requests // 2, 1), prompt_seed=2 + index)
        async with stack.running(router):
            before = await stack.route_decisions(router.url)
            result = await loadgen.run(
                [router.url], requests, concurrency=args.concurrency, duration=args.max_seconds / 2, ramp=args.ramp,
                label=f"static {threshold}", progress=not args.quiet,
            )  # fmt: skip
            decisions = stack.decisions_delta(before, await stack.route_decisions(router.url))
        runs.append(
            {"threshold": threshold, "arm": arm_name(threshold), "decisions": decisions}
            | {"summary": report.summarize_run(result), "records": [r.as_dict() for r in result.records]}
        )
    return runs


def client_values(records: Sequence[dict[str, Any]], what: str) -> list[list[float]]:
    """Per request, its observations of `what` (one TTFT or E2E; every inter-token gap)."""
    ok = [r for r in records if r["error"] is None and r["ttft"] is not None and r["e2e"] is not None]
    if what == "itl":
        return [r["gaps"] for r in ok if r["gaps"]]
    return [[r[what]] for r in ok]


def quantile_of(groups: Sequence[Sequence[float]], q: float) -> float | None:
    return report.percentile([v for g in groups for v in g], q)


def static_winner(
    runs: Sequence[dict[str, Any]], span: str, spans: Sequence[tuple[str, int, int | None]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Per metric, the static runs' client-side values in one class, and the winner: the lower one, when the
    bootstrap interval of the difference (requests resampled within each run) lies above 0; else a tie."""
    rows = []
    for metric, what, q in METRICS:
        groups = {}
        for run in runs:
            records = [r for r in run["records"] if span_of(r["tokens_in"] or r["prompt_tokens"], spans) == span]
            groups[run["arm"]] = client_values(records, what)
        values = {arm: quantile_of(g, q) for arm, g in groups.items()}
        row: dict[str, Any] = {"class": span, "metric": metric, "values": values, "requests": {}}
        row["requests"] = {arm: len(g) for arm, g in groups.items()}
        if any(v is None for v in values.values()):
            row |= {"winner": None, "status": "no data", "low": None, "high": None}
            rows.append(row)
            continue
        ranked = sorted(values, key=lambda arm: values[arm] or 0.0)
        best, other = ranked[0], ranked[1]
        rng = random.Random(f"{span}/{metric}")
        differences = []
        for _ in range(args.resamples):
            resampled = {arm: [rng.choice(groups[arm]) for _ in groups[arm]] for arm in (best, other)}
            a, b = quantile_of(resampled[best], q), quantile_of(resampled[other], q)
            if a is not None and b is not None:
                differences.append(b - a)
        low, high = interval(differences, args.confidence)
        clear = low is not None and low > 0
        row |= {"winner": best if clear else None, "status": "winner" if clear else "tie", "low": low, "high": high}
        row["difference"] = (values[other] or 0.0) - (values[best] or 0.0)
        rows.append(row)
    return rows


def agreement(advised: dict[str, Any] | None, static: dict[str, Any]) -> str:
    """advise's answer set against the static runs'."""
    if advised is None:
        return "advise: no data"
    status = advised["status"]
    if static["status"] == "no data":
        return "static: no data"
    if status == "winner":
        if static["winner"] == advised["winner"]:
            return "same winner"
        return "static: a tie" if static["winner"] is None else "different winner"
    said = "not enough data" if status == "not_enough_data" else "undecided"
    if advised["best_value"] is not None and advised["runner_up_value"] is not None:
        said += f", leaning {advised['best']}"
    if static["winner"] is None:
        return f"agree: no clear winner (advise {said})"
    return f"advise {said}; static: {static['winner']}"


def compare(results: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    spans = class_spans(args.class_bounds)
    final = results["ab"]["checkpoints"][-1]
    advised = {(c["request_class"], c["metric"]): c for c in final["arms"]["comparisons"]}
    rows = []
    for span, _, _ in spans:
        for static in static_winner(results["static"], span, spans, args):
            found = advised.get((span, static["metric"]))
            if found is None and static["status"] == "no data":
                continue  # no prompt of the workload in this class
            rows.append({"static": static, "advise": found, "agreement": agreement(found, static)})
    return rows


def advise_cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    if c["status"] == "winner":
        return f"**{c['winner']}** ({report.ms(c['best_value'])} vs {report.ms(c['runner_up_value'])})"
    more = "" if c["traffic_factor"] is None else f", needs ~{c['traffic_factor']:.1f}x the traffic"
    said = "not enough data" if c["status"] == "not_enough_data" else "undecided"
    values = f" ({c['best']} {report.ms(c['best_value'])} vs {c['runner_up']} {report.ms(c['runner_up_value'])})"
    return said + (values if c["best_value"] is not None and c["runner_up_value"] is not None else "") + more


def static_cell(s: dict[str, Any]) -> str:
    values = " vs ".join(f"{arm} {report.ms(v)}" for arm, v in s["values"].items())
    if s["status"] == "no data":
        return "no data"
    interval_text = f"diff {report.ms(s['difference'])} [{report.ms(s['low'])}, {report.ms(s['high'])}]"
    head = f"**{s['winner']}**" if s["winner"] else "tie"
    return f"{head} ({values}; {interval_text})"


def write(results: dict[str, Any], args: argparse.Namespace) -> str:
    ab, static = results["ab"], results["static"]
    names = " and ".join(f"`{arm_name(t)}` (threshold {t})" for t in args.thresholds)
    md = [f"# Scenario 6: A/B threshold arms ({results['env']['when']}, {results['env']['commit']})", ""]
    md += [
        f"1 prefill + 1 decode simulated engine, `--timing {args.timing}`; workload `{args.workload}`, "
        f"concurrency {args.concurrency}. A/B: one router, arms {names}, "
        f"{1 / len(args.thresholds):.0%} each by session (`{SESSION_HEADER}`, {args.session_requests} requests a "
        f"session), {args.requests} requests; static: one router per threshold, {args.requests // 2} requests "
        f"each (the same lengths). Classes: `--classes {args.classes}` (prompt tokens as the router counts "
        f"them); {args.confidence:.0%} bootstrap intervals, {args.resamples} resamples.",
        "",
        "## Runs",
        "",
    ]
    rows = []
    for label, summary, extra in [
        ("A/B", ab["summary"], f"by arm: {ab['arm_requests']}"),
        *((f"static {run['threshold']}", run["summary"], f"{run['decisions']}") for run in static),
    ]:
        s = summary["all"]
        rows.append([label, s["requests"], s["errors"], f"{s['wall_s']:.0f}", report.ms(s["ttft"]["p99"]), extra])
    md += [
        report.table(["run", "requests", "errors", "wall s", "TTFT p99 ms", "requests by arm / route decisions"], rows),
        "",
        "Runs are bounded in time: the A/B run stops sending at `--max-seconds`, a static run at half of it.",
        "",
    ]
    md += ["## advise on the A/B run, as the traffic grows", ""]
    rows = []
    for point in ab["checkpoints"]:
        comparisons = point["arms"]["comparisons"]
        count = {k: sum(1 for c in comparisons if c["status"] == k) for k in ("winner", "undecided", "not_enough_data")}
        wins = ", ".join(f"{c['metric']} {c['request_class']}: {c['winner']}" for c in comparisons if c["winner"])
        rows.append(
            [
                point["requests_done"],
                f"{point['hours'] * 60:.1f}",
                count["winner"],
                count["undecided"],
                count["not_enough_data"],
                wins or "-",
                point["verdict"]["decision"],
                point["promotion"]["status"],
            ]
        )
    md += [
        report.table(
            [
                "requests done",
                "minutes",
                "winners",
                "undecided",
                "not enough data",
                "which",
                "verdict",
                "promotion",
            ],
            rows,
        ),
        "",
        "## advise (end of the A/B run) against the static runs (client-side)",
        "",
    ]
    rows = [
        [
            r["static"]["class"],
            r["static"]["metric"],
            advise_cell(r["advise"]),
            static_cell(r["static"]),
            r["agreement"],
        ]
        for r in results["comparison"]
    ]
    md += [report.table(["class", "metric", "advise (A/B arms)", "static runs", "agreement"], rows), ""]
    tally: dict[str, int] = {}
    for r in results["comparison"]:
        tally[r["agreement"]] = tally.get(r["agreement"], 0) + 1
    md += ["Agreement: " + "; ".join(f"{k}: {v}" for k, v in sorted(tally.items())), ""]
    final = ab["checkpoints"][-1]
    md += [
        "advise's own words at the end (winner per class; promotion check; verdict):",
        "",
        *[f"- {c['note']}" for c in final["arms"]["comparisons"]],
        f"- promotion: {final['promotion']['summary']}",
        f"- verdict: {final['verdict']['summary']}",
        "",
        "The whole advise report: [advise.md](advise.md).",
        "",
    ]
    md += [f"![{name}]({name})" for name in results.get("plots", [])]
    text = "\n".join(md) + "\n"
    (args.out / "results.md").write_text(text)
    return text


def plot(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    plt = report.plotting()
    if plt is None:
        return []
    written = [results["ab"]["advise_plot"]] if results["ab"].get("advise_plot") else []
    rows = results["comparison"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, metric in zip(axes, ("ttft_p95", "itl_p99"), strict=True):
        chosen = [r for r in rows if r["static"]["metric"] == metric]
        classes = [r["static"]["class"] for r in chosen]
        series: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = []
        for threshold in args.thresholds:
            arm = arm_name(threshold)
            series.append(
                (f"A/B arm {arm} (router)", lambda r, arm=arm, metric=metric: arm_value(r, arm, metric, results))
            )
            series.append((f"static {threshold} (client)", lambda r, arm=arm: r["static"]["values"].get(arm)))
        width = 0.8 / len(series)
        for k, (label, value) in enumerate(series):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(chosen))]
            ax.bar(xs, [(value(r) or 0.0) * 1000 for r in chosen], width, label=label)
        ax.set_xticks(range(len(chosen)), classes)
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"{metric.replace('_', ' ').upper()} (ms)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = args.out / "arms.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [*written, path.name]


def arm_value(row: dict[str, Any], arm: str, metric: str, results: dict[str, Any]) -> float | None:
    """advise's estimate of an arm's metric in the row's class (its whole traffic there, all paths)."""
    span = row["static"]["class"]
    stats = [
        s for s in results["ab"]["checkpoints"][-1]["arms"]["stats"] if s["arm"] == arm and s["request_class"] == span
    ]
    whole = [s for s in stats if s["path"] == "all"] or stats
    if len(whole) != 1:
        return None
    value: float | None = whole[0]["metrics"][metric]["value"]
    return value


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    factory = PromptFactory(ensure_tokenizer())
    results: dict[str, Any] = {}
    extra = ["--max-model-len", "40000"]
    async with stack.engines(prefill=1, decode=1, timing=args.timing, extra_args=extra) as cluster:
        results["ab"] = await arms_run(args, cluster, factory)
        results["static"] = await static_runs(args, cluster, factory)
    results["comparison"] = compare(results, args)
    for run in results["static"]:
        run.pop("records")  # the summaries stay; every gap of every request would swell results.json
    report.finish(results, args, started=started, plot=lambda: plot(results, args), write=lambda: write(results, args))
    return results


def render(args: argparse.Namespace) -> None:
    """results.md and the plots again from results.json (the run's own arguments)."""
    results = json.loads((args.out / "results.json").read_text())
    for key, value in results["args"].items():
        if key not in ("out", "render"):
            setattr(args, key, value)
    for row in results["comparison"]:
        row["agreement"] = agreement(row["advise"], row["static"])
    results["plots"] = plot(results, args)
    report.write_json(args.out / "results.json", results)
    print(write(results, args))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        render(args)
        return 0
    stack.run_async(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
