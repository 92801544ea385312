"""`dpd-router advise` on recorded scrapes (tests/unit/fixtures/*.prom, written by fixtures/generate.py)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpd_router.advise import command
from dpd_router.advise import ratio as pool_ratio
from dpd_router.advise.analysis import analyse
from dpd_router.advise.collect import metrics_url
from dpd_router.advise.histogram import Histogram
from dpd_router.advise.render import render_text
from dpd_router.advise.report import Options
from dpd_router.advise.scrape import AdviseError, Scrape
from dpd_router.cli import main
from dpd_router.metrics import PROMPT_LENGTH_BOUNDS

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

    from dpd_router.metrics import _AdaptiveCollector
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
