"""The end of a request: what it holds is released exactly once, however it ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from dpd_router.metrics import RouterMetrics
from dpd_router.observe import Observer, RequestTrace
from dpd_router.pool.endpoint import Endpoint
from dpd_router.transfer.base import Connector, StagedKV


class HeldKV:
    """KV a prefill staged, held until a decode call picks it up; else released (once).

    Pushed into one decoder (LMCache): taken once that decoder answered a decode call for it.
    Held on the prefiller (NIXL): the decoder's from the moment a decode call for it is sent to
    one, since vLLM's decoder frees the prefiller's blocks itself when it refuses or aborts it.
    """

    def __init__(self, staged: StagedKV, connector: Connector, metrics: RouterMetrics) -> None:
        assert staged.handoff is not None
        self.staged = staged
        self.decoder = staged.handoff.decoder
        self._connector = connector
        self._metrics = metrics
        self._settled = False

    def sent_to(self, decoder: Endpoint) -> None:
        """A decode call for this KV is being sent to `decoder`."""
        if not self._connector.pushes_to_decoder:
            self._settled = True

    def not_delivered(self) -> None:
        """The decode call never reached its decoder (it could not be reached)."""
        if not self._connector.pushes_to_decoder:
            self._settled = False

    def taken_by(self, decoder: Endpoint) -> None:
        """`decoder` answered a decode call for this KV (a token, a whole answer or an error)."""
        if decoder is self.decoder or not self._connector.pushes_to_decoder:
            self._settled = True

    def release(self) -> None:
        if not self._settled:
            self._settled = True
            self._metrics.kv_released.labels(self._connector.name).inc()
            self._connector.release_unused(self.staged)


class Completion:
    """Releases what a request holds, exactly once: its decoder slot, KV staged for it that no
    decode call took, the in-flight gauge, its trace, and the caller's `on_finish` (the admission slot)."""

    def __init__(
        self,
        trace: RequestTrace,
        observer: Observer,
        metrics: RouterMetrics,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self._trace = trace
        self._observer = observer
        self._metrics = metrics
        self._on_finish = on_finish
        self._decoder: Endpoint | None = None
        self._kv: HeldKV | None = None
        self._deferred: list[Callable[[], object]] = []
        self._report_after: tuple[asyncio.Future[Any], Callable[[], None], Callable[[], bool]] | None = None
        self._done = False
        metrics.in_flight.inc()

    def defer(self, cleanup: Callable[[], object]) -> None:
        """Run `cleanup` when the request is over (for example: cancel a prefill still running)."""
        self._deferred.append(cleanup)

    def report_after(
        self, ready: asyncio.Future[Any], settle: Callable[[], None], *, unless: Callable[[], bool] = lambda: False
    ) -> None:
        """Report the trace (metrics, log line, learning) once `ready` is done, or at the end if `unless()`
        is true then, and `settle` has put what it knows on the trace: a prompt planned on its first
        tokens is counted whole then."""
        self._report_after = (ready, settle, unless)

    def hold(self, decoder: Endpoint) -> None:
        """Count the request against `decoder` (moving it off a decoder held before)."""
        if self._decoder is decoder:
            return
        if self._decoder is not None:
            self._decoder.finish()
        decoder.start()
        self._decoder = decoder

    def hold_kv(self, kv: HeldKV) -> None:
        """Hold KV staged for this request until a decode call takes it (KV held before is released)."""
        self.release_kv()
        self._kv = kv

    def kv_sent_to(self, decoder: Endpoint) -> None:
        if self._kv is not None:
            self._kv.sent_to(decoder)

    def kv_not_delivered(self) -> None:
        if self._kv is not None:
            self._kv.not_delivered()

    def kv_taken_by(self, decoder: Endpoint) -> None:
        if self._kv is not None:
            self._kv.taken_by(decoder)

    def release_kv(self) -> None:
        """Release the staged KV unless a decode call took it."""
        kv, self._kv = self._kv, None
        if kv is not None:
            kv.release()

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        for cleanup in self._deferred:
            cleanup()
        self.release_kv()
        if self._decoder is not None:
            self._decoder.finish()
        self._metrics.in_flight.dec()
        if self._report_after is None:
            self._observer.finish(self._trace)
        else:
            ready, settle, unless = self._report_after
            ended = time.perf_counter()
            if ready.done() or unless():
                self._report(settle, ended)
            else:
                ready.add_done_callback(lambda _: self._report(settle, ended))
        if self._on_finish is not None:
            self._on_finish()

    def _report(self, settle: Callable[[], None], ended: float) -> None:
        settle()
        self._observer.finish(self._trace, ended=ended)
