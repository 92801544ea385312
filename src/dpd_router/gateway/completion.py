"""The end of a request: what it holds is released exactly once, however it ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from dpd_router.pool.endpoint import Endpoint, Slot
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Asked, Ending, Observer, Output, RequestTrace, Staging
from dpd_router.routing.planner import Plan
from dpd_router.transfer.base import Connector, StagedKV

# Seconds from a cut decode call to the release of the KV it may have been reading: far longer than a
# transfer takes, far shorter than the prefiller's lease (30 s).
KV_READ_GRACE = 2.0


class HeldKV:
    """KV a prefill staged, held until a decoder answers a decode call for it; else released (once).

    Pushed into one decoder (LMCache): that decoder's once it answered a call for it, or a call it
    broke off may have loaded it. Held on the prefiller (NIXL): a decoder's only once it answered (a
    refusal's or a whole answer's status line, a stream's first token). vLLM's decoder frees the
    prefiller's blocks itself when it refuses or aborts a request its engine admitted, but a call cut
    before that (its handler cancelled before it ran, a stream closed before its first read) leaves
    them to wait out their lease; the router cannot tell, so it releases them, `KV_READ_GRACE` after a
    decode call for them was cut: a decoder still reading them then has long finished, and the
    prefiller frees no block a read is copying. A release for blocks the decoder did read costs the
    prefiller one log line about an unrecognized request.
    """

    def __init__(self, staged: StagedKV, connector: Connector, metrics: RouterMetrics, *, pushed: bool) -> None:
        assert staged.handoff is not None
        self.staged = staged
        self.decoder = staged.handoff.decoder
        self._connector = connector
        # Pushed into `decoder` (LMCache), not held on the prefiller for any decoder to pull (NIXL).
        self._pushed = pushed
        self._metrics = metrics
        self._settled = False
        self._sent = False

    def sent(self) -> None:
        """A decode call for this KV is being sent (its decoder may start reading the blocks)."""
        self._sent = True

    def answered_by(self, decoder: Endpoint) -> None:
        """`decoder` answered a decode call for this KV (a refusal, a whole answer, a stream's first token)."""
        if decoder is self.decoder or not self._pushed:
            self._settled = True

    def maybe_used_by(self, decoder: Endpoint) -> None:
        """A decode call for this KV broke off after reaching `decoder`: pushed KV may be loaded there."""
        if decoder is self.decoder and self._pushed:
            self._settled = True

    def release(self) -> None:
        if not self._settled:
            self._settled = True
            self._metrics.kv_released.labels(self._connector.name).inc()
            read = self._sent and not self._pushed
            self._connector.release_unused(self.staged, after=KV_READ_GRACE if read else 0.0)


class Completion:
    """Ends a request, exactly once: releases its decoder slot, KV staged for it that no decode call took,
    the in-flight gauge and the caller's `on_finish` (the admission slot), and writes and reports its record,
    which takes who asked, the prompt as read, its plans, what the decoders and the prefill hop
    produced and how the request ended (`output`, `staging`, `ending`) then.

    Without an `observer` the trace is not reported: a stream's continuation is part of its request,
    which reports it."""

    def __init__(
        self,
        asked: Asked,
        observer: Observer | None,
        metrics: RouterMetrics,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self._trace = RequestTrace(request_id=asked.request_id, kind=asked.kind, stream=asked.stream)
        self._asked = asked
        # The prompt as read: its tokens (None where its count comes after the end) and the seconds it took.
        self._prompt: tuple[int | None, float | None] = (None, None)
        self._observer = observer
        self._metrics = metrics
        self._on_finish = on_finish
        self._decoder: Endpoint | None = None
        self._decoder_slot: Slot | None = None
        self._kv: HeldKV | None = None
        self._deferred: list[Callable[[], object]] = []
        self._report_after: tuple[asyncio.Future[Any], Callable[[RequestTrace], None], Callable[[], bool]] | None = None
        self._done = False
        self.output = Output()
        self.staging = Staging()
        self.ending = Ending()
        # The plan as first made, with the threshold it was judged by, and the plan served last.
        self._planned: tuple[Plan, int] | None = None
        self._served: Plan | None = None
        metrics.in_flight.inc()

    def asked_by(self, asked: Asked) -> None:
        """Who asked, once more is known of it (the experiment arm its planner is)."""
        self._asked = asked

    def read(self, tokens: int | None, seconds: float | None) -> None:
        """The prompt as read: its tokens (None: counted after the end, by the engine's usage or the whole
        encoding; see `report_after`), and the seconds reading it took."""
        self._prompt = (tokens, seconds)

    @property
    def ended(self) -> bool:
        """Whether the request has ended (what it held released, its record written)."""
        return self._done

    @property
    def served(self) -> Plan | None:
        """The plan served last (None: none was served)."""
        return self._served

    def planned(self, plan: Plan, threshold: int) -> None:
        """The request's plan as first made, and the threshold it was judged by."""
        self._planned = (plan, threshold)

    def serving(self, plan: Plan) -> None:
        """The plan being served now (a fallback's, a replaced decoder's): the last one is the request's."""
        self._served = plan

    def defer(self, cleanup: Callable[[], object]) -> None:
        """Run `cleanup` when the request is over (for example: cancel a prefill still running)."""
        self._deferred.append(cleanup)

    def report_after(
        self,
        ready: asyncio.Future[Any],
        settle: Callable[[RequestTrace], None],
        *,
        unless: Callable[[], bool] = lambda: False,
    ) -> None:
        """Report the trace (metrics, log line, learning) once `ready` is done, or at the end if `unless()`
        is true then, and `settle` has put what it knows on the trace: a prompt planned on its first
        tokens is counted whole then."""
        self._report_after = (ready, settle, unless)

    def hold(self, decoder: Endpoint) -> None:
        """Count the request against `decoder` until it ends (moving it off a decoder held before)."""
        if self._decoder is decoder:
            return
        if self._decoder_slot is not None:
            self._decoder_slot.release()
        self._decoder, self._decoder_slot = decoder, decoder.calling()

    def hold_kv(self, kv: HeldKV) -> None:
        """Hold KV staged for this request until a decode call takes it (KV held before is released)."""
        self.release_kv()
        self._kv = kv

    def kv_sent(self) -> None:
        if self._kv is not None:
            self._kv.sent()

    def kv_answered_by(self, decoder: Endpoint) -> None:
        if self._kv is not None:
            self._kv.answered_by(decoder)

    def kv_maybe_used_by(self, decoder: Endpoint) -> None:
        if self._kv is not None:
            self._kv.maybe_used_by(decoder)

    def release_kv(self) -> None:
        """Release the staged KV unless a decoder answered a call for it."""
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
        if self._decoder_slot is not None:
            self._decoder_slot.release()
        self._metrics.in_flight.dec()
        self._record_plans()
        self._trace.take(self.output, self.staging, self.ending, asked=self._asked, prompt=self._prompt)
        observer = self._observer
        if observer is not None and self._report_after is None:
            observer.finish(self._trace)
        elif observer is not None and self._report_after is not None:
            ready, settle, unless = self._report_after
            ended = time.perf_counter()
            if ready.done() or unless():
                self._report(observer, settle, ended)
            else:
                ready.add_done_callback(lambda _: self._report(observer, settle, ended))
        if self._on_finish is not None:
            self._on_finish()

    def _record_plans(self) -> None:
        """The record's plan: what the engines held and the queues when it was made, the path it was served on."""
        trace = self._trace
        if self._planned is not None:
            plan, trace.threshold = self._planned
            trace.uncached_tokens, trace.prefiller_queue = plan.uncached_tokens, plan.prefiller_queue
            trace.decoder_streams, trace.decoder_queue = plan.decoder_streams, plan.decoder_queue
        served = self._served
        if served is not None:
            trace.path, trace.reason, trace.uncached_tokens = served.path, served.reason, served.uncached_tokens

    def _report(self, observer: Observer, settle: Callable[[RequestTrace], None], ended: float) -> None:
        settle(self._trace)
        observer.finish(self._trace, ended=ended)
