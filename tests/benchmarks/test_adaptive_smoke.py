"""The adaptive-threshold benchmark (benchmarks/adaptive.py), run end to end at a tiny size.

Real simulated engines and dpd-router processes on 127.0.0.1 with fast engine timing and a handful
of requests; the numbers are not checked, only that every request succeeded, the effective
threshold was scraped, and the reports exist.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import adaptive
from tests.benchmarks.test_scenarios_smoke import HAVE_MATPLOTLIB, run_scenario


def test_adaptive_sweeps_converges_and_follows_a_load_change(tmp_path: Path) -> None:
    results = run_scenario(
        "adaptive", tmp_path, "--itl-slo", "0.5", "--itl-slo-share", "0.01", "--objective-slos", timeout=300
    )
    assert (tmp_path / "results.md").read_text().startswith("# Scenario 5")

    assert [run["threshold"] for run in results["sweep"]] == [256, 4096]
    assert results["best"]["threshold"] in (256, 4096)
    assert all(run["summary"]["all"]["errors"] == 0 for run in results["sweep"] + results["converge"])
    assert all("reached" in run["verdict"] for run in results["converge"])
    # Part B: adaptive from the bad start, alone, with --itl-slo and told the objective (--objective-slos:
    # the TTFT budget for the short class's prompts, those below the long class's 600 tokens).
    assert [(run["mode"], run["threshold"]) for run in results["converge"]] == [
        ("adaptive", 256),
        ("adaptive+itl500ms@1%", 256),
        ("adaptive+slo5s<=599+itl500ms", 256),
    ]
    # The load change: the best static threshold, the --change-static one (256), then adaptive: alone,
    # with ttft_slo (--slo-variant, on by default), with --itl-slo and told the objective.
    runs = [(run["mode"], run["threshold"]) for run in results["change"]]
    statics = {threshold for mode, threshold in runs if mode == "static"}
    assert statics == {results["best"]["threshold"], 256}
    adaptive_modes = ["adaptive", "adaptive+slo5s", "adaptive+itl500ms@1%", "adaptive+slo5s<=599+itl500ms"]
    assert [mode for mode, _ in runs] == ["static"] * len(statics) + adaptive_modes
    for run in results["change"]:
        assert [phase["phase"] for phase in run["phases"]] == ["quiet-1", "busy", "quiet-2"]
        assert all(phase["summary"]["all"]["errors"] == 0 for phase in run["phases"])
    adaptive = next(run for run in results["change"] if run["mode"] == "adaptive")
    assert adaptive["threshold_samples"], "the adaptive router's effective threshold was never scraped"
    assert {v["static"] for v in results["change_verdicts"]} == statics
    # The other workloads (the smoke run's one): swept, then adaptive from the bad start, alone and with
    # --itl-slo, each with a verdict.
    (workload,) = results["workloads"]
    assert [run["threshold"] for run in workload["sweep"]] == [256, 4096]
    assert workload["best"]["threshold"] in (256, 4096)
    assert workload["warmup"] == 5  # 2.5 rounds of its concurrency (2), more than --warmup's 4
    assert workload["think"] == 0.05  # its users pause between requests
    assert [(run["mode"], run["threshold"]) for run in workload["converge"]] == [
        ("adaptive", 256),
        ("adaptive+itl500ms@1%", 256),
        ("adaptive+slo5s+itl500ms", 256),  # one class: the TTFT budget holds for every prompt
    ]
    assert all(run["summary"]["all"]["errors"] == 0 for run in workload["sweep"] + workload["converge"])
    assert all("reached" in run["verdict"] for run in workload["converge"])
    assert all(run["learned"] for run in workload["converge"][1]["runs"]), "adaptive+itl's costs were not scraped"
    md = (tmp_path / "results.md").read_text()
    assert "## D. The other workloads" in md and "adaptive+itl500ms@1% from 256" in md
    assert "The users of D(600,8) pause a random think time between requests (exponential, mean 0.05 s)" in md
    assert "start evenly over its first 0.5 s" in md
    if HAVE_MATPLOTLIB:
        assert results["plots"]
        for name in results["plots"]:
            assert (tmp_path / name).stat().st_size > 1000

    # Skipped parts are kept from the earlier run in the same directory, with where they came from.
    kept = run_scenario("adaptive", tmp_path, "--skip", "sweep", "converge", "change", "workloads", timeout=300)
    for part in ("sweep", "converge", "change", "workloads"):
        assert kept[part] == results[part]
    assert set(kept["carried"]) == {"sweep", "converge", "change", "workloads"}
    assert kept["carried"]["sweep"]["env"] == results["env"]
    assert "Kept from an earlier run" in (tmp_path / "results.md").read_text()


def test_variant_names_say_their_slos() -> None:
    assert adaptive.variant_name("adaptive", None) == "adaptive"
    assert adaptive.variant_name("adaptive", {"ttft_slo": 1.0}) == "adaptive+slo1s"
    assert adaptive.variant_name("adaptive", {"itl_slo": 0.25}) == "adaptive+itl250ms"
    assert adaptive.variant_name("adaptive", {"itl_slo": 0.25, "itl_slo_share": 0.005}) == "adaptive+itl250ms@0.5%"
    args = adaptive.parse_args(["--itl-slo", "0.25", "--itl-slo-share", "0", "0.005"])
    assert adaptive.adaptive_variants(args) == [{"itl_slo": 0.25}, {"itl_slo": 0.25, "itl_slo_share": 0.005}]
    assert adaptive.adaptive_variants(adaptive.parse_args(["--itl-slo", "0.25"])) == [{"itl_slo": 0.25}]
    assert adaptive.adaptive_variants(adaptive.parse_args([])) == []
    # The objective as SLOs: the TTFT budget holds for a mix's short prompts, below the other classes'.
    told = adaptive.parse_args(["--itl-slo", "0.25", "--objective-slos", "--ttft-budget", "1"])
    told.workload = adaptive.SEED_MIX
    assert adaptive.adaptive_variants(told)[-1] == {"itl_slo": 0.25, "ttft_slo": 1.0, "ttft_slo_max_tokens": 4095}
    assert adaptive.variant_name("adaptive", adaptive.objective_slos(told)) == "adaptive+slo1s<=4095+itl250ms"
    told.workload, told.ttft_budget = "D(4096,256)", 2.0
    assert adaptive.objective_slos(told) == {"itl_slo": 0.25, "ttft_slo": 2.0}


def test_only_variants_runs_the_chosen_adaptive_runs_beside_plain_static_ones(tmp_path: Path) -> None:
    results = run_scenario(
        "adaptive", tmp_path, "--skip", "sweep", "converge", "workloads", "--itl-slo", "0.5", "--objective-slos",
        "--only-variants", "+slo", timeout=300,
    )  # fmt: skip
    # The load change alone: the static runs are plain static ones, the adaptive runs only those whose
    # name has "+slo" (ttft_slo alone, and the objective), not plain adaptive nor itl_slo alone.
    modes = [run["mode"] for run in results["change"]]
    assert modes == ["static", "adaptive+slo5s", "adaptive+slo5s<=599+itl500ms"]
    assert all(phase["summary"]["all"]["errors"] == 0 for run in results["change"] for phase in run["phases"])


def test_only_workloads_runs_the_matching_ones_and_keeps_the_others(tmp_path: Path) -> None:
    args = adaptive.parse_args(["--only-workloads", "c=32", "seed", "--out", str(tmp_path)])
    assert [w["name"] for w in args.workloads] == ["seed mix, c=16", "D(4096,256), c=32"]
    with pytest.raises(SystemExit):
        adaptive.parse_args(["--only-workloads", "no such workload"])

    earlier = {
        "env": {"when": "earlier", "commit": "abc1234"},
        "args": {"repeats": 3},
        "workloads": [{"name": w["name"], "run": "earlier"} for w in adaptive.WORKLOADS],
    }
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    results: dict[str, Any] = {
        "workloads": [{"name": "D(4096,256), c=32", "run": "new"}, {"name": "seed mix, c=16", "run": "new"}]
    }
    adaptive.keep_other_workloads(results, args)
    # In WORKLOADS order, the new runs where there are some, the earlier ones marked with where they came from.
    assert [(w["name"], w["run"]) for w in results["workloads"]] == [
        ("seed mix, c=16", "new"),
        ("D(4096,256), c=8", "earlier"),
        ("D(4096,256), c=16", "earlier"),
        ("D(4096,256), c=32", "new"),
    ]
    assert [bool(w.get("measured")) for w in results["workloads"]] == [False, True, True, False]
    assert results["workloads"][1]["measured"]["env"]["commit"] == "abc1234"
