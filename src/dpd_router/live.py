"""Live configuration: settings that change without a restart or a dropped request.

Changes arrive three ways: the config file changes (watched), the process gets SIGHUP (re-read
flags, env and file), or an operator sends `PUT /admin/config`. Each is validated as a whole
Settings, handed to every part that declared itself `Reconfigurable`, logged and counted. Settings
outside LIVE_SETTINGS (engines, listeners, tokenizer, keys) need a restart: a reload reports them;
a PUT refuses them.

A worker of `serve --workers N` has a fourth way: its siblings' PUTs, which it reads from the
workers' change log (change_log.py) and applies as source `peer`. Its own PUTs go through the log too
(appended, then applied in the log's order with everyone else's), so every worker applies the same
sequence; each reload leaves a marker there, after catching up, for a worker started later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dpd_router.change_log import POLL_INTERVAL, ChangeLog, Entry, settings_json
from dpd_router.config import (
    Settings,
    SettingsError,
    live_settings,
    load_settings,
    models_restart_needed,
    updated_settings,
    without_password,
)
from dpd_router.startup.tasks import cancel_and_wait

if TYPE_CHECKING:
    from dpd_router.record.metrics import RouterMetrics

log = logging.getLogger("dpd_router.config")

LIVE_SETTINGS = live_settings()
SECRET_SETTINGS = frozenset({"engine_api_key", "api_key_hashes", "admin_key_hashes"})


class ConfigRejected(ValueError):
    """A requested change is invalid, or names settings that need a restart."""


class Reconfigurable(Protocol):
    """A part of the running router with live settings: it takes the new Settings whole and applies
    what concerns it, to the requests that start from now on."""

    def reconfigure(self, settings: Settings) -> None: ...


class LiveConfig:
    """Owns the router's current Settings and hands each change to the parts that declared themselves
    reconfigurable, in the order given."""

    def __init__(
        self,
        settings: Settings,
        parts: Sequence[Reconfigurable],
        metrics: RouterMetrics,
        change_log: ChangeLog | None = None,
    ) -> None:
        self._settings = settings
        self._parts = tuple(parts)
        self._metrics = metrics
        # A worker of several: the log its PUTs go through and its siblings' arrive from.
        self._change_log = change_log
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None
        self._seen_mtime: float | None = None
        self._reloads: set[asyncio.Task[dict[str, Any]]] = set()

    @property
    def settings(self) -> Settings:
        """The settings in force now (those the router started with, and every live change since)."""
        return self._settings

    def effective(self) -> dict[str, Any]:
        """The settings in force, secrets redacted (key hashes are counted, not shown)."""
        values = self.settings.model_dump(mode="json")
        values["config"] = None if self.settings.config is None else str(self.settings.config)
        for name in SECRET_SETTINGS:
            value = getattr(self.settings, name)
            if isinstance(value, list):
                values[name] = f"<{len(value)} configured>"
            elif value is not None:
                values[name] = "<redacted>"
        if self.settings.limits_store is not None:
            values["limits_store"] = without_password(self.settings.limits_store)
        return values

    async def update(self, changes: dict[str, Any], *, source: str = "admin") -> dict[str, Any]:
        """Apply `changes` (setting -> value); only live settings may be named. Returns what changed."""
        async with self._lock:
            new = self._validated(changes, source)
            if self._change_log is None:
                return self._apply(new, source)
            try:
                await asyncio.to_thread(self._change_log.append_changes, settings_json(new, set(changes)))
            except OSError as exc:
                log.error("cannot write to the workers' change log, so this change is this worker's alone: %s", exc)
                return self._apply(new, source)
            return await self._read_changes(own_source=source)

    async def reload_everywhere(self, source: str) -> dict[str, Any]:
        """`reload`, here and, in a worker of several, in every worker: the supervisor is asked to forward
        SIGHUP to them all (this one reloads again then, finding nothing new). Returns what changed here."""
        changed = await self.reload(source)
        if self._change_log is not None and not self._change_log.reload_every_worker():
            log.warning("config reload (%s) reached this worker only: its supervisor is gone", source)
        return changed

    async def replay_changes(self) -> None:
        """A worker starting: apply its siblings' changes since their last reload (as they did after it)."""
        if self._change_log is None:
            return
        async with self._lock:
            for entry in await asyncio.to_thread(self._change_log.read_since_last_reload):
                self._apply_entry(entry, "peer")

    async def apply_peer_changes(self) -> None:
        """Apply the changes written to the workers' log since this worker last read it."""
        if self._change_log is not None:
            async with self._lock:
                await self._read_changes()

    async def _read_changes(self, *, own_source: str = "peer") -> dict[str, Any]:
        """Apply the log's new changes in its order (the lock held); returns what this worker's own changed,
        raising ConfigRejected if it no longer validates after a sibling's change that came first."""
        assert self._change_log is not None
        own: dict[str, Any] = {}
        refusal: ConfigRejected | None = None
        for entry in await asyncio.to_thread(self._change_log.read_new):
            if entry.is_reload:
                continue  # each worker reloads on its own signal; markers are for the workers starting later
            if entry.pid != self._change_log.pid:
                self._apply_entry(entry, "peer")
                continue
            try:
                own = self._apply_entry(entry, own_source)
            except ConfigRejected as exc:
                refusal = exc
        if refusal is not None:
            raise refusal
        return own

    def _apply_entry(self, entry: Entry, source: str) -> dict[str, Any]:
        try:
            new = self._validated(entry.changes or {}, source)
        except ConfigRejected as exc:
            if source != "peer":
                raise
            log.error("a change from worker %d is rejected here: %s", entry.pid, exc)
            return {}
        return self._apply(new, source)

    def _validated(self, changes: dict[str, Any], source: str) -> Settings:
        """The settings in force with `changes`; ConfigRejected (and counted) when one names a setting
        that cannot change while the router runs, or a value that does not validate."""
        restart = sorted(set(changes) - LIVE_SETTINGS)
        if restart:
            self._count(source, "rejected")
            raise ConfigRejected(f"{', '.join(restart)} cannot change while the router runs; restart it")
        try:
            new = updated_settings(self.settings, changes)
        except SettingsError as exc:
            self._count(source, "rejected")
            raise ConfigRejected(str(exc)) from None
        restart = models_restart_needed(self.settings, new)
        if restart:
            self._count(source, "rejected")
            raise ConfigRejected(f"{', '.join(restart)} cannot change while the router runs; restart it")
        return new

    async def reload(self, source: str) -> dict[str, Any]:
        """Re-read flags, env and the config file; apply what may change live, report the rest."""
        async with self._lock:
            if self._change_log is not None:
                # The siblings' changes written before this reload come before it, as they do for them.
                await self._read_changes()
            try:
                new = await asyncio.to_thread(lambda: load_settings(**self.settings._overrides))
            except SettingsError as exc:
                self._count(source, "rejected")
                log.error("config reload (%s) rejected, keeping the current settings: %s", source, exc)
                return {}
            pending = sorted(
                name
                for name in Settings.model_fields
                if name not in LIVE_SETTINGS and getattr(new, name) != getattr(self.settings, name)
            )
            live = {name: getattr(new, name) for name in LIVE_SETTINGS}
            # The models' entries change live as a whole, or (some change needing a restart) not at all.
            models_pending = models_restart_needed(self.settings, updated_settings(self.settings, live))
            if models_pending:
                pending += models_pending
                live["models"] = self.settings.models
            if pending:
                log.warning("config reload (%s): %s changed but need a restart to apply", source, ", ".join(pending))
            changed = self._apply(updated_settings(self.settings, live), source)
            if self._change_log is not None:
                try:
                    await asyncio.to_thread(self._change_log.append_reload)
                except OSError as exc:  # a worker starting later then also applies the PUTs before this reload
                    log.error("cannot write a reload marker to the workers' change log: %s", exc)
            return changed

    def _apply(self, new: Settings, source: str) -> dict[str, Any]:
        old = self.settings
        changed = {
            name: {"from": getattr(old, name), "to": getattr(new, name)}
            for name in sorted(LIVE_SETTINGS)
            if getattr(new, name) != getattr(old, name)
        }
        if not changed:
            self._count(source, "unchanged")
            return {}
        self._settings = new
        for part in self._parts:
            part.reconfigure(new)
        self._count(source, "applied")
        summary = ", ".join(f"{name} {change['from']} -> {change['to']}" for name, change in changed.items())
        log.warning("config changed via %s: %s", source, summary, extra={"fields": {"source": source}})
        return changed

    def _count(self, source: str, outcome: str) -> None:
        self._metrics.config_reloads.labels(source, outcome).inc()

    def start(self) -> None:
        """Watch the config file and listen for SIGHUP."""
        path = self.settings.config
        if path is not None and self.settings.config_watch_interval > 0:
            self._seen_mtime = _mtime(path)
            self._watch = asyncio.create_task(self._watch_file(path), name="config-watch")
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
        if self._change_log is not None:
            self._follow = asyncio.create_task(self._follow_siblings(self._change_log), name="config-follow")

    def _on_sighup(self) -> None:
        task = asyncio.ensure_future(self.reload("sighup"))
        self._reloads.add(task)  # keep a reference until it is done
        task.add_done_callback(self._reloads.discard)

    async def _watch_file(self, path: Path) -> None:
        while True:
            await asyncio.sleep(self.settings.config_watch_interval)
            mtime = _mtime(path)
            if mtime is not None and mtime != self._seen_mtime:
                self._seen_mtime = mtime
                await self.reload("file")

    async def _follow_siblings(self, change_log: ChangeLog) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL)
            if not change_log.has_news():
                continue
            try:
                await self.apply_peer_changes()
            except Exception:  # a part failing one change must not stop this worker following the rest
                log.exception("applying a change from the workers' change log failed")

    async def close(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await cancel_and_wait([task for task in (self._watch, self._follow) if task is not None])


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
