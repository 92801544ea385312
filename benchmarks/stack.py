"""The setups a benchmark drives: simulated engines, dpd-router, vllm-router, each a real process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dpd_sim.cluster import SimCluster
from dpd_sim.gpu import TimingModel
from dpd_sim.ports import BIND_ATTEMPTS, free_port, port_taken
from dpd_sim.tokenizer_kit import ensure_tokenizer

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
VENVS = Path(__file__).resolve().parent / ".venvs"
MODEL = "sim-model"

NEAR_ZERO = TimingModel(
    prefill_overhead=0.0,
    prefill_per_token=0.0,
    decode_step_base=0.0,
    decode_step_per_kv_token=0.0,
    kv_transfer_per_token=0.0,
)
"""An engine that answers as fast as its Python can: what is left is HTTP, parsing and the router."""


def timing_args(timing: TimingModel | str) -> list[str]:
    """Engine flags for a timing preset name or an explicit model."""
    if isinstance(timing, str):
        return ["--timing", timing]
    args = []
    for name in TimingModel.__dataclass_fields__:
        args += ["--" + name.replace("_", "-"), repr(getattr(timing, name))]
    return args


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process, from /proc (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time a process has used."""
    split = cpu_split(pid)
    return None if split is None else sum(split)


def cpu_split(pid: int) -> tuple[float, float] | None:
    """The CPU time a process has used, in its own code and libraries (user) and in the kernel's (system)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


# Flags whose value is a port the process binds besides the one it serves on: chosen again too.
_PORT_FLAGS = ("--prometheus-port",)


class _PortTaken(Exception):
    """The process exited because a port it was given was bound by another first."""


@dataclass
class Service:
    """A server process we started; `url` is its base URL."""

    name: str
    argv: list[str]
    port: int
    ready_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log_tail(self, limit: int = 3000) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    async def start(self, wait: float = 60.0) -> Service:
        """Start the process and wait until `ready_path` answers 200.

        A port chosen free can be taken by another process before this one binds it (tests and
        benchmarks start servers side by side; seen in CI as uvicorn's "address already in use"):
        such a start is tried again on fresh ports, a few times.
        """
        for attempt in range(BIND_ATTEMPTS):
            try:
                return await self._start_once(wait)
            except _PortTaken:
                tail = self.log_tail()
                if self.log_path is not None:
                    self.log_path.unlink(missing_ok=True)
                if attempt == BIND_ATTEMPTS - 1:
                    raise RuntimeError(f"{self.name} found its ports taken {BIND_ATTEMPTS} times:\n{tail}") from None
                self._repick_ports()
        raise AssertionError("unreachable")

    def _repick_ports(self) -> None:
        """Fresh ports for the one `url` names (as a flag's value or a positional argument) and
        for every other port flag."""
        served, self.port = str(self.port), free_port()
        for i, arg in enumerate(self.argv):
            flag = self.argv[i - 1] if i > 0 else ""
            if arg == served and (flag == "--port" or not flag.startswith("--")):
                self.argv[i] = str(self.port)
            elif flag in _PORT_FLAGS:
                self.argv[i] = str(free_port())

    async def _start_once(self, wait: float) -> Service:
        fd, name = tempfile.mkstemp(prefix=f"bench-{self.name}-", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(  # noqa: ASYNC220 - a quick fork; waiting happens below
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                cwd=ROOT,
            )
        deadline = time.monotonic() + wait
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    if port_taken(self.log_tail(100_000)):
                        raise _PortTaken(self.name)
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + self.ready_path)).status_code == 200:
                        return self
                await asyncio.sleep(0.1)
        await self.stop()
        raise RuntimeError(f"{self.name} not ready after {wait:.0f}s:\n{self.log_tail()}")

    async def stop(self, grace: float = 5.0) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while process.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - Popen has no event
                await asyncio.sleep(0.05)
            if process.poll() is None:
                process.kill()
                process.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


def dpd_router(
    *,
    decode: Sequence[str],
    prefill: Sequence[str] = (),
    threshold: int = 4096,
    tokenizer: Path | None = None,
    settings: dict[str, object] | None = None,
    name: str = "dpd-router",
) -> Service:
    """`dpd-router serve` as a process; `settings` become DPD_<NAME> environment variables."""
    port = free_port()
    argv = [sys.executable, "-m", "dpd_router.cli", "serve", "--host", HOST, "--port", str(port), "--model", MODEL]
    argv += ["--tokenizer", str(tokenizer or ensure_tokenizer()), "--routing-threshold", str(threshold)]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    # The router's own defaults throughout (health probes, logging one line per request at info, ...).
    env: dict[str, str] = {}
    env.update({f"DPD_{key.upper()}": str(value) for key, value in (settings or {}).items()})
    return Service(name, argv, port, ready_path="/ready", env=env)


def vllm_router_binary() -> Path:
    return VENVS / "vllm-router" / "bin" / "vllm-router"


def vllm_router(
    *, workers: Sequence[str] = (), prefill: Sequence[str] = (), decode: Sequence[str] = (), name: str = "vllm-router"
) -> Service:
    """vllm-router (Rust, from PyPI, in its own venv): plain mode over `workers`, or PD mode."""
    port = free_port()
    argv = [str(vllm_router_binary()), "--host", HOST, "--port", str(port), "--policy", "round_robin"]
    argv += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
    if prefill:
        argv += ["--vllm-pd-disaggregation"]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
    else:
        argv += ["--worker-urls", *workers]
    return Service(name, argv, port, ready_path="/health")


def production_stack_router(
    *,
    workers: Sequence[str] = (),
    prefill: Sequence[str] = (),
    decode: Sequence[str] = (),
    name: str = "production-stack",
) -> Service:
    """production-stack's router (Python, its own venv): round robin over `workers`, or its
    `disaggregated_prefill` logic (prefiller with max_tokens=1, then the decoder) over labelled backends."""
    port = free_port()
    argv = [str(VENVS / "production-stack" / "bin" / "vllm-router"), "--host", HOST, "--port", str(port)]
    argv += ["--service-discovery", "static", "--log-level", "warning"]
    if prefill:
        backends = [*prefill, *decode]
        labels = ["prefill"] * len(prefill) + ["decode"] * len(decode)
        argv += ["--static-backends", ",".join(backends), "--static-models", ",".join([MODEL] * len(backends))]
        argv += ["--static-model-labels", ",".join(labels), "--routing-logic", "disaggregated_prefill"]
        argv += ["--prefill-model-labels", "prefill", "--decode-model-labels", "decode"]
    else:
        argv += ["--static-backends", ",".join(workers), "--static-models", ",".join([MODEL] * len(workers))]
        argv += ["--routing-logic", "roundrobin"]
    return Service(name, argv, port, ready_path="/health")


@asynccontextmanager
async def engines(
    *,
    prefill: int = 0,
    decode: int = 0,
    both: int = 0,
    timing: TimingModel | str = "default",
    extra_args: Sequence[str] = (),
) -> AsyncIterator[SimCluster]:
    """Simulated engines as processes (SimCluster), with one timing model for all."""
    cluster = SimCluster(
        prefill=prefill,
        decode=decode,
        both=both,
        tokenizer=ensure_tokenizer(),
        model=MODEL,
        extra_args=[*timing_args(timing), *extra_args],
        startup_timeout=60.0,
    )
    async with cluster:
        yield cluster


@asynccontextmanager
async def running(*services: Service) -> AsyncIterator[tuple[Service, ...]]:
    """Start services (in parallel) and stop them all on the way out."""
    try:
        await asyncio.gather(*(service.start() for service in services))
        yield services
    finally:
        await asyncio.gather(*(service.stop() for service in services), return_exceptions=True)


def engine_pids(cluster: SimCluster) -> list[int]:
    return [engine.process.pid for engine in cluster.engines if engine.process is not None]


async def route_decisions(router_url: str) -> dict[str, float]:
    """dpd-router's `route_decisions_total` by `path/reason` (to check where a run's requests went)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=5.0) as client:
        text = (await client.get(router_url + "/metrics")).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dpd_router_route_decisions_total":
                key = f"{sample.labels.get('path')}/{sample.labels.get('reason')}"
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def decisions_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {key: int(after[key] - before.get(key, 0.0)) for key in after if after[key] - before.get(key, 0.0) > 0}


def run_async(main: Any) -> Any:
    """asyncio.run on uvloop; SIGTERM unwinds like Ctrl-C, so every engine and router started is stopped."""

    def terminate(_signum: int, _frame: Any) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, terminate)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(main)
