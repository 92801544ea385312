"""Admission control: a cap on requests in flight, and a bounded FIFO queue with a wait limit.

Each pool of engines has its own budget: the shared pool, and every tenant with reserved engines,
so one tenant's burst fills its own queue and never another's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import asdict, dataclass

from dpd_router.api.limits import worker_share
from dpd_router.config import Settings
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.errors import AdmissionRejected

# The admission budget (metrics label `pool`) of requests served by the shared pool.
SHARED = "shared"


class Admission:
    """Lets at most `max_in_flight` requests through; up to `max_queued` more wait their turn.

    A request that finds the queue full, or waits longer than `queue_timeout`, is refused with a
    503 and Retry-After. `max_in_flight = 0` admits everything.
    """

    def __init__(
        self,
        metrics: RouterMetrics,
        *,
        max_in_flight: int,
        max_queued: int,
        queue_timeout: float,
        pool: str = SHARED,
    ):
        self.pool = pool
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
            self._metrics.admission_rejected.labels("queue_full", self.pool).inc()
            raise AdmissionRejected("The router is at capacity and its queue is full; retry shortly.")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._metrics.queue_depth.labels(self.pool).set(len(self._waiters))
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
                self._metrics.admission_rejected.labels("queue_timeout", self.pool).inc()
                raise AdmissionRejected(
                    f"The router is at capacity; the request waited {self.queue_timeout:g} s without a slot."
                ) from None
            if granted:
                self.leave()  # cancelled just as the slot arrived: pass it on
            raise
        finally:
            self._metrics.queue_depth.labels(self.pool).set(len(self._waiters))
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


@dataclass(frozen=True)
class AdmissionLimits:
    """One budget's limits (the settings of the same names)."""

    max_in_flight: int
    max_queued: int
    queue_timeout: float

    @classmethod
    def for_pool(cls, settings: Settings, tenant: str | None) -> AdmissionLimits:
        """The shared pool's limits (tenant None), or a tenant's: its own where its entry sets them.
        Counts are this process's share of them (`workers` processes each keep their own)."""
        pools = None if tenant is None else settings.tenants.get(tenant)
        limits = cls(settings.max_in_flight, settings.max_queued, settings.queue_timeout)
        if pools is not None:
            limits = cls(
                max_in_flight=limits.max_in_flight if pools.max_in_flight is None else pools.max_in_flight,
                max_queued=limits.max_queued if pools.max_queued is None else pools.max_queued,
                queue_timeout=limits.queue_timeout if pools.queue_timeout is None else pools.queue_timeout,
            )
        return cls(
            max_in_flight=worker_share(limits.max_in_flight, settings.workers),
            max_queued=worker_share(limits.max_queued, settings.workers),
            queue_timeout=limits.queue_timeout,
        )


class Admissions:
    """One Admission a pool: the shared pool's, and one for each tenant with reserved engines.

    A tenant without reserved engines shares the shared pool's budget, as it shares its engines.
    """

    def __init__(self, metrics: RouterMetrics, settings: Settings) -> None:
        self._budgets = {
            tenant: Admission(
                metrics, pool=SHARED if tenant is None else tenant, **asdict(AdmissionLimits.for_pool(settings, tenant))
            )
            for tenant in [None, *settings.tenants]
        }

    def for_tenant(self, tenant: str | None) -> Admission:
        return self._budgets.get(tenant) or self._budgets[None]

    def reconfigure(self, settings: Settings) -> None:
        """Apply live admission settings; a tenant's own limits change with a restart only (`tenants` is not live)."""
        for tenant, admission in self._budgets.items():
            admission.reconfigure(**asdict(AdmissionLimits.for_pool(settings, tenant)))
