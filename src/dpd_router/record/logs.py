"""Logging setup: one JSON object per line by default, or plain text, written by a thread of its own."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, TextIO

import orjson

_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", ...fields}`: the record's `fields` extra is merged in."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """`time level logger message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line += " " + " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
        return line


class LineWriter(logging.Handler):
    """Formats each record where it is logged and writes the lines from a thread of its own, those of
    `interval` seconds at once.

    A request's log line written at once costs the event loop a write to stderr (a syscall, and a wait if
    the pipe behind it is full) on every request. Here the loop only appends the line; the writer thread
    writes what has gathered every `interval` seconds, at once for a warning or worse (so nothing that
    explains a failure waits), and when the handler is flushed or closed (logging's exit hook does both).

    Closed (at exit, or by a `logging.config` call that closes every handler it finds while loggers keep
    this one), it writes each line as it is logged: no line waits for a writer that is gone. While stderr
    does not keep up, at most `pending` lines wait; those past it are dropped, and counted in a line of
    their own once the writer is through, so a stalled log pipe costs lines, never unbounded memory.
    """

    def __init__(self, stream: TextIO, *, interval: float = 0.05, most: int = 1024, pending: int = 50_000) -> None:
        super().__init__()
        self._stream = stream
        self._interval = interval
        self._most = most
        self._pending = pending
        self._dropped = 0
        self._lines: list[str] = []
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        # Under the handler's lock (Handler.handle), as the writer takes the lines.
        if self._closed:
            self._write([line])
            return
        if len(self._lines) >= self._pending:
            self._dropped += 1
            return
        self._lines.append(line)
        if record.levelno >= logging.WARNING or len(self._lines) >= self._most:
            self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._interval)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        # The lines are taken under the handler's lock and written outside it: a slow stderr holds up the
        # writer, never a thread that logs.
        with self.lock:  # type: ignore[union-attr]  # Handler.createLock made it
            lines, self._lines = self._lines, []
            dropped, self._dropped = self._dropped, 0
        if dropped:
            lines.append(self._dropped_line(dropped))
        if lines:
            self._write(lines)

    def _write(self, lines: list[str]) -> None:
        try:
            self._stream.write("\n".join(lines) + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            pass  # stderr closed or gone: nowhere to write, and nothing to raise into

    def _dropped_line(self, dropped: int) -> str:
        notice = logging.makeLogRecord(
            {
                "name": "dpd_router.logs",
                "levelno": logging.WARNING,
                "levelname": "WARNING",
                "msg": "%d log lines dropped: stderr did not keep up (%d lines may wait)",
                "args": (dropped, self._pending),
            }
        )
        return self.format(notice)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self.flush()
        super().close()


def configure_logging(level: str, fmt: str) -> None:
    # What every record would look up and the formatters never write: the process, thread and process name,
    # and the file and line that logged it (found by walking the caller's frames: 1 us of a request line's
    # 7.6 here). The logging HOWTO's own advice for a logger on a hot path.
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    logging._srcfile = None
    handler = LineWriter(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("dpd_router")
    for old in root.handlers:
        old.close()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # uvicorn's own lines (a malformed request, a server error) in the same format, through the same writer;
    # their level is the server's (build_server leaves uvicorn's logging configuration out).
    listener = logging.getLogger("uvicorn")
    listener.handlers[:] = [handler]
    listener.propagate = False
