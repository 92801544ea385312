"""Start simulated engines as real processes on 127.0.0.1, for tests, demos and benchmarks."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from dpd_sim.config import Role
from dpd_sim.tokenizer_kit import ensure_tokenizer

HOST = "127.0.0.1"


class EngineStartError(RuntimeError):
    """An engine process died or did not become healthy in time."""


@dataclass
class SimEngine:
    """One engine process of a cluster."""

    name: str
    role: Role
    port: int
    log_path: Path
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    kv_events_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def kv_events_address(self) -> str | None:
        """The ZMQ address its KV events are published on (None unless the cluster publishes them)."""
        return None if self.kv_events_port is None else f"tcp://{HOST}:{self.kv_events_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""


class SimCluster:
    """N simulated engines as subprocesses (`python -m dpd_sim`), each on a free port.

    >>> async with SimCluster(prefill=1, decode=1, tokenizer=path) as cluster:
    ...     cluster.prefill_urls, cluster.decode_urls

    With `kv_events=True` every engine publishes vLLM KV events on a free port of its own
    (`engine.kv_events_address`; `cluster.kv_events_endpoints` maps engine URLs to them, the
    router's `kv_events_endpoints` setting). `engine_args` adds arguments for one engine by name
    (`"prefill-0"`, `"decode-1"`), after `extra_args`.
    """

    def __init__(
        self,
        prefill: int = 2,
        decode: int = 1,
        both: int = 0,
        tokenizer: Path | None = None,
        model: str = "sim-model",
        extra_args: Sequence[str] = (),
        startup_timeout: float = 120.0,
        stop_grace: float = 5.0,
        kv_events: bool = False,
        engine_args: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.counts: dict[Role, int] = {"prefill": prefill, "decode": decode, "both": both}
        self.tokenizer = tokenizer
        self.model = model
        self.extra_args = list(extra_args)
        self.kv_events = kv_events
        self.engine_args = {name: list(args) for name, args in (engine_args or {}).items()}
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.engines: list[SimEngine] = []
        self.log_dir: Path | None = None

    @property
    def prefill_urls(self) -> list[str]:
        return [engine.url for engine in self.engines if engine.role == "prefill"]

    @property
    def decode_urls(self) -> list[str]:
        return [engine.url for engine in self.engines if engine.role == "decode"]

    @property
    def both_urls(self) -> list[str]:
        return [engine.url for engine in self.engines if engine.role == "both"]

    @property
    def kv_events_endpoints(self) -> dict[str, list[str]]:
        """Engine URL -> [its KV events address], for every engine that publishes them."""
        return {engine.url: [address] for engine in self.engines if (address := engine.kv_events_address)}

    def engine(self, name: str) -> SimEngine:
        """The engine called `name` (`"prefill-0"`, `"decode-1"`, ...)."""
        for engine in self.engines:
            if engine.name == name:
                return engine
        raise KeyError(name)

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Spawn every engine and wait until each answers `/health` with 200."""
        self.tokenizer = await asyncio.to_thread(ensure_tokenizer, self.tokenizer)
        self.log_dir = Path(tempfile.mkdtemp(prefix="dpd-sim-"))
        engines = sum(self.counts.values())
        ports = free_ports(engines * 2 if self.kv_events else engines)
        for role, count in self.counts.items():
            for index in range(count):
                name = f"{role}-{index}"
                port = ports.pop()
                kv_events_port = ports.pop() if self.kv_events else None
                self.engines.append(
                    SimEngine(name, role, port, self.log_dir / f"{name}.log", kv_events_port=kv_events_port)
                )
        try:
            for engine in self.engines:
                await self._spawn(engine)
            await asyncio.gather(*(self._wait_healthy(engine) for engine in self.engines))
        except BaseException:
            await self.stop()
            raise

    async def kill(self, engine: SimEngine) -> None:
        """SIGKILL the engine, as a crash would."""
        process = engine.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGKILL)
            await process.wait()

    async def restart(self, engine: SimEngine) -> None:
        """Start the engine again on the same port (killing it first if it still runs)."""
        await self.kill(engine)
        await self._spawn(engine)
        await self._wait_healthy(engine)

    async def stop(self) -> None:
        """SIGTERM every engine, SIGKILL those still running after the grace period."""
        await asyncio.gather(*(self._terminate(engine) for engine in self.engines))
        if self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None

    async def _spawn(self, engine: SimEngine) -> None:
        args = [
            "--role", engine.role,
            "--host", HOST,
            "--port", str(engine.port),
            "--model", self.model,
            "--tokenizer", str(self.tokenizer),
            *self.extra_args,
        ]  # fmt: skip
        if engine.kv_events_port is not None:
            args += ["--kv-events-port", str(engine.kv_events_port)]
        args += self.engine_args.get(engine.name, [])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error"}
        with engine.log_path.open("ab") as log:
            engine.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "dpd_sim",
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
            )

    async def _wait_healthy(self, engine: SimEngine) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout
        async with httpx.AsyncClient(timeout=1.0) as client:
            while loop.time() < deadline:
                if not engine.alive:
                    raise EngineStartError(
                        f"engine {engine.name} exited with {_returncode(engine)} while starting:\n{engine.log_tail()}"
                    )
                try:
                    response = await client.get(engine.url + "/health")
                    if response.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        await self.kill(engine)
        raise EngineStartError(
            f"engine {engine.name} not healthy after {self.startup_timeout:.0f}s:\n{engine.log_tail()}"
        )

    async def _terminate(self, engine: SimEngine) -> None:
        process = engine.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), self.stop_grace)
        except TimeoutError:
            await self.kill(engine)


def free_ports(count: int) -> list[int]:
    """Ports the OS has just handed out; held together while choosing, so they differ."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _returncode(engine: SimEngine) -> int | None:
    return engine.process.returncode if engine.process is not None else None
