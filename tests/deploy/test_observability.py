"""Alerts, dashboard and autoscaling queries: valid PromQL, reading only metrics that exist.

The router's metric names and labels come from a live `/metrics`: the router runs on 127.0.0.1 in
front of simulated engines and serves a mix of requests (direct, disaggregated, one fallback)
first. Engine metrics (vllm:*) are scraped from the engines directly in a cluster; they are checked
against vLLM's documented names (docs/connectors.md, "Engine endpoints") and the simulator's live ones.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from dpd_router.record.metrics import RouterMetrics
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, openai_client, running_router

from .chart import CHART, DEPLOY, monitoring_on, render
from .promql import Selector, from_grafana, reads

DASHBOARD = CHART / "files" / "grafana-dashboard.json"
ADAPTER = DEPLOY / "prometheus-adapter" / "values.yaml"

# Labels Prometheus adds when it scrapes (the Operator's defaults plus the chart's relabelings).
SCRAPE_LABELS = {"namespace", "pod", "service", "endpoint", "container", "job", "instance", "dpd_release", "dpd_pool"}
# vLLM's engine metrics as docs/connectors.md lists them (v1 names), and their labels.
VLLM_GAUGES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
VLLM_COUNTERS = {
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:nixl_num_failed_transfers", "vllm:nixl_num_kv_expired_reqs",
}  # fmt: skip
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:nixl_xfer_time_seconds",
}  # fmt: skip
VLLM_LABELS = {"model_name", "engine", "finished_reason", "le"}
OTHER_SERIES = {"up": set()}
# Labels whose values the expressions name, checked against the values the live run produced.
CHECKED_VALUES = ("path", "role", "reason", "signal")

LONG = "The quarterly report shows steady growth across every region and product line. " * 12
THRESHOLD = 64


@dataclass
class Exported:
    """Sample names a /metrics text can show (with _total, _bucket... suffixes), their labels and values."""

    names: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    values: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    @classmethod
    def parse(cls, text: str) -> Exported:
        exported = cls()
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
        for family in text_string_to_metric_families(text):
            exported.names |= {family.name + s for s in suffixes.get(family.type, ("",))}
            for sample in family.samples:
                exported.names.add(sample.name)
                exported.labels[sample.name] |= set(sample.labels)
                for label, value in sample.labels.items():
                    exported.values[label].add(value)
        return exported


@dataclass
class LiveRun:
    router: Exported
    engines: Exported


@pytest.fixture(scope="module")
async def live(tokenizer_dir: Path) -> AsyncIterator[LiveRun]:
    async with (
        SimCluster(in_process=True, prefill=2, decode=1, tokenizer=tokenizer_dir, model=MODEL) as cluster,
        running_router(
            prefill_urls=cluster.prefill_urls,
            decode_urls=cluster.decode_urls,
            tokenizer=str(tokenizer_dir),
            model=MODEL,
            routing_threshold=THRESHOLD,
        ) as base_url,
        httpx.AsyncClient(timeout=30) as http,
    ):
        client = openai_client(base_url)
        for prompt in (f"First. {LONG}", "Hello there!"):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, stream=True
            )
            async for _ in stream:
                pass
        await client.completions.create(model=MODEL, prompt=f"Second. {LONG}", max_tokens=8)
        # Prefills that stage no KV on both prefillers: a retry, then a fallback to the decoder alone.
        for url in cluster.prefill_urls:
            await http.post(f"{url}/sim/fault", json={"mode": "no_kv_params", "count": 1})
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Third. {LONG}"}], max_tokens=8
        )
        router_text = (await http.get(f"{base_url}/metrics")).text
        engine_texts = [(await http.get(f"{url}/metrics")).text for url in cluster.prefill_urls + cluster.decode_urls]
    engines = Exported()
    for text in engine_texts:
        one = Exported.parse(text)
        engines.names |= one.names
    yield LiveRun(Exported.parse(router_text), engines)


def vllm_names(live: LiveRun) -> set[str]:
    documented = set(VLLM_GAUGES)
    documented |= {name + "_total" for name in VLLM_COUNTERS}
    documented |= {name + suffix for name in VLLM_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
    return documented | {name for name in live.engines.names if name.startswith("vllm:")}


def rule_expressions() -> dict[str, str]:
    (rule,) = render(monitoring_on({})).of_kind("PrometheusRule")
    return {
        f"PrometheusRule {r['alert']} {r.get('labels', {}).get('path', '')}".strip(): r["expr"]
        for group in rule["spec"]["groups"]
        for r in group["rules"]
    }


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_expressions() -> dict[str, str]:
    found = {}
    board = dashboard()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            found[f"dashboard panel {panel['title']!r} {target['refId']}"] = from_grafana(
                target["expr"], namespace="llm", release="demo"
            )
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            inner = variable["definition"].removeprefix("label_values(").rsplit(",", 1)[0]
            found[f"dashboard variable {variable['name']}"] = from_grafana(inner, namespace="llm")
    return found


def adapter_expressions() -> dict[str, str]:
    found = {}
    for rule in yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]:
        series = rule["seriesQuery"].split("{")[0]
        query = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="llm",pod=~"demo-.*"')
            .replace("<<.GroupBy>>", "pod")
        )
        found[f"prometheus-adapter {rule['name']['as']}"] = query
        found[f"prometheus-adapter {rule['name']['as']} series"] = rule["seriesQuery"]
    return found


def all_expressions() -> dict[str, str]:
    return {**rule_expressions(), **dashboard_expressions(), **adapter_expressions()}


def declared_labels() -> dict[str, set[str]]:
    """Label names of the router's metrics as metrics.py declares them, by sample name: for metrics
    the live run left without a sample (no admission rejection, no client disconnect...)."""
    declared: dict[str, set[str]] = {}
    for metric in vars(RouterMetrics()).values():
        if isinstance(metric, MetricWrapperBase):
            (family,) = metric.describe()
            labels = set(metric._labelnames)  # prometheus_client keeps them only there
            for suffix in {"counter": ("_total",), "histogram": ("_sum", "_count"), "gauge": ("",)}[family.type]:
                declared[family.name + suffix] = labels
            if family.type == "histogram":
                declared[family.name + "_bucket"] = labels | {"le"}
    return declared


def known_labels(selector: Selector, live: LiveRun) -> set[str]:
    if selector.name.startswith("dpd_router_"):
        labels = live.router.labels.get(selector.name) or declared_labels().get(selector.name)
        assert labels is not None, f"{selector.name}: the router declares no such metric"
        return labels | SCRAPE_LABELS
    if selector.name.startswith("vllm:"):
        return VLLM_LABELS | SCRAPE_LABELS
    return OTHER_SERIES[selector.name] | SCRAPE_LABELS


def test_every_query_is_valid_promql() -> None:
    expressions = all_expressions()
    assert len(expressions) > 40
    for source, expr in expressions.items():
        try:
            reads(expr)
        except ValueError as exc:
            pytest.fail(f"{source}: {exc}\n{expr}")


def test_queries_read_only_metrics_that_exist(live: LiveRun) -> None:
    engine_names = vllm_names(live)
    for source, expr in all_expressions().items():
        for selector in reads(expr).selectors:
            name = selector.name
            if name.startswith("dpd_router_"):
                assert name in live.router.names, f"{source}: the router does not export {name}"
            elif name.startswith("vllm:"):
                assert name in engine_names, f"{source}: vLLM does not export {name}"
            else:
                assert name in OTHER_SERIES, f"{source}: {name} is neither the router's nor vLLM's"


def test_queries_select_and_group_by_labels_the_metrics_have(live: LiveRun) -> None:
    for source, expr in all_expressions().items():
        found = reads(expr)
        for selector in found.selectors:
            labels = known_labels(selector, live)
            for label, _, _ in selector.matchers:
                assert label in labels, f"{source}: {selector.name} has no label {label!r}"
            if selector.name.startswith("dpd_router_"):
                for label in CHECKED_VALUES:
                    for value in selector.equal_values(label):
                        seen = live.router.values[label]
                        assert value in seen, f"{source}: {label}={value!r} never seen (seen: {sorted(seen)})"
        for grouping in found.groupings:
            available = set().union(*(known_labels(s, live) for s in grouping.selectors)) | grouping.made_labels
            missing = set(grouping.labels) - available
            assert not missing, f"{source}: groups by {sorted(missing)}, which its series do not have"


def test_live_run_covered_both_paths_and_a_fallback(live: LiveRun) -> None:
    assert {"direct", "disaggregated"} <= live.router.values["path"]
    assert "prefill_failed" in live.router.values["reason"]
    assert "dpd_router_prefill_fallbacks_total" in live.router.labels


def test_alerts_cover_the_playbook() -> None:
    (rule,) = render(monitoring_on({})).of_kind("PrometheusRule")
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rules:
        by_name[r["alert"]].append(r)
        assert r["for"] and r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
    assert {
        "DPDRouterTTFTAboveSLO",
        "DPDRouterITLAboveSLO",
        "DPDTransferQueueWaitHigh",
        "DPDPrefillPoolDown",
        "DPDPrefillFallbackRateHigh",
        "DPDEngineCircuitOpen",
    } <= set(by_name)
    ttft = {r["labels"]["path"]: r["expr"] for r in by_name["DPDRouterTTFTAboveSLO"]}
    assert set(ttft) == {"direct", "disaggregated"}
    assert ttft["direct"].rstrip().endswith("> 1") and ttft["disaggregated"].rstrip().endswith("> 2.5")
    (queue,) = by_name["DPDTransferQueueWaitHigh"]
    assert queue["expr"].rstrip().endswith("> 0.375"), "15% of the 2.5 s disaggregated TTFT target"


def test_alert_thresholds_follow_the_slo_values() -> None:
    slo = {"ttftSeconds": {"direct": 0.5, "disaggregated": 4}, "itlSeconds": 0.03, "transferQueueShare": 0.1}
    values = monitoring_on({"monitoring": {"prometheusRule": {"slo": slo}}})
    (rule,) = render(values).of_kind("PrometheusRule")
    exprs = {
        (r["alert"], r.get("labels", {}).get("path")): r["expr"].rstrip()
        for g in rule["spec"]["groups"]
        for r in g["rules"]
    }
    assert exprs[("DPDRouterTTFTAboveSLO", "direct")].endswith("> 0.5")
    assert exprs[("DPDRouterTTFTAboveSLO", "disaggregated")].endswith("> 4")
    assert exprs[("DPDRouterITLAboveSLO", None)].endswith("> 0.03")
    assert exprs[("DPDTransferQueueWaitHigh", None)].endswith("> 0.4")


def test_dashboard_has_the_dpd_panels() -> None:
    board = dashboard()
    titles = [panel["title"] for panel in board["panels"] if panel["type"] != "row"]
    wanted = [
        "End-to-end TTFT",
        "Prefill TTFT",
        "Prefill queue",
        "Decode queue",
        "Prefill time",
        "Decode latency",
        "KV transfer time",
        "Routing: disaggregated vs direct vs fallback",
        "Decision reasons",
        "Prompt token distribution",
        "Ineffective transfers",
        "Per-endpoint load",
    ]
    for title in wanted:
        assert any(t.startswith(title) for t in titles), f"no panel {title!r}"


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "release"} <= variables
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert 'namespace="$namespace"' in target["expr"] and 'dpd_release="$release"' in target["expr"], (
                f"{panel['title']}: every query is scoped to the chosen release"
            )
