"""`dpd-router advise` on recorded scrapes (tests/unit/fixtures/*.prom, written by fixtures/generate.py)."""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpd_router.advise import bootstrap, command
from dpd_router.advise import ratio as pool_ratio
from dpd_router.advise.analysis import analyse
from dpd_router.advise.bootstrap import Bootstrap
from dpd_router.advise.collect import metrics_url
from dpd_router.advise.histogram import Histogram
from dpd_router.advise.render import render_text
from dpd_router.advise.report import Comparison, Options, Report
from dpd_router.advise.scrape import AdviseError, Scrape
from dpd_router.cli import main
from dpd_router.record.metrics import PROMPT_LENGTH_BOUNDS, RouterMetrics
from dpd_router.record.observe import Observer, Output, RequestTrace

FIXTURES = Path(__file__).parent / "fixtures"


@functools.cache
def _parsed(name: str) -> Scrape:
    return Scrape.parse((FIXTURES / name).read_text())


def scrape(name: str) -> Scrape:
    """A fixture scrape, parsed once; each call gets its own copy to change."""
    parsed = _parsed(name)
    return Scrape(dict(parsed.cumulative), {key: list(values) for key, values in parsed.gauges.items()})


def samples(name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families((FIXTURES / name).read_text()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def threshold_choices() -> set[int]:
    """Every threshold advise can recommend: a bucket bound (a bucket's lower edge is the previous bound)."""
    return set(PROMPT_LENGTH_BOUNDS) | {1}


# ------------------------------------------------------------------------------------------ the rule


def test_disaggregation_paying_above_2k_gives_2048() -> None:
    report = analyse(scrape("crossover_2k.prom"))
    rec = report.recommendation
    assert (rec.threshold, rec.verdict, rec.basis, rec.action) == (2048, "crossover", "measured", "lower")
    assert rec.current == 4096 and rec.crossover_bucket == "4096"
    by_label = {row.label: row for row in report.ttft}
    assert [by_label[b].faster for b in ("512", "1024", "2048")] == ["direct"] * 3
    assert [by_label[b].faster for b in ("4096", "8192", "16384", "32768")] == ["disaggregated"] * 4
    # Below 256 tokens only the direct path has traffic: no verdict there.
    for label in ("128", "256"):
        assert not by_label[label].comparable and by_label[label].note.startswith("not enough evidence")
    assert "Lower routing_threshold to 2048" in rec.summary


def test_direct_always_winning_says_keep_direct_and_raise() -> None:
    rec = analyse(scrape("direct_wins.prom")).recommendation
    assert (rec.verdict, rec.basis, rec.action) == ("keep_direct", "measured", "raise")
    assert rec.threshold == 32768, "at least the top of the longest bucket with evidence"
    assert "keep these prompts direct" in rec.summary and "raise the threshold to at least 32768" in rec.summary


def test_too_little_data_says_not_enough_evidence() -> None:
    report = analyse(scrape("sparse.prom"))
    rec = report.recommendation
    assert rec.threshold is None and rec.verdict == "not_enough_evidence" and rec.basis == "none"
    assert rec.summary.startswith("Not enough evidence") and "Keep the current threshold (4096)" in rec.summary
    assert all(not row.comparable and "not enough evidence" in row.note for row in report.ttft)
    assert report.ratio.at_recommended_threshold is None


def test_one_static_threshold_falls_back_to_extrapolation() -> None:
    rec = analyse(scrape("static_4096.prom")).recommendation
    assert (rec.threshold, rec.verdict, rec.basis) == (2048, "crossover", "extrapolated")
    assert rec.estimated_crossover_tokens is not None and 2048 / math.sqrt(2) < rec.estimated_crossover_tokens < 2896
    assert "extrapolated" in rec.summary and "moving the threshold" in rec.summary


def test_min_requests_and_statistic_are_options() -> None:
    strict = analyse(scrape("crossover_2k.prom"), Options(min_requests=10_000)).recommendation
    assert strict.threshold is None and strict.verdict == "not_enough_evidence"
    assert analyse(scrape("crossover_2k.prom"), Options(statistic="p50")).recommendation.threshold == 2048
    # A tolerance so wide that the disaggregated path never loses: it wins down to the lowest bucket with evidence.
    lenient = analyse(scrape("crossover_2k.prom"), Options(tolerance=10.0)).recommendation
    assert (lenient.verdict, lenient.threshold) == ("disaggregate_more", 256)
    with pytest.raises(AdviseError):
        analyse(scrape("crossover_2k.prom"), Options(statistic="max"))


@pytest.mark.parametrize("name", ["crossover_2k.prom", "direct_wins.prom", "static_4096.prom", "sparse.prom"])
def test_recommendation_is_a_bucket_bound_or_none(name: str) -> None:
    rec = analyse(scrape(name)).recommendation
    assert rec.threshold in threshold_choices() or (rec.threshold is None and rec.summary)


# ----------------------------------------------------------------------------------------- the evidence


@pytest.mark.parametrize("name", ["crossover_2k.prom", "direct_wins.prom", "static_4096.prom", "sparse.prom"])
def test_counts_add_up(name: str) -> None:
    raw = samples(name)
    report = analyse(scrape(name))
    for path in ("direct", "disaggregated"):
        requests = raw[("dpd_router_requests_total", (("outcome", "ok"), ("path", path)))]
        assert report.requests[path] == requests
        assert sum(getattr(row, path).requests for row in report.ttft) == requests
        assert report.prompt_tokens["by_path"][path]["requests"] == requests
        assert report.ttft_by_path[path].requests == requests
    assert report.prompt_tokens["requests"] == sum(report.requests.values())
    assert sum(d["requests"] for d in report.decisions) == sum(report.requests.values())


def test_ttft_rows_match_the_histogram() -> None:
    raw = samples("crossover_2k.prom")
    row = next(r for r in analyse(scrape("crossover_2k.prom")).ttft if r.label == "4096")
    labels = (("path", "disaggregated"), ("prompt_tokens", "4096"))
    count = raw[("dpd_router_ttft_by_prompt_length_seconds_count", labels)]
    total = raw[("dpd_router_ttft_by_prompt_length_seconds_sum", labels)]
    assert row.disaggregated.requests == count and row.disaggregated.mean == pytest.approx(total / count)
    assert (row.lower, row.upper, row.span) == (2048, 4096, "2049-4096")
    assert row.disaggregated.p50 is not None and row.disaggregated.p90 is not None
    assert row.disaggregated.p50 <= row.disaggregated.p90


def test_share_above_candidates_is_exact_at_bucket_bounds() -> None:
    raw = samples("crossover_2k.prom")
    report = analyse(scrape("crossover_2k.prom"))
    total = report.prompt_tokens["requests"]
    for row in report.shares:
        at_or_below = sum(
            raw[("dpd_router_prompt_tokens_bucket", (("le", f"{float(row['threshold'])}"), ("path", path)))]
            for path in ("direct", "disaggregated")
        )
        assert row["requests_above"] == total - at_or_below
        assert row["share_of_requests"] == pytest.approx((total - at_or_below) / total)
    assert [row["threshold"] for row in report.shares] == [512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert [row["current"] for row in report.shares].count(True) == 1
    token_shares = [row["share_of_prompt_tokens"] for row in report.shares]
    assert token_shares == sorted(token_shares, reverse=True) and 0 <= token_shares[-1] <= token_shares[0] <= 1


def test_histogram_estimates_follow_prometheus() -> None:
    hist = Histogram([1.0, 2.0, 4.0, math.inf], [1.0, 3.0, 4.0, 5.0], 10.0)
    assert hist.quantile(0.5) == (1.75, False)  # rank 2.5 inside (1, 2]: 1 + (2 - 1) * (2.5 - 1) / 2
    assert hist.quantile(0.1) == (0.5, False)  # the first bucket starts at 0
    assert hist.quantile(0.99) == (4.0, True)  # in +Inf: the highest finite bound, "at least"
    assert hist.count_above(2.0) == 2.0 and hist.count_above(3.0) == 1.5
    assert hist.mean == 2.0
    assert Histogram([math.inf], [0.0], 0.0).quantile(0.5) == (None, False)
    assert hist.sum_above(0.0) == pytest.approx(10.0) and 0 < hist.sum_above(100.0) < hist.sum_above(3.0) < 10
    assert Histogram([1.0, math.inf], [2.0, 2.0], 1.0).sum_above(5.0) == 0.0


def test_prompt_percentiles_are_ordered() -> None:
    percentiles = analyse(scrape("crossover_2k.prom")).prompt_tokens["percentiles"]
    values = [p["tokens"] for p in percentiles.values()]
    assert list(percentiles) == ["p50", "p75", "p90", "p95", "p99"]
    assert values == sorted(values) and values[0] >= 64 and values[-1] <= 32768


# -------------------------------------------------------------------------------------------- the ratio


def test_ratio_follows_the_token_counts() -> None:
    raw = samples("crossover_2k.prom")
    report = analyse(scrape("crossover_2k.prom"), Options(prefill_rate=10_000, decode_rate=2_000))
    ratio = report.ratio
    prefill_tokens = raw[("dpd_router_prompt_tokens_sum", (("path", "disaggregated"),))]
    direct_tokens = raw[("dpd_router_prompt_tokens_sum", (("path", "direct"),))]
    output = sum(raw[("dpd_router_output_tokens_sum", (("path", p),))] for p in ("direct", "disaggregated"))
    assert ratio.prefill_work == pytest.approx(prefill_tokens / 10_000)
    assert ratio.decode_work == pytest.approx(output / 2_000 + direct_tokens / 10_000)
    assert ratio.ratio == pytest.approx(ratio.prefill_work / ratio.decode_work)
    assert ratio.current == "2:2" and sum(ratio.split.values()) == 4
    assert ratio.load["prefill"].engines == 2 and ratio.load["decode"].waiting_per_engine == 0.0
    # Lowering the threshold to 2048 moves prompt tokens to the prefill pool: a larger prefill share.
    assert ratio.at_recommended_threshold["threshold"] == 2048
    assert ratio.at_recommended_threshold["ratio"] > ratio.ratio
    assert "--prefill-rate 10000" in ratio.heuristic


def test_simple_ratio_and_split() -> None:
    assert pool_ratio._simple_ratio(1.0) == "1:1"
    assert pool_ratio._simple_ratio(0.5) == "1:2"
    assert pool_ratio._simple_ratio(1.6) == "3:2"
    assert pool_ratio._simple_ratio(3.1) == "3:1"
    assert pool_ratio._simple_ratio(0.0) == "0:1"
    assert pool_ratio._split(1.0, 4) == {"prefill": 2, "decode": 2}
    assert pool_ratio._split(0.01, 4) == {"prefill": 1, "decode": 3}, "a pool keeps at least one engine"
    assert pool_ratio._split(0.0, 4) == {"prefill": 0, "decode": 4}


def _set_waiting(scrape: Scrape, role: str, waiting: float) -> None:
    for (name, labels), values in scrape.gauges.items():
        found = dict(labels)
        if name == "dpd_router_endpoint_load" and found["role"] == role and found["signal"] == "waiting":
            values[:] = [waiting]


def test_a_queueing_pool_gets_one_engine_more() -> None:
    calm = analyse(scrape("crossover_2k.prom")).ratio
    assert calm.split == {"prefill": 2, "decode": 2} and "neither pool is queueing" in calm.load_check
    queued = scrape("crossover_2k.prom")
    _set_waiting(queued, "decode", 5.0)
    _set_waiting(queued, "prefill", 0.0)
    ratio = analyse(queued).ratio
    assert ratio.split == {"prefill": 1, "decode": 3} and ratio.recommended == "1:3"
    assert "one engine moved to decode" in ratio.load_check
    # The static fixture's prefill pool queues, and the token counts already give it more engines.
    static = analyse(scrape("static_4096.prom")).ratio
    assert static.split["prefill"] > 2 and "already addresses" in static.load_check


# ---------------------------------------------------------------------------------------- combining scrapes


def test_since_advises_on_the_traffic_in_between() -> None:
    later, earlier = scrape("window_t1.prom"), scrape("window_t0.prom")
    whole = analyse(later)
    window = analyse(later.minus(earlier))
    assert sum(whole.requests.values()) == 4500 and sum(window.requests.values()) == 3000
    assert window.recommendation.threshold == 2048 and window.recommendation.verdict == "crossover"
    assert whole.recommendation.threshold != 2048, "the slow-hop period before the window skews the whole"


def test_scrapes_in_the_wrong_order_are_refused() -> None:
    with pytest.raises(AdviseError, match="went down between the scrapes"):
        scrape("window_t0.prom").minus(scrape("window_t1.prom"))


def test_several_routers_add_up() -> None:
    one = analyse(scrape("crossover_2k.prom"))
    two = analyse(scrape("crossover_2k.prom").plus(scrape("crossover_2k.prom")))
    assert two.requests == {path: 2 * n for path, n in one.requests.items()}
    assert two.recommendation.threshold == one.recommendation.threshold == 2048
    assert two.thresholds == [4096]
    # Both routers see the same engines: their load is averaged, their calls in flight add up.
    one_load, two_load = one.ratio.load["decode"], two.ratio.load["decode"]
    assert two_load.waiting_per_engine == one_load.waiting_per_engine
    assert two_load.router_in_flight_per_engine == 2 * one_load.router_in_flight_per_engine


def test_not_a_router_scrape() -> None:
    with pytest.raises(AdviseError):
        Scrape.parse("this is { not prometheus")
    assert Scrape.parse("# HELP up x\n# TYPE up gauge\nup 1\n").empty


def test_metrics_url() -> None:
    assert metrics_url("http://router:8000") == "http://router:8000/metrics"
    assert metrics_url("http://router:8000/") == "http://router:8000/metrics"
    assert metrics_url("router:8000") == "http://router:8000/metrics"
    assert metrics_url("https://r.example/custom/metrics") == "https://r.example/custom/metrics"


# ---------------------------------------------------------------------------------------- the command line


def test_cli_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--file", str(FIXTURES / "crossover_2k.prom")]) == 0
    out = capsys.readouterr().out
    assert "Recommended threshold: 2048 tokens (crossover, measured)" in out
    assert "TTFT by prompt length and path" in out and "2049-4096" in out
    assert "Share of traffic above candidate thresholds" in out and "*4096" in out
    assert "Recommended prefill:decode ratio:" in out and "heuristic:" in out
    assert "not enough evidence" in out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["advise", "--file", str(FIXTURES / "window_t1.prom"), "--since", str(FIXTURES / "window_t0.prom")]
    assert main([*args, "--json", "--candidates", "1000,3000"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommendation"]["threshold"] == 2048
    assert [row["threshold"] for row in data["shares"]] == [1000, 3000, 4096]
    assert {row["span"] for row in data["ttft"]} >= {"1-128", "2049-4096"}
    assert data["sources"][-1].startswith("since ")


def test_cli_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["advise", "--file", str(tmp_path / "missing.prom")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["advise"]) == 1
    assert "give either --metrics URL or --file FILE" in capsys.readouterr().err
    backwards = ["--file", str(FIXTURES / "window_t0.prom"), "--since", str(FIXTURES / "window_t1.prom")]
    assert main(["advise", *backwards]) == 1
    assert "went down" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "ttft.png"
    assert main(["advise", "--file", str(FIXTURES / "crossover_2k.prom"), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart written to {out}" in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(command, "matplotlib_available", lambda: False)
    code = main(["advise", "--file", str(FIXTURES / "crossover_2k.prom"), "--plot", str(tmp_path / "x.png")])
    assert code == 2 and not (tmp_path / "x.png").exists()
    assert "pip install 'dpd-router[bench]'" in capsys.readouterr().err


def test_render_text_with_nothing_in_it() -> None:
    text = render_text(analyse(Scrape.parse("# TYPE dpd_router_routing_threshold_tokens gauge\n"
                                            "dpd_router_routing_threshold_tokens 4096.0\n")))  # fmt: skip
    assert "no requests" in text and "Recommended threshold: none" in text


def test_warnings_name_what_skews_the_evidence() -> None:
    skewed = scrape("crossover_2k.prom")
    skewed.cumulative[("dpd_router_kv_transfer_ineffective_total", ())] = 111.0
    skewed.cumulative[("dpd_router_prefill_fallbacks_total", (("reason", "timeout"),))] = 5.0
    skewed.cumulative[("dpd_router_route_decisions_total", (("path", "direct"), ("reason", "prefill_pool_busy")))] = 7
    warnings = analyse(skewed).warnings
    assert any(w.startswith("111 disaggregated requests recomputed their prompt") and "10%" in w for w in warnings)
    assert any(w.startswith("5 prefill hops failed") for w in warnings)
    assert any(w.startswith("7 long prompts went direct for another reason") for w in warnings)
    assert analyse(scrape("crossover_2k.prom")).warnings == []


def test_adaptive_routers_effective_threshold_and_learned_costs_are_reported() -> None:
    """The router's own adaptive exposition (its collector over a model that learned a few calls), scraped
    beside a static fixture: advise reports the effective threshold per decoder and every learned cost."""
    from prometheus_client import CollectorRegistry, generate_latest

    from dpd_router.record.metrics import _AdaptiveCollector
    from dpd_router.routing.adaptive import AdaptiveModel, AdaptivePolicy

    model = AdaptiveModel(AdaptivePolicy(), routing_threshold=2048)
    for tokens in (1000, 3000, 5000):
        model.learn_prefill("http://p1", tokens, 0.01 + 0.00008 * tokens)
    model.learn_direct("http://d1", 2000, 0.2)
    registry = CollectorRegistry()
    registry.register(_AdaptiveCollector(lambda: [("http://d1", 3100.0), ("http://d2", math.inf)], model.cost_rows))
    adaptive = Scrape.parse(generate_latest(registry).decode())
    report = analyse(scrape("crossover_2k.prom").plus(adaptive))
    assert report.adaptive["thresholds"] == [
        {"decoder": "http://d1", "tokens": 3100.0},
        {"decoder": "http://d2", "tokens": math.inf},
    ]
    hop = next(c for c in report.adaptive["costs"] if (c["model"], c["endpoint"]) == ("prefill_hop", "http://p1"))
    assert hop["terms"]["observations"] == 3
    assert {c["model"] for c in report.adaptive["costs"]} >= {
        "handoff",
        "direct_prefill",
        "prefill_hop",
        "prefill_hop_slo",
    }
    text = render_text(report)
    assert "Adaptive threshold (threshold_mode adaptive)" in text
    assert "3,100 tokens" in text and "never (keeps every prompt)" in text
    assert "(3 observations)" in text
    assert json.loads(json.dumps(report.to_dict()))["adaptive"]["thresholds"][1]["tokens"] == "+Inf"
    # A static router's scrape has no adaptive section.
    static = analyse(scrape("crossover_2k.prom"))
    assert static.adaptive == {} and "Adaptive threshold" not in render_text(static)


# ------------------------------------------------------------------------- arms, promotion and verdict
# The arms_*, shadow_* and short_prompts fixtures carry the request metrics' `arm` label (generate.py's ArmMetrics).


def compared(report: Report, request_class: str, metric: str) -> Comparison:
    assert report.arms is not None
    return next(c for c in report.arms.comparisons if (c.request_class, c.metric) == (request_class, metric))


def raw_total(name: str, sample: str, **labels: str) -> float:
    return sum(
        value
        for (found, items), value in samples(name).items()
        if found == sample and all(dict(items).get(k) == v for k, v in labels.items())
    )


def test_arms_are_learnt_from_the_label_and_a_scrape_without_it_is_arm_live() -> None:
    for name, arms in (("arms_clear.prom", ["t2048", "t8192"]), ("shadow_pass.prom", ["live", "shadow"])):
        report = analyse(scrape(name)).arms
        assert report is not None and report.arms == arms
    old = analyse(scrape("crossover_2k.prom")).arms
    assert old is not None and old.arms == ["live"] and old.comparisons == []
    assert {row.arm for row in old.stats} == {"live"} and old.classes == ["1-2048", ">2048"]
    live = {(row.path, row.request_class): row.requests for row in old.stats}
    assert live[("all", ">2048")] == live[("direct", ">2048")] + live[("disaggregated", ">2048")]


def test_arm_counts_add_up_to_the_arm_requests() -> None:
    report = analyse(scrape("arms_clear.prom"))
    assert report.arms is not None
    for arm in ("t2048", "t8192"):
        rows = [row for row in report.arms.stats if row.arm == arm and row.path != "all"]
        assert sum(row.requests for row in rows) == raw_total("arms_clear.prom", "dpd_router_requests_total", arm=arm)
    # The threshold advice sums the arms: they serve the same traffic on the same pools.
    assert sum(report.requests.values()) == raw_total("arms_clear.prom", "dpd_router_requests_total") == 6000


def test_two_arms_with_a_clear_winner() -> None:
    report = analyse(scrape("arms_clear.prom"), Options(observed_hours=2.0))
    ttft = compared(report, ">2048", "ttft_p50")
    assert (ttft.status, ttft.winner, ttft.runner_up) == ("winner", "t2048", "t8192")
    assert ttft.difference is not None and ttft.difference_low is not None and ttft.difference_high is not None
    assert 0 < ttft.difference_low <= ttft.difference <= ttft.difference_high
    assert ttft.more_hours == 0.0 and "t2048 wins" in ttft.note
    for request_class in ("1-2048", ">2048"):  # t8192's decoders prefill 2-8k prompts: every stream stalls more
        itl = compared(report, request_class, "itl_p99")
        assert (itl.status, itl.winner) == ("winner", "t2048")
    # Short prompts take the same path in both arms: no winner is named where there is no difference.
    assert report.arms is not None
    short = [c for c in report.arms.comparisons if c.request_class == "1-2048" and c.metric != "itl_p99"]
    assert short and all(c.winner is None for c in short)
    # The winner is the arm whose own traffic, alone, has the lower TTFT: each arm as a separate static run.
    p50 = {}
    for arm in ("t2048", "t8192"):
        arms = analyse(scrape("arms_clear.prom").arms_only(lambda a, arm=arm: a == arm)).arms
        assert arms is not None and arms.comparisons == [] and arms.arms == [arm]
        rows = [row for row in arms.stats if row.request_class == ">2048"]
        whole = next(row for row in rows if row.path == "all") if len(rows) > 1 else rows[0]
        p50[arm] = whole.metrics["ttft_p50"].value
    assert min(p50, key=lambda arm: p50[arm]) == ttft.winner


def test_itl_counts_streams_not_gaps_so_a_few_long_streams_name_no_winner() -> None:
    """A handful of streams with hundreds of gaps each: one stalled stream's gaps stall together, so the
    gaps are not independent observations and their number alone must not make a winner."""
    metrics = RouterMetrics()
    for arm, stalls in (("calm", 0), ("stalled", 40)):
        for stream in range(5):
            trace = RequestTrace(request_id=f"{arm}-{stream}", kind="chat", stream=True, arm=arm, path="direct")
            trace.prompt_tokens = 3000
            now = trace.started + 0.2
            output = Output()
            output.mark_token_chunk(now)
            for gap in range(300):
                now += 0.5 if stream == 0 and gap < stalls else 0.01  # one stream of the arm stalls, often
                output.mark_token_chunk(now)
            trace.take(output)
            Observer(metrics).record(trace, now)
    report = analyse(Scrape.parse(metrics.render().decode()))
    itl = compared(report, ">2048", "itl_p99")
    assert itl.status == "not_enough_data" and itl.winner is None
    assert "5 < 500" in itl.note  # streams, against the 500 a p99 needs
    # The same gaps counted as independent observations (the old reading) would have named a winner.
    assert report.arms is not None
    stats = {row.arm: row.metrics["itl_p99"] for row in report.arms.stats if row.request_class == ">2048"}
    assert stats["stalled"].value is not None and stats["calm"].value is not None
    assert stats["stalled"].value > 10 * stats["calm"].value


def test_two_arms_with_too_little_data_are_undecided_with_the_hours_needed() -> None:
    report = analyse(scrape("arms_sparse.prom"), Options(observed_hours=1.0))
    p95 = compared(report, ">2048", "ttft_p95")
    assert p95.status == "not_enough_data" and p95.winner is None
    assert p95.traffic_factor is not None and p95.traffic_factor > 1
    assert p95.more_hours == pytest.approx(p95.traffic_factor - 1.0)
    assert "not enough data" in p95.note and "more hours of this traffic are needed" in p95.note
    assert report.arms is not None and all(
        c.winner is None for c in report.arms.comparisons if c.metric.endswith("p95")
    )
    text = render_text(report)
    assert "Winner per class" in text and "TTFT P95 in >2048: not enough data" in text


def test_the_hours_needed_predict_when_the_difference_becomes_significant() -> None:
    """The interval narrows as 1/sqrt(traffic): with the traffic the estimate asks for, the same difference is
    significant; with less, it is not yet."""
    undecided = compared(analyse(scrape("short_prompts.prom"), Options(observed_hours=1.0)), ">2048", "ttft_p50")
    assert undecided.status == "undecided" and undecided.winner is None
    assert undecided.traffic_factor is not None and 1.2 < undecided.traffic_factor < 3
    assert undecided.more_hours == pytest.approx(undecided.traffic_factor - 1.0)
    assert "more hours of this traffic are needed for it to be significant" in undecided.note

    def repeated(times: int) -> Scrape:
        total = scrape("short_prompts.prom")
        for _ in range(times - 1):
            total = total.plus(scrape("short_prompts.prom"))
        return total

    enough = math.ceil(undecided.traffic_factor * 1.5)
    decided = compared(analyse(repeated(enough)), ">2048", "ttft_p50")
    assert (decided.status, decided.winner) == ("winner", undecided.best)
    assert decided.difference == pytest.approx(undecided.difference)


def test_without_a_duration_the_need_is_a_multiple_of_the_traffic() -> None:
    p95 = compared(analyse(scrape("arms_sparse.prom")), ">2048", "ttft_p95")
    assert p95.more_hours is None and p95.traffic_factor is not None
    assert f"about {p95.traffic_factor:.1f}x the traffic in this scrape" in p95.note


def test_bootstrap_is_seeded() -> None:
    first = analyse(scrape("arms_clear.prom")).to_dict()
    again = analyse(scrape("arms_clear.prom")).to_dict()
    other = analyse(scrape("arms_clear.prom"), Options(seed=7)).to_dict()
    assert first["arms"] == again["arms"] and first["verdict"] == again["verdict"]
    assert first["arms"]["stats"] != other["arms"]["stats"]
    assert [c["winner"] for c in first["arms"]["comparisons"]] == [c["winner"] for c in other["arms"]["comparisons"]]


def test_bootstrap_resamples_the_bucket_counts() -> None:
    boot = Bootstrap(resamples=2000, confidence=0.9, seed=3)
    assert sum(bootstrap.multinomial(boot.rng("m"), 1000, [1.0, 0.0, 2.0, 7.0])) == 1000
    assert bootstrap.multinomial(boot.rng("m"), 1000, [1.0, 0.0, 2.0, 7.0])[1] == 0
    draws = [bootstrap.binomial(boot.rng(f"b{i}"), 40, 0.25) for i in range(4000)]
    assert 9.8 < sum(draws) / len(draws) < 10.2 and max(draws) <= 40  # exact by inversion: mean n * p = 10
    wide = [bootstrap.binomial(boot.rng(f"w{i}"), 100_000, 0.3) for i in range(500)]
    assert 29_900 < sum(wide) / len(wide) < 30_100  # normal approximation
    hist = Histogram([0.1, 0.2, 0.4, 0.8, math.inf], [100.0, 400.0, 800.0, 990.0, 1000.0], 300.0)
    estimate, values = boot.estimate(hist, 0.5, 20, "h")
    assert estimate.value == hist.quantile(0.5)[0] and len(values) == 2000
    assert estimate.low is not None and estimate.high is not None and estimate.low < estimate.value < estimate.high
    # Four times the observations, the same shape: the interval about half as wide.
    bigger = Histogram(hist.bounds, [4 * c for c in hist.cumulative], 4 * hist.sum)
    narrower, _ = boot.estimate(bigger, 0.5, 20, "h")
    assert narrower.low is not None and narrower.high is not None
    assert 0.35 < (narrower.high - narrower.low) / (estimate.high - estimate.low) < 0.65
    assert bootstrap.needed_observations(0.999, 20) == 5000 and bootstrap.needed_observations(0.5, 20) == 20
    p99, _ = boot.estimate(hist, 0.999, bootstrap.needed_observations(0.999, 20), "h")
    assert p99.capped and p99.value == 0.8 and not p99.enough and p99.needed == 5000


def test_promotion_passes_when_the_hop_pays_against_a_monolithic_shadow() -> None:
    report = analyse(scrape("shadow_pass.prom"))
    promotion = report.promotion
    assert promotion is not None and promotion.status == "pass" and promotion.summary.startswith("Promote")
    count = raw_total("shadow_pass.prom", "dpd_router_phase_seconds_count", arm="live", path="disaggregated",
                      phase="first_token")  # fmt: skip
    total = raw_total("shadow_pass.prom", "dpd_router_phase_seconds_sum", arm="live", path="disaggregated",
                      phase="first_token")  # fmt: skip
    assert promotion.transfer_overhead == pytest.approx(total / count)
    assert [c.request_class for c in promotion.classes] == ["2049-4096", "4097-8192", "8193-16384", "16385-32768"]
    for check in promotion.classes:
        assert (check.disaggregated_source, check.monolithic_source) == ("live disaggregated", "shadow monolithic")
        assert check.status == "pass" and check.significant and check.margin is not None
        assert check.disaggregated.value is not None and check.monolithic.value is not None
        assert check.margin == pytest.approx(
            check.disaggregated.value - check.monolithic.value - promotion.transfer_overhead
        )
        assert check.margin <= 0
    # The shadow's copies repeat live requests: the threshold and ratio advice leaves them out.
    assert report.requests == {"direct": 1786.0, "disaggregated": 1214.0}
    assert report.prompt_tokens["requests"] == raw_total("shadow_pass.prom", "dpd_router_requests_total", arm="live")


def test_promotion_fails_when_the_hop_costs_more_than_the_transfer() -> None:
    promotion = analyse(scrape("shadow_fail.prom")).promotion
    assert promotion is not None and promotion.status == "fail" and promotion.summary.startswith("Do not promote")
    failing = [check for check in promotion.classes if check.status == "fail"]
    assert failing and all(c.margin is not None and c.margin > 0 and c.significant for c in failing)
    assert all(c.request_class in promotion.summary for c in failing)


def test_promotion_from_live_paths_and_without_a_monolithic_side() -> None:
    # A/B arms: one disaggregates the 2-8k prompts, the other serves them direct.
    live = analyse(scrape("arms_clear.prom")).promotion
    assert live is not None and live.status == "pass"
    judged = [c for c in live.classes if c.status == "pass"]
    assert [c.request_class for c in judged] == ["2049-4096", "4097-8192"]
    assert all((c.disaggregated_source, c.monolithic_source) == ("live disaggregated", "live direct") for c in judged)
    assert all(c.status == "no_data" for c in live.classes if c not in judged), "above 8192 both arms disaggregate"
    # One static threshold: no prompt-length bucket has both sides.
    static = analyse(scrape("static_4096.prom")).promotion
    assert static is not None and static.status == "no_data"
    sparse = analyse(scrape("arms_sparse.prom")).promotion
    assert sparse is not None and sparse.status == "not_enough_data"


def test_verdict_go_when_long_prompts_are_common_and_cause_the_itl_misses() -> None:
    verdict = analyse(scrape("arms_clear.prom")).verdict
    assert verdict is not None and verdict.decision == "go"
    at_2048 = raw_total("arms_clear.prom", "dpd_router_prompt_tokens_bucket", le="2048.0")
    assert verdict.long_prompt_share == pytest.approx((6000 - at_2048) / 6000) and verdict.long_prompts_common
    assert verdict.attribution == "attributed" and verdict.itl_misses_from_long_prompts is True
    assert verdict.itl_p99.value is not None and verdict.itl_p99.value > verdict.itl_slo == 0.1
    assert any(f"{verdict.long_prompt_share:.1%} of 6,000 requests" in r for r in verdict.reasons)
    assert any("arm t8192" in r and "arm t2048" in r and "ITL p99" in r for r in verdict.reasons)
    # A monolithic shadow is the decoder-prefilled side when the live router disaggregates every long prompt.
    shadowed = analyse(scrape("shadow_pass.prom")).verdict
    assert shadowed is not None and (shadowed.decision, shadowed.attribution) == ("go", "attributed")
    assert any("(shadow monolithic)" in r for r in shadowed.reasons)


def test_verdict_no_go_under_15_percent_long_prompts() -> None:
    verdict = analyse(scrape("short_prompts.prom")).verdict
    assert verdict is not None and verdict.decision == "no_go" and verdict.long_prompts_common is False
    assert verdict.long_prompt_share is not None and verdict.long_prompt_share <= 0.15
    assert "too few long prompts" in verdict.summary and f"{verdict.long_prompt_share:.1%}" in verdict.summary


def test_verdict_no_go_when_itl_meets_its_slo_and_undecided_when_it_cannot_attribute() -> None:
    lenient = analyse(scrape("arms_clear.prom"), Options(itl_slo=0.5)).verdict
    assert lenient is not None and (lenient.decision, lenient.attribution) == ("no_go", "no_misses")
    assert "ITL meets its SLO" in lenient.summary
    # One static threshold, ITL over a strict SLO: nothing prefills long prompts differently to compare with.
    strict = analyse(scrape("static_4096.prom"), Options(itl_slo=0.02)).verdict
    assert strict is not None and (strict.decision, strict.attribution) == ("undecided", "cannot_attribute")
    assert strict.itl_misses_from_long_prompts is None and strict.itl_miss_share is not None
    assert "cannot tell" in strict.summary and any("run an A/B arm" in r for r in strict.reasons)


def test_cli_arms_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["advise", "--file", str(FIXTURES / "arms_sparse.prom"), "--hours", "1.5"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["arms"]["arms"] == ["t2048", "t8192"] and data["arms"]["observed_hours"] == 1.5
    assert data["arms"]["hours_basis"] == "--hours"
    p95 = next(c for c in data["arms"]["comparisons"] if (c["request_class"], c["metric"]) == (">2048", "ttft_p95"))
    assert p95["status"] == "not_enough_data" and p95["more_hours"] > 0
    assert data["promotion"]["status"] == "not_enough_data" and data["verdict"]["decision"] in ("go", "undecided")
    assert set(data["arms"]["stats"][0]["metrics"]["ttft_p95"]) >= {"value", "low", "high", "count", "enough"}
    assert main([*args, "--classes", "1024,8192", "--itl-slo", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "Arms side by side" in out and "1025-2048" in out and "2049-8192" in out and ">8192" in out
    assert "Promotion check" in out and "Verdict: " in out and "SLO 50 ms" in out
    assert main([*args, "--classes", "3000"]) == 2
    assert "--classes takes prompt-length bucket bounds" in capsys.readouterr().err


def test_hours_come_from_the_window_or_the_scrapes_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    earlier, later = tmp_path / "t0.prom", tmp_path / "t1.prom"
    earlier.write_text((FIXTURES / "window_t0.prom").read_text())
    later.write_text((FIXTURES / "window_t1.prom").read_text())
    os.utime(earlier, (1_700_000_000, 1_700_000_000))
    os.utime(later, (1_700_000_000 + 3 * 3600, 1_700_000_000 + 3 * 3600))
    assert main(["advise", "--file", str(later), "--since", str(earlier), "--json"]) == 0
    arms = json.loads(capsys.readouterr().out)["arms"]
    assert arms["observed_hours"] == pytest.approx(3.0) and "--since" in arms["hours_basis"]
    assert main(["advise", "--file", str(later), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["arms"]["observed_hours"] is None


def test_plot_shows_the_arms(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "arms.png"
    assert main(["advise", "--file", str(FIXTURES / "shadow_pass.prom"), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_scrape_of_several_models_is_advised_one_model_at_a_time(tmp_path: Path) -> None:
    """Two served models in one scrape: advised together with a warning, or one at a time with --model."""
    metrics = RouterMetrics()
    for model, count, tokens in (("alpha", 30, 3000), ("beta", 12, 300)):
        metrics.routing_threshold.labels(model).set(2048 if model == "alpha" else 512)
        for i in range(count):
            trace = RequestTrace(request_id=f"{model}-{i}", kind="chat", stream=True, path="direct")
            trace.model, trace.prompt_tokens = model, tokens
            trace.take(first_token_at(trace.started + 0.1))
            Observer(metrics).record(trace, trace.started + 0.2)
    both = Scrape.parse(metrics.render().decode())
    assert both.models() == ["alpha", "beta"]
    together = analyse(both)
    assert together.requests["direct"] == 42
    assert any("2 models (alpha, beta)" in warning for warning in together.warnings)
    alpha = analyse(both.model_only("alpha"))
    assert alpha.requests["direct"] == 30 and alpha.prompt_tokens["requests"] == 30
    assert not any("models" in warning for warning in alpha.warnings)
    assert (alpha.recommendation.current, together.recommendation.current) == (2048, None), "its own threshold"
    scraped = tmp_path / "two.prom"
    scraped.write_text(metrics.render().decode())
    assert main(["advise", "--file", str(scraped), "--model", "beta", "--json"]) == 0
    assert main(["advise", "--file", str(scraped), "--model", "gamma"]) == 1


def test_the_models_behind_an_alias_are_compared_as_arms_are(tmp_path: Path) -> None:
    """A new version (beta, slower here) beside the old: --compare-models shows both side by side and names
    the faster one per class and metric, from the requests each served."""
    metrics = RouterMetrics()
    for model, count, ttft in (("alpha", 400, 0.10), ("beta", 400, 0.30), ("gamma", 50, 9.0)):
        for i in range(count):
            trace = RequestTrace(request_id=f"{model}-{i}", kind="chat", stream=True, path="direct")
            trace.model, trace.prompt_tokens = model, 300
            trace.take(first_token_at(trace.started + ttft * (0.9 + 0.2 * (i % 10) / 10)))
            Observer(metrics).record(trace, trace.started + ttft + 0.5)
    scrape = Scrape.parse(metrics.render().decode())
    report = analyse(scrape.models_as_arms(["alpha", "beta"]))
    assert report.arms.arms == ["alpha", "beta"], "gamma left out"
    ttft = [c for c in report.arms.comparisons if c.metric.startswith("ttft")]
    assert ttft and all(c.winner == "alpha" for c in ttft if c.status == "winner")
    assert any(c.status == "winner" for c in ttft)
    scraped = tmp_path / "alias.prom"
    scraped.write_text(metrics.render().decode())
    assert main(["advise", "--file", str(scraped), "--compare-models", "alpha,beta", "--json"]) == 0
    assert main(["advise", "--file", str(scraped), "--compare-models", "alpha,delta"]) == 1
    assert main(["advise", "--file", str(scraped), "--compare-models", "alpha"]) == 2


def first_token_at(now: float) -> Output:
    """A stream's output of one chunk, at `now`."""
    output = Output()
    output.mark_token_chunk(now)
    return output
