"""`dpd-router serve --workers N`: one supervisor process and N workers, each a full router, on one port.

The shape, and why:

- The supervisor binds the listening socket once and hands it to every worker: they all accept
  from it, and the kernel gives each connection to one of them. The port stays bound for the
  supervisor's whole life, so a dying worker loses only the connections it had accepted (not those
  queued behind it, as a socket of its own under SO_REUSEPORT would), and its replacement binds
  nothing.
- Workers are started with multiprocessing's `spawn`: a fresh interpreter each (no event loop,
  threads or locks inherited half-way), given the socket (spawn passes the descriptor) and the
  settings' sources (flags), from which each worker re-reads env and config file. A replacement
  started hours later so runs the configuration as it is then, like its siblings after their reloads.
  uvicorn's own `--workers` supervisor does not fit: it builds the app from an import string with
  its own listener, and the router runs its guarded protocol (server.py) built by app.build_server.
- Metrics: the supervisor points prometheus-client's multiprocess mode at a fresh directory
  (PROMETHEUS_MULTIPROC_DIR, read by prometheus-client at import, hence before any worker starts)
  and removes it at exit; a scrape answered by any worker sums them all (metrics.py). A dead
  worker's live gauges are dropped (`mark_process_dead`) before its replacement starts.
- Admin changes: the supervisor creates a private directory (0700, removed at exit) for the workers'
  change log (change_log.py), named to them by CHANGE_LOG_ENV: a `PUT /admin/config` that one worker
  accepts is appended there, and every worker (a replacement too) applies it.
- Signals: SIGTERM or SIGINT drains every worker (each is sent SIGTERM and finishes its requests in
  flight, as a single router does) and the supervisor exits when the last one has; a second SIGINT
  forces them (uvicorn's second Ctrl-C). SIGHUP is forwarded to every worker (each reloads its
  settings, live.py); each worker also watches the config file itself.
- A worker that dies is logged and replaced, after a delay that doubles while replacements keep
  dying young (up to MAX_BACKOFF), so a crash loop does not spin.

Everything else is per process: each worker keeps its own limits (its share of them: config.py's
`workers`, unless `limits_store` shares them), health checks, breaker states, prefix index, shadow
queue and adaptive model.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

from dpd_router import change_log
from dpd_router.config import Settings, SettingsError, load_settings
from dpd_router.record.metrics import MULTIPROC_DIR_ENV

log = logging.getLogger("dpd_router.supervisor")

MIN_BACKOFF = 0.5
MAX_BACKOFF = 30.0
# A worker that ran this long before dying was not crash-looping: its replacement starts at once.
STABLE_AFTER = 30.0
BACKLOG = 2048  # uvicorn's default


def serve_workers(settings: Settings) -> int:
    """Run `settings.workers` routers on settings.host:settings.port until SIGTERM or SIGINT; returns the exit code."""
    if settings.kv_connector == "lmcache":
        # Every worker would bind the one address the prefillers send their notifications to.
        raise SettingsError("workers > 1 cannot serve kv_connector lmcache (one process binds lmcache_notify_address)")
    sock = bind(settings.host, settings.port)
    metrics_dir = tempfile.mkdtemp(prefix="dpd-router-metrics-")
    changes_dir = tempfile.mkdtemp(prefix="dpd-router-changes-")  # 0700: the log may hold the shadow's key
    # Spawned workers inherit these.
    shared = {
        MULTIPROC_DIR_ENV: metrics_dir,
        change_log.CHANGE_LOG_ENV: str(change_log.create(Path(changes_dir))),
        change_log.SUPERVISOR_ENV: str(os.getpid()),
    }
    previous = {name: os.environ.get(name) for name in shared}
    os.environ.update(shared)
    try:
        return Supervisor(settings, sock, metrics_dir).run()
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(changes_dir, ignore_errors=True)
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def bind(host: str, port: int) -> socket.socket:
    """The listening socket every worker accepts from (as uvicorn binds its own)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SettingsError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


@dataclass
class Slot:
    """One worker's place: the process in it now, and when to start the next after a death."""

    index: int
    process: BaseProcess | None = None
    started_at: float = 0.0
    backoff: float = MIN_BACKOFF
    restart_at: float | None = None


