"""Outside load tools and peers, each in its own venv under benchmarks/.venvs (never project dependencies).

- genai-bench (PyPI), the seed's load tool: fixed-length scenarios at a concurrency;
- vllm-router==0.1.17 (PyPI, Rust), the peer router;
- production-stack's Python router, from a checkout of its repository (`ensure_production_stack`);
- py-spy and pyinstrument, for profiling the router when a target is missed.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.stack import MODEL, VENVS
from dpd_sim.tokenizer_kit import ensure_tokenizer

PACKAGES = {
    "genai-bench": ["genai-bench", "py-spy", "pyinstrument"],
    "vllm-router": ["vllm-router==0.1.17"],
}
BINARIES = {"genai-bench": "genai-bench", "vllm-router": "vllm-router"}


def venv_binary(name: str, binary: str | None = None) -> Path:
    return VENVS / name / "bin" / (binary or BINARIES[name])


def ensure_venv(name: str) -> Path:
    """Create benchmarks/.venvs/NAME with its packages unless its binary is already there."""
    binary = venv_binary(name)
    if binary.exists():
        return binary
    python = shutil.which("python3") or sys.executable
    target = VENVS / name
    print(f"installing {' '.join(PACKAGES[name])} into {target} (a minute or two) ...", file=sys.stderr, flush=True)
    subprocess.run([python, "-m", "venv", str(target)], check=True)
    subprocess.run([str(target / "bin" / "pip"), "install", "--quiet", *PACKAGES[name]], check=True)
    return binary


def ensure_production_stack(source: Path) -> Path:
    """production-stack's Python router, installed from a checkout of its repository (it is not on PyPI
    under its own name: PyPI's `vllm-router` is the Rust one) into benchmarks/.venvs/production-stack.
    It needs Python 3.12 or newer."""
    binary = VENVS / "production-stack" / "bin" / "vllm-router"
    if binary.exists():
        return binary
    if not (source / "src" / "vllm_router").is_dir():
        raise FileNotFoundError(f"{source} is not a production-stack checkout (no src/vllm_router)")
    python = next((candidate for candidate in _pythons("3.12", "3.13") if _runs(candidate)), None)
    if python is None:
        raise FileNotFoundError("production-stack's router needs a working python3.12 or python3.13")
    target = VENVS / "production-stack"
    print(f"installing production-stack's router from {source} into {target} ...", file=sys.stderr, flush=True)
    subprocess.run([python, "-m", "venv", str(target)], check=True)
    env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION": "0.0.0+checkout"}  # a source archive has no git tags
    subprocess.run([str(target / "bin" / "pip"), "install", "--quiet", str(source)], check=True, env=env)
    return binary


def _pythons(*versions: str) -> list[str]:
    """Interpreters of these versions: on PATH, then pyenv's (whose shims fail for a version not selected)."""
    found = [path for version in versions if (path := shutil.which(f"python{version}"))]
    for version in versions:
        pattern = Path.home() / ".pyenv" / "versions" / f"{version}.*" / "bin" / f"python{version}"
        found += sorted(glob.glob(str(pattern)))
    return found


def _runs(python: str) -> bool:
    return subprocess.run([python, "--version"], capture_output=True, check=False).returncode == 0


def have(name: str) -> bool:
    return venv_binary(name).exists()


async def genai_bench(
    base_url: str,
    scenario: str,
    concurrency: int,
    *,
    max_requests: int,
    max_minutes: int = 3,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    """One genai-bench run (one scenario, one concurrency) against `base_url`; its aggregated metrics."""
    binary = ensure_venv("genai-bench")
    workdir = Path(tempfile.mkdtemp(prefix="genai-bench-"))
    argv = [
        str(binary), "benchmark",
        "--api-backend", "openai", "--api-base", base_url, "--api-key", "unused",
        "--api-model-name", MODEL, "--model-tokenizer", str(ensure_tokenizer()),
        "--task", "text-to-text", "--server-engine", "vLLM",
        "--traffic-scenario", scenario, "--num-concurrency", str(concurrency),
        "--max-requests-per-run", str(max_requests), "--max-time-per-run", str(max_minutes),
        "--experiment-base-dir", str(workdir), "--experiment-folder-name", "run",
        "--log-dir", str(workdir),
        "--additional-request-params", json.dumps({"ignore_eos": True, "temperature": 0.0}),
        *(extra or []),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=workdir, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=max_minutes * 60 + 180)
    try:
        files = glob.glob(str(workdir / "run" / "*_num_concurrency_*.json"))
        if process.returncode != 0 or not files:
            raise RuntimeError(f"genai-bench failed ({process.returncode}): {stderr.decode(errors='replace')[-2000:]}")
        with open(files[0]) as handle:  # noqa: ASYNC230 - one small file, once a run
            return json.load(handle)["aggregated_metrics"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def genai_summary(metrics: dict[str, Any]) -> dict[str, Any]:
    """genai-bench's aggregated metrics in our summary's shape (seconds; no per-gap ITL)."""
    stats = metrics["stats"]

    def spread(name: str) -> dict[str, float | None]:
        s = stats.get(name) or {}
        return {"p50": s.get("p50"), "p90": s.get("p90"), "p99": s.get("p99"), "mean": s.get("mean")}

    return {
        "requests": metrics.get("num_requests"),
        "ok": metrics.get("num_completed_requests"),
        "errors": metrics.get("num_error_requests"),
        "wall_s": metrics.get("run_duration"),
        "req_per_s": metrics.get("requests_per_second"),
        "out_tok_per_s": metrics.get("mean_output_throughput_tokens_per_s"),
        "ttft": spread("ttft"),
        "tpot": spread("tpot"),
        "itl": {"p50": None, "p90": None, "p99": None, "mean": None},
        "e2e": spread("e2e_latency"),
    }
