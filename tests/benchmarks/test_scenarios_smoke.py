"""Each benchmark scenario, run end to end at a tiny size, so the scripts cannot rot.

They start real simulated engines and dpd-router processes on 127.0.0.1, like the full runs, but
with fast engine timing and a handful of requests; no outside tool (genai-bench, vllm-router) is
needed. The numbers are not checked, only that every request succeeded and the reports exist.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import required_tool

ROOT = Path(__file__).resolve().parents[2]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_scenario(module: str, out: Path, *extra: str, timeout: float = 120) -> dict:
    """`python -m benchmarks.<module> --smoke --quiet --out <out> <extra>`; its results.json."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--smoke", "--quiet", "--out", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "results.md").read_text().startswith("# Scenario")
    return json.loads((out / "results.json").read_text())


def assert_plots(results: dict, out: Path) -> None:
    if HAVE_MATPLOTLIB:
        assert results["plots"], "matplotlib is installed, so the scenario should have drawn its plots"
        for name in results["plots"]:
            assert (out / name).stat().st_size > 1000


def test_dpd_vs_colocated_runs_every_setup_on_both_workloads(tmp_path: Path) -> None:
    results = run_scenario("dpd_vs_colocated", tmp_path)

    seen = {(run["workload"], run["setup"]) for run in results["runs"]}
    assert seen == {(w, s) for w in ("fixed", "mixed") for s in ("dpd", "dpd-nogate", "colocated-2", "colocated-1")}
    assert all(run["summary"]["all"]["errors"] == 0 for run in results["runs"])
    dpd_fixed = next(r for r in results["runs"] if r["setup"] == "dpd" and r["workload"] == "fixed")
    assert set(dpd_fixed["decisions"]) == {"disaggregated/long_prompt"}
    colocated = next(r for r in results["runs"] if r["setup"] == "colocated-1" and r["workload"] == "fixed")
    assert colocated["decisions"] and all(key.startswith("direct/") for key in colocated["decisions"])
    assert_plots(results, tmp_path)


def test_router_overhead_measures_direct_and_router_paths(tmp_path: Path) -> None:
    results = run_scenario("router_overhead", tmp_path)

    kinds = {run["kind"] for run in results["runs"]}
    assert kinds == {"latency", "tokenize_stall", "streaming"}
    setups = {run["setup"] for run in results["runs"] if run["kind"] == "latency"}
    assert setups == {"direct", "dpd-router", "dpd-router-pd"}
    assert all(run["summary"]["errors"] == 0 for run in results["runs"])
    assert "added p50 ms" in (tmp_path / "results.md").read_text()
    assert_plots(results, tmp_path)


def test_threshold_measures_both_paths_and_the_sweep(tmp_path: Path) -> None:
    results = run_scenario("threshold", tmp_path)

    assert {row["path"] for row in results["crossover"]} == {"direct", "disaggregated"}
    assert all(row["probe"]["errors"] == 0 and row["background_gaps"] > 0 for row in results["crossover"])
    never = next(run for run in results["sweep"] if run["threshold"] >= 10**9)
    assert set(never["decisions"]) == {"direct/below_threshold"}
    assert all(run["summary"]["all"]["errors"] == 0 for run in results["sweep"])
    assert_plots(results, tmp_path)


def test_affinity_serves_follow_ups_direct_on_the_first_steps_decoder(tmp_path: Path) -> None:
    results = run_scenario("affinity", tmp_path)
    runs = {run["setup"]: run for run in results["runs"]}
    later = [row for row in runs["affinity"]["steps"] if row["step"] > 1]
    assert later and all(row["path"] == "direct" and row["ttft"] is not None for row in later)
    assert all(row["prefilled"] for row in runs["no-affinity"]["steps"])
    assert [row["same_decoder"] for row in results["by_step"]["affinity"]] == [2, 2, 2]