class Supervisor:
    def __init__(self, settings: Settings, sock: socket.socket, metrics_dir: str) -> None:
        self._settings = settings
        self._sock = sock
        self._metrics_dir = metrics_dir
        self._context = multiprocessing.get_context("spawn")
        self._slots = [Slot(index) for index in range(settings.workers)]
        self._stopping = False

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_sighup)
        host, port = self._sock.getsockname()[:2]
        log.info("supervising %d router workers on %s:%d", len(self._slots), host, port)
        for slot in self._slots:
            self._start(slot)
        while True:
            running = [slot.process for slot in self._slots if slot.process is not None]
            if self._stopping:
                # Here, not in the handler, which may have run while a worker's start was passing the socket on.
                self._sock.close()  # the workers close theirs as they drain: new connections are refused, not queued
                if not running:
                    break
            multiprocessing.connection.wait([process.sentinel for process in running], timeout=MIN_BACKOFF)
            now = time.monotonic()
            for slot in self._slots:
                if slot.process is not None and not slot.process.is_alive():
                    self._reap(slot, now)
                if slot.restart_at is not None and slot.restart_at <= now and not self._stopping:
                    self._start(slot)
        log.info("every router worker has stopped")
        return 0

    def _start(self, slot: Slot) -> None:
        process = self._context.Process(
            target=run_worker,
            # `workers` pinned: a replacement keeps the share of the limits its siblings keep, whatever the file says.
            args=({**self._settings._overrides, "workers": len(self._slots)}, self._sock, slot.index),
            name=f"dpd-router-worker-{slot.index}",
        )
        process.start()
        slot.process, slot.started_at, slot.restart_at = process, time.monotonic(), None
        if self._stopping and process.pid is not None:  # the stop signal came while it was starting
            os.kill(process.pid, signal.SIGTERM)
        log.info("router worker %d started (pid %s)", slot.index, process.pid, extra={"fields": {"pid": process.pid}})

    def _reap(self, slot: Slot, now: float) -> None:
        from prometheus_client import multiprocess

        process = slot.process
        assert process is not None and process.pid is not None
        process.join()
        slot.process = None
        multiprocess.mark_process_dead(process.pid, self._metrics_dir)  # type: ignore[no-untyped-call]  # untyped upstream
        if self._stopping:
            log.info("router worker %d (pid %d) stopped, exit code %s", slot.index, process.pid, process.exitcode)
            return
        lived = now - slot.started_at
        if lived >= STABLE_AFTER:
            slot.backoff, delay = MIN_BACKOFF, 0.0
        else:
            delay, slot.backoff = slot.backoff, min(slot.backoff * 2, MAX_BACKOFF)
        slot.restart_at = now + delay
        log.error(
            "router worker %d (pid %d) died with exit code %s after %.1f s; replacing it in %.1f s",
            slot.index,
            process.pid,
            process.exitcode,
            lived,
            delay,
            extra={"fields": {"pid": process.pid, "exit_code": process.exitcode}},
        )

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        # The first signal drains (SIGTERM: uvicorn's graceful shutdown); a second SIGINT forces,
        # as a second Ctrl-C does a single router. (From a terminal, the workers get its SIGINT too.)
        forced = self._stopping and signum == signal.SIGINT
        if not self._stopping:
            log.info("draining every router worker (signal %s)", signal.Signals(signum).name)
        self._stopping = True
        self._signal_workers(signal.SIGINT if forced else signal.SIGTERM)

    def _on_sighup(self, signum: int, frame: FrameType | None) -> None:
        if not self._stopping:  # a draining worker may have given up its SIGHUP handler: the signal would end it
            self._signal_workers(signal.SIGHUP)

    def _signal_workers(self, signum: int) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.pid is not None and slot.process.is_alive():
                with contextlib.suppress(ProcessLookupError):  # it just died; the loop reaps it
                    os.kill(slot.process.pid, signum)


def run_worker(overrides: dict[str, Any], sock: socket.socket, index: int) -> None:
    """A worker process: one full router serving `sock` (settings read afresh from `overrides`' sources)."""
    # Until the router's own handler is installed (live.py), a forwarded SIGHUP must not end the worker.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from dpd_router.app import build_server
    from dpd_router.record.logs import configure_logging

    try:
        settings = load_settings(**overrides)
    except SettingsError as exc:
        logging.basicConfig()
        log.error("router worker %d cannot read its settings: %s", index, exc)
        raise SystemExit(2) from None
    configure_logging(settings.log_level, settings.log_format)
    build_server(settings).run(sockets=[sock])
