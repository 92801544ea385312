"""Admission control: a cap on requests in flight, and a bounded FIFO queue with a wait limit."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from dpd_router.errors import AdmissionRejected
from dpd_router.metrics import RouterMetrics


class Admission:
    """Lets at most `max_in_flight` requests through; up to `max_queued` more wait their turn.

    A request that finds the queue full, or waits longer than `queue_timeout`, is refused with a
    503 and Retry-After. `max_in_flight = 0` admits everything.
    """

    def __init__(self, metrics: RouterMetrics, *, max_in_flight: int, max_queued: int, queue_timeout: float):
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._metrics = metrics

    def reconfigure(self, *, max_in_flight: int, max_queued: int, queue_timeout: float) -> None:
        """New limits for requests arriving from now on; a raised cap admits queued requests at once."""
        self.max_in_flight, self.max_queued, self.queue_timeout = max_in_flight, max_queued, queue_timeout
        while self._waiters and (self.max_in_flight <= 0 or self.in_flight < self.max_in_flight):
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def enter(self) -> None:
        """Wait for a slot; the caller must call `leave()` exactly once afterwards."""
        if self.max_in_flight <= 0 or (self.in_flight < self.max_in_flight and not self._waiters):
            self.in_flight += 1
            return
        if len(self._waiters) >= self.max_queued:
            self._metrics.admission_rejected.labels("queue_full").inc()
            raise AdmissionRejected("The router is at capacity and its queue is full; retry shortly.")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._metrics.queue_depth.set(len(self._waiters))
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.queue_timeout):
                await waiter
        except (TimeoutError, asyncio.CancelledError) as exc:
            self._discard(waiter)
            granted = waiter.done() and not waiter.cancelled()
            if isinstance(exc, TimeoutError):
                if granted:
                    return  # the slot arrived as the wait ran out: admitted after all
                self._metrics.admission_rejected.labels("queue_timeout").inc()
                raise AdmissionRejected(
                    f"The router is at capacity; the request waited {self.queue_timeout:g} s without a slot."
                ) from None
            if granted:
                self.leave()  # cancelled just as the slot arrived: pass it on
            raise
        finally:
            self._metrics.queue_depth.set(len(self._waiters))
            self._metrics.queue_wait.observe(time.perf_counter() - started)

    def leave(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next in line
                return
        self.in_flight -= 1

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