def test_conversation_reads_each_turns_tokenize_stage_with_and_without_pieces(tmp_path: Path) -> None:
    results = run_scenario("conversation", tmp_path)
    for setup in ("pieces", "no-pieces"):
        turns = results["by_turn"][setup]
        assert [turn["turn"] for turn in turns] == [1, 2, 3]
        assert all(turn["tokenize_p50"] > 0 for turn in turns)
        assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]


def test_memory_samples_router_rss_and_sizes_the_prefix_index(tmp_path: Path) -> None:
    results = run_scenario("memory", tmp_path)

    streams = results["streams"]
    assert streams["summary"]["errors"] == 0
    assert streams["peak_rss"] >= streams["idle_rss"] > 0
    index = results["prefix_index"]
    assert "error" not in index, index.get("error")
    assert 0 < index["blocks_held"] <= index["capacity_blocks"]
    probes = results["probes"]
    assert [(row["round"], row["probe"]) for row in probes["probes"]] == [
        (round_, probe) for round_ in (1, 2) for probe in ("fuzz", "burst", "disconnects")
    ]
    assert all(row["after_rss"] > 0 and row["peak_rss"] > 0 for row in probes["probes"])
    assert not [e for row in probes["probes"] for e in row["what"].get("server_errors", [])], "no 5xx on the fuzz"
    assert "Size after each round" in (tmp_path / "results.md").read_text()
    assert_plots(results, tmp_path)


@pytest.mark.parametrize(
    ("spec", "first"),
    [("D(4096,256)", ("D(4096,256)", 4096, 256)), ("U(10,10)/(3,3)", ("U(10,10)/(3,3)", 10, 3))],
)
def test_workload_specs_use_genai_bench_notation(spec: str, first: tuple[str, int, int]) -> None:
    from benchmarks.workload import Workload

    assert Workload.parse(spec).draw(3)[0] == first


def test_a_mixture_keeps_its_proportions_in_small_runs() -> None:
    from benchmarks.workload import FINANCE_MIX_SCALED, Workload

    drawn = Workload.parse(FINANCE_MIX_SCALED).draw(20, seed=3)

    counts = {name: sum(1 for cls, _, _ in drawn if cls == name) for name in ("short", "long", "huge")}
    assert counts == {"short": 14, "long": 5, "huge": 1}
    assert all(128 <= tokens < 1024 for cls, tokens, _ in drawn if cls == "short")


def test_prompts_have_the_exact_token_count_and_differ_from_the_first_token() -> None:
    from benchmarks.workload import PromptFactory

    from dpd_sim.tokenizer_kit import ensure_tokenizer

    factory = PromptFactory(ensure_tokenizer())
    prompts = [factory.prompt(index, 300) for index in range(3)]

    assert [factory.count(p) for p in prompts] == [300, 300, 300]
    assert len({p[:20] for p in prompts}) == 3


def test_capacity_drives_every_setup_with_wrk_and_counts_router_cpu(tmp_path: Path) -> None:
    required_tool("wrk", package="wrk", purpose="the capacity benchmark's smoke test")
    results = run_scenario("capacity", tmp_path, timeout=240)

    assert {(row["cell"], row["setup"]) for row in results["rows"]} == {
        (cell, setup)
        for cell in ("whole short c=1", "whole short c=64", "stream short c=1", "stream short c=64", "whole 32k c=1")
        for setup in ("direct", "dpd-router", "dpd-router-w2")
    }
    assert all(run["summary"]["requests"] > 0 and run["summary"]["errors"] == 0 for run in results["runs"])
    routed = [row for row in results["rows"] if row["setup"] != "direct"]
    assert all(row["cpu_ms_per_request"] > 0 and row["added_p50"] is not None for row in routed)
    assert "router CPU ms/req" in (tmp_path / "results.md").read_text()


