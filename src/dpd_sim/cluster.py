"""Start simulated engines on 127.0.0.1, for tests, demos and benchmarks: as real processes, or served
inside the caller's event loop where a test is not about processes (no interpreter to start)."""

from __future__ import annotations

import asyncio
import contextlib
import io
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
from typing import TYPE_CHECKING

import httpx

from dpd_sim.config import Role
from dpd_sim.ports import BIND_ATTEMPTS, free_ports, port_taken
from dpd_sim.tokenizer_kit import ensure_tokenizer

if TYPE_CHECKING:
    import uvicorn

HOST = "127.0.0.1"


class EngineStartError(RuntimeError):
    """An engine process died or did not become healthy in time."""


@dataclass
class SimEngine:
    """One engine of a cluster: a process, or a server in the cluster's event loop."""

    name: str
    role: Role
    port: int
    log_path: Path
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    kv_events_port: int | None = None
    server: uvicorn.Server | None = field(default=None, repr=False)
    serving: asyncio.Task[None] | None = field(default=None, repr=False)
    listener: socket.socket | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def kv_events_address(self) -> str | None:
        """The ZMQ address its KV events are published on (None unless the cluster publishes them)."""
        return None if self.kv_events_port is None else f"tcp://{HOST}:{self.kv_events_port}"

    @property
    def alive(self) -> bool:
        if self.serving is not None:
            return not self.serving.done()
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

    With `in_process=True` each engine is the same app (`create_app`, from the same arguments) served by
    uvicorn inside the caller's event loop on a socket bound before it starts: nothing to spawn or import,
    no port to race for. What needs a process stays with processes: `kill` (a crash) is refused there.
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
        in_process: bool = False,
    ) -> None:
        self.in_process = in_process
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
                listener = _listener(0) if self.in_process else None
                port = listener.getsockname()[1] if listener is not None else ports.pop()
                kv_events_port = ports.pop() if self.kv_events else None
                self.engines.append(
                    SimEngine(
                        name,
                        role,
                        port,
                        self.log_dir / f"{name}.log",
                        kv_events_port=kv_events_port,
                        listener=listener,
                    )
                )
        try:
            if self.in_process:
                await asyncio.gather(*(self._spawn(engine) for engine in self.engines))
            else:
                for engine in self.engines:
                    await self._spawn(engine)
            await asyncio.gather(*(self._wait_started(engine) for engine in self.engines))
        except BaseException:
            await self.stop()
            raise

    async def kill(self, engine: SimEngine) -> None:
        """SIGKILL the engine, as a crash would."""
        if self.in_process:
            raise RuntimeError("a crash needs an engine process: use SimCluster(in_process=False)")
        process = engine.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGKILL)
            await process.wait()

    async def restart(self, engine: SimEngine) -> None:
        """Start the engine again on the same port, with fresh state (killing it first if it still runs;
        an engine in the event loop is shut down instead)."""
        if self.in_process:
            await self._terminate(engine)
        else:
            await self.kill(engine)
        await self._spawn(engine)
        await self._wait_healthy(engine)

    async def stop(self) -> None:
        """SIGTERM every engine, SIGKILL those still running after the grace period."""
        await asyncio.gather(*(self._terminate(engine) for engine in self.engines))
        for engine in self.engines:
            if engine.listener is not None:  # never served (its start failed)
                engine.listener.close()
                engine.listener = None
        if self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None

    async def _spawn(self, engine: SimEngine) -> None:
        args = self._engine_arguments(engine)
        if self.in_process:
            await self._serve_in_loop(engine, args)
            return
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

    def _engine_arguments(self, engine: SimEngine) -> list[str]:
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
        return args

    async def _serve_in_loop(self, engine: SimEngine, args: list[str]) -> None:
        """The engine's app on uvicorn in this event loop; a bad argument fails as the process would."""
        import uvicorn

        from dpd_sim.engine import build_arg_parser, config_from_args, create_app

        complaint = io.StringIO()
        try:
            with contextlib.redirect_stderr(complaint):
                parsed = build_arg_parser().parse_args(args)
        except SystemExit as exc:
            raise EngineStartError(f"engine {engine.name} refused its arguments:\n{complaint.getvalue()}") from exc
        # Loading the tokenizer takes a while: off the loop, where the other engines are starting.
        app = await asyncio.to_thread(lambda: create_app(config_from_args(parsed)))
        config = uvicorn.Config(
            app,
            log_level=parsed.log_level,
            access_log=False,
            lifespan="on",
            loop="none",
            timeout_graceful_shutdown=2,
        )
        sock, engine.listener = engine.listener, None
        if sock is None:  # a restart: the same port again
            try:
                sock = _listener(engine.port)
            except OSError as exc:
                raise EngineStartError(f"engine {engine.name} cannot listen on port {engine.port}: {exc}") from exc
        engine.server = server = uvicorn.Server(config)
        engine.serving = asyncio.create_task(_serve(server, sock), name=f"sim-{engine.name}")

    async def _wait_started(self, engine: SimEngine) -> None:
        """Wait until a spawned engine is healthy; one whose port another process bound first (between
        `free_ports` and its own bind: tests and benchmarks start servers side by side) is spawned
        again on fresh ports, a few times."""
        for attempt in range(BIND_ATTEMPTS):
            try:
                await self._wait_healthy(engine)
                return
            except EngineStartError:
                if engine.process is None or engine.alive or not port_taken(engine.log_tail(100_000)):
                    raise
                if attempt == BIND_ATTEMPTS - 1:
                    raise
            taken = {engine.port} | ({engine.kv_events_port} if engine.kv_events_port is not None else set())
            fresh = free_ports(len(taken), taken=taken)
            engine.port = fresh.pop()
            if engine.kv_events_port is not None:
                engine.kv_events_port = fresh.pop()
            engine.log_path.unlink(missing_ok=True)
            await self._spawn(engine)

    async def _wait_healthy(self, engine: SimEngine) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout
        async with httpx.AsyncClient(timeout=1.0) as client:
            while loop.time() < deadline:
                if engine.serving is not None and engine.serving.done():
                    failure = engine.serving.exception() if not engine.serving.cancelled() else None
                    raise EngineStartError(f"engine {engine.name} stopped while starting: {failure!r}")
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
        if engine.serving is not None:
            await _shut_down(engine)
            return
        process = engine.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), self.stop_grace)
        except TimeoutError:
            await self.kill(engine)


def _listener(port: int) -> socket.socket:
    """A socket bound to the port (0: one the OS picks), held until the engine's server takes it. Its
    protocol named, so that asyncio turns Nagle's algorithm off on the connections it accepts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError:
        sock.close()
        raise
    return sock


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()


async def _shut_down(engine: SimEngine) -> None:
    """Stop an engine served in the loop as SIGTERM stops a process: open streams get the grace, then go."""
    server, serving = engine.server, engine.serving
    engine.server = engine.serving = None
    if server is None or serving is None or serving.done():
        return
    server.should_exit = True
    try:
        await asyncio.wait_for(asyncio.shield(serving), timeout=10)
    except TimeoutError:
        server.force_exit = True
        await serving


def _returncode(engine: SimEngine) -> int | None:
    return engine.process.returncode if engine.process is not None else None
