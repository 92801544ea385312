"""The shadow in force: started with the router, replaced when the `shadow` setting changes live."""

from __future__ import annotations

import asyncio

from dpd_router.config import Settings, ShadowSettings
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Observer
from dpd_router.shadow.copies import Shadow


class LiveShadow:
    """Holds the shadow in force (`current`; None: no shadow) and swaps it on a live change.

    A changed setting starts a new shadow at once, for the requests that start from then on; the old
    one is closed in the background (its calls cut short, its queued copies counted as dropped).
    """

    def __init__(self, settings: Settings, observer: Observer, metrics: RouterMetrics) -> None:
        self._observer = observer
        self._metrics = metrics
        self._settings: ShadowSettings | None = settings.shadow
        self._session_header = settings.session_header
        self.current: Shadow | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.current = self._build(self._settings)

    def reconfigure(self, settings: Settings) -> None:
        """Replace the shadow when its settings (or the session header its share hashes) changed."""
        if settings.shadow == self._settings and settings.session_header == self._session_header:
            return
        old = self.current
        self._settings = settings.shadow
        self._session_header = settings.session_header
        self.current = self._build(settings.shadow)
        if old is not None:
            task = asyncio.ensure_future(old.close())
            self._closing.add(task)  # kept until it is done
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        current, self.current = self.current, None
        if current is not None:
            await current.close()
        if self._closing:
            await asyncio.gather(*self._closing)

    def _build(self, settings: ShadowSettings | None) -> Shadow | None:
        if settings is None:
            return None
        shadow = Shadow(settings, self._observer, self._metrics, session_header=self._session_header)
        shadow.start()
        return shadow