def test_stages_puts_every_sample_of_each_load_in_one_stage_beside_the_floor(tmp_path: Path) -> None:
    from benchmarks.stages import STAGES, find_py_spy

    from benchmarks import stack

    required_tool("wrk", package="wrk", purpose="the per-stage benchmark's smoke test")
    if find_py_spy() is None:  # the test extra installs it
        pytest.fail("the per-stage benchmark needs py-spy: pip install -e '.[test]'")
    results = run_scenario("stages", tmp_path, timeout=180)

    assert all(run["summary"]["requests"] > 0 and run["summary"]["errors"] == 0 for run in results["runs"])
    # vllm-router serves the floor's loads too where it is installed (benchmarks/.venvs/vllm-router).
    peer = stack.vllm_router_binary().exists()
    assert {(run["setup"], run["load"]) for run in results["runs"]} == {
        *((setup, load) for setup in ("dpd-router", "dpd-router, py-spy") for load in "abcdef"),
        *(
            (setup, load)
            for setup in ("floor", "floor, py-spy", "floor, slowed", *(["vllm-router"] if peer else []))
            for load in "abf"
        ),
    }
    for run in results["runs"]:  # every timed run's CPU, told apart in the process's own code and the kernel's
        summary = run["summary"]
        if summary.get("cpu_ms_per_request") is not None:
            parts = summary["cpu_user_ms_per_request"] + summary["cpu_system_ms_per_request"]
            assert parts == pytest.approx(summary["cpu_ms_per_request"])
    # The slowed floor spins what the router's own code took over the floor's in its round (the router's more).
    assert all(run["burn_us"] > 0 for run in results["runs"] if run["setup"] == "floor, slowed")
    profiles = [(load, results["profiles"][load]) for load in "abcdef"]
    profiles += [(f"{load}-floor", results["floor_profiles"][load]) for load in "abf"]
    for column, profile in profiles:
        assert profile["samples"] > 0
        assert set(profile["stages"]) == set(STAGES) and sum(profile["stages"].values()) == profile["samples"]
        assert sum(profile["shares"].values()) == pytest.approx(1.0)
        assert sum(row[column]["share"] for row in results["table"]) == pytest.approx(1.0)
    # The floor does nothing of the router's own: no sample of it is the router's tokenizing, planning or finish.
    for load in "abf":
        floor = results["floor_profiles"][load]["stages"]
        assert floor["tokenize"] == floor["plan"] == floor["finish"] == 0 and floor["listener & ASGI"] > 0
    for load in "abcdef":
        decisions = {
            key for run in results["runs"] if run["load"] == load and "decisions" in run for key in run["decisions"]
        }
        assert decisions == ({"direct/below_threshold"} if load in "abef" else {"disaggregated/long_prompt"})
    text = (tmp_path / "results.md").read_text()
    assert "(a) on the floor" in text and "**total**" in text and "Top 10 leaf functions" in text
    assert "of it, in the kernel" in text and "floor slowed to the router's rate" in text


def test_arms_runs_both_arms_through_one_router_and_advise_names_them(tmp_path: Path) -> None:
    results = run_scenario("arms", tmp_path)

    ab = results["ab"]
    assert ab["summary"]["all"]["errors"] == 0 and ab["summary"]["all"]["requests"] == 16
    assert all(run["summary"]["all"]["errors"] == 0 for run in results["static"])
    assert [run["arm"] for run in results["static"]] == ["t256", "t4096"]
    assert set(ab["arm_requests"]) == {"t256", "t4096"}  # sessions fell in both arms
    assert sum(ab["arm_requests"].values()) == 16
    final = ab["checkpoints"][-1]
    assert final["arms"]["arms"] == ["t256", "t4096"]
    assert results["comparison"]
    text = (tmp_path / "results.md").read_text()
    assert "t256" in text and "t4096" in text and "advise (A/B arms)" in text
    assert "t4096" in (tmp_path / "advise.md").read_text()
    assert_plots(results, tmp_path)
