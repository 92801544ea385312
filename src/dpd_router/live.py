"""Live configuration: settings that change without a restart or a dropped request.

Changes arrive three ways: the config file changes (watched), the process gets SIGHUP (re-read
flags, env and file), or an operator sends `PUT /admin/config`. Each is validated as a whole
Settings, handed to every part that declared itself `Reconfigurable`, logged and counted. Settings
outside LIVE_SETTINGS (engines, listeners, tokenizer, keys) need a restart: a reload reports them;
a PUT refuses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dpd_router.config import (
    Settings,
    SettingsError,
    live_settings,
    load_settings,
    updated_settings,
    without_password,
)
from dpd_router.tasks import cancel_and_wait

if TYPE_CHECKING:
    from dpd_router.metrics import RouterMetrics

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

    def __init__(self, settings: Settings, parts: Sequence[Reconfigurable], metrics: RouterMetrics) -> None:
        self._settings = settings
        self._parts = tuple(parts)
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
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
        restart = sorted(set(changes) - LIVE_SETTINGS)
        if restart:
            self._count(source, "rejected")
            raise ConfigRejected(f"{', '.join(restart)} cannot change while the router runs; restart it")
        async with self._lock:
            try:
                new = updated_settings(self.settings, changes)
            except SettingsError as exc:
                self._count(source, "rejected")
                raise ConfigRejected(str(exc)) from None
            return self._apply(new, source)

    async def reload(self, source: str) -> dict[str, Any]:
        """Re-read flags, env and the config file; apply what may change live, report the rest."""
        async with self._lock:
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
            if pending:
                log.warning("config reload (%s): %s changed but need a restart to apply", source, ", ".join(pending))
            live = {name: getattr(new, name) for name in LIVE_SETTINGS}
            return self._apply(updated_settings(self.settings, live), source)

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

    async def close(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._watch is not None:
            await cancel_and_wait([self._watch])


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
