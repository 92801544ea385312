"""The change log of `serve --workers N`: the admin changes every worker applies, in one order.

`PUT /admin/config` reaches the one worker that accepted the connection. So that its siblings (and
a worker started later to replace one) run the same settings, the supervisor creates a directory
(0700) holding one append-only file of JSON lines (0600: a change to `shadow` carries its API key
and headers in clear, so that every worker calls the shadow alike), named to the workers by the
environment variable CHANGE_LOG_ENV. Its lines:

- `{"pid": P, "changes": {setting: value}}`: worker P accepted a PUT; the values are the validated
  settings' JSON.
- `{"pid": P, "reload": true}`: worker P re-read its flags, env and config file (SIGHUP, the file
  changed, POST /admin/reload). A reload sets every live setting from the file, so the changes before
  it no longer count: a worker starting later reads the file and applies the changes after the last
  marker, as its siblings did after their reloads.

Every worker appends to the file and follows it (LiveConfig polls it every POLL_INTERVAL), applying
every change in the file's order, its own included: all of them thus apply the same sequence, and
end with the same settings whatever order two PUTs to two workers raced in. A line is read once it
is whole (ends with a newline), so a line being written is left for the next poll.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, SecretStr
from pydantic_core import to_jsonable_python

from dpd_router.config import Settings

log = logging.getLogger("dpd_router.config")

CHANGE_LOG_ENV = "DPD_ROUTER_CHANGE_LOG"
# The supervisor's pid, so a worker can ask it to reload every worker (it forwards SIGHUP to them all).
SUPERVISOR_ENV = "DPD_ROUTER_SUPERVISOR"
FILE_NAME = "changes.jsonl"
# Seconds between a worker's looks at the file: how long a sibling's PUT takes to reach it, about.
POLL_INTERVAL = 0.5


@dataclass(frozen=True)
class Entry:
    """One line of the log: a worker's accepted changes, or (`changes` None) its reload marker."""

    pid: int
    changes: dict[str, Any] | None

    @property
    def is_reload(self) -> bool:
        return self.changes is None


def create(directory: Path) -> Path:
    """The empty log in `directory` (which the caller made 0700), readable and writable by its owner alone."""
    path = directory / FILE_NAME
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def settings_json(settings: Settings, names: set[str]) -> dict[str, Any]:
    """The settings `names` of `settings` as JSON values, secrets in clear: what a sibling needs to
    build the same Settings (pydantic's JSON dump would mask them)."""
    return {name: to_jsonable_python(_revealed(getattr(settings, name))) for name in sorted(names)}


def _revealed(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, BaseModel):
        return {name: _revealed(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, dict):
        return {key: _revealed(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_revealed(item) for item in value]
    return value


class ChangeLog:
    """One worker's end of the log: it appends its own lines and reads everyone's from where it left off.

    Blocking file calls: LiveConfig runs them in a thread."""

    def __init__(self, path: Path, *, pid: int | None = None, supervisor: int | None = None) -> None:
        self.path = path
        self.pid = os.getpid() if pid is None else pid
        self.supervisor = supervisor
        self._offset = 0  # bytes read: up to the end of the last whole line

    @classmethod
    def from_environment(cls) -> ChangeLog | None:
        """The log the supervisor named to this worker; None for a router that is one process."""
        path = os.environ.get(CHANGE_LOG_ENV)
        supervisor = os.environ.get(SUPERVISOR_ENV, "")
        return cls(Path(path), supervisor=int(supervisor) if supervisor.isdigit() else None) if path else None

    def reload_every_worker(self) -> bool:
        """Ask the supervisor to reload every worker (SIGHUP, which it forwards); False when it is not this
        worker's parent any more (it died: this worker is an orphan, and must not signal whoever adopted it)."""
        if self.supervisor is None or os.getppid() != self.supervisor:
            return False
        try:
            os.kill(self.supervisor, signal.SIGHUP)
        except OSError:
            return False
        return True

    def append_changes(self, changes: dict[str, Any]) -> None:
        self._append({"pid": self.pid, "changes": changes})

    def append_reload(self) -> None:
        self._append({"pid": self.pid, "reload": True})

    def _append(self, entry: dict[str, Any]) -> None:
        line = orjson.dumps(entry) + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            # One write under an exclusive lock: lines of two workers never interleave.
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line)
        finally:
            os.close(fd)

    def has_news(self) -> bool:
        """Whether the file has grown past what this worker has read (a line may still be half-written)."""
        try:
            return self.path.stat().st_size > self._offset
        except OSError:
            return False

    def read_new(self) -> list[Entry]:
        """The whole lines written since the last read, in order; a line still being written waits."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                data = file.read()
        except OSError as exc:
            log.error("cannot read the workers' change log %s: %s", self.path, exc)
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        return list(self._parse(data[:end]))

    def read_since_last_reload(self) -> list[Entry]:
        """For a worker starting: the changes after the last reload marker (all, if none); reads to the end."""
        entries = self.read_new()
        last = max((i for i, entry in enumerate(entries) if entry.is_reload), default=-1)
        return entries[last + 1 :]

    def _parse(self, data: bytes) -> Iterator[Entry]:
        for line in data.splitlines():
            with contextlib.suppress(orjson.JSONDecodeError, TypeError, ValueError):
                value = orjson.loads(line)
                pid = value.get("pid") if isinstance(value, dict) else None
                changes = value.get("changes") if isinstance(value, dict) else None
                if isinstance(pid, int) and value.get("reload") is True:
                    yield Entry(pid, None)
                    continue
                if isinstance(pid, int) and isinstance(changes, dict):
                    yield Entry(pid, changes)
                    continue
            log.error("the workers' change log %s has a line that is not a change: %.200r", self.path, line)
