"""The adaptive-threshold benchmark (benchmarks/adaptive.py), run end to end at a tiny size.

Real simulated engines and dpd-router processes on 127.0.0.1 with fast engine timing and a handful
of requests; the numbers are not checked, only that every request succeeded, the effective
threshold was scraped, and the reports exist.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_adaptive_sweeps_converges_and_follows_a_load_change(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.adaptive", "--smoke", "--quiet", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "results.md").read_text().startswith("# Scenario 5")
    results = json.loads((tmp_path / "results.json").read_text())

    assert [run["threshold"] for run in results["sweep"]] == [256, 4096]
    assert results["best"]["threshold"] in (256, 4096)
    assert all(run["summary"]["all"]["errors"] == 0 for run in results["sweep"] + results["converge"])
    assert all("reached" in run["verdict"] for run in results["converge"])
    modes = [run["mode"] for run in results["change"]]
    assert modes == ["static", "adaptive", "adaptive+slo5s"]
    for run in results["change"]:
        assert [phase["phase"] for phase in run["phases"]] == ["quiet-1", "busy", "quiet-2"]
        assert all(phase["summary"]["all"]["errors"] == 0 for phase in run["phases"])
    adaptive = results["change"][1]
    assert adaptive["threshold_samples"], "the adaptive router's effective threshold was never scraped"
    if HAVE_MATPLOTLIB:
        assert results["plots"]
        for name in results["plots"]:
            assert (tmp_path / name).stat().st_size > 1000
