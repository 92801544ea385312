"""Active health probes of every endpoint."""

from __future__ import annotations

import asyncio
import logging

import httpx

from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.record.metrics import RouterMetrics

log = logging.getLogger("dpd_router.health")


class HealthChecker:
    """Probes `GET /health` on every endpoint; the app runs a round every `health_interval` seconds.

    `unhealthy_after` failed probes in a row take an endpoint out of rotation; `healthy_after`
    passing probes in a row bring it back.
    """

    def __init__(
        self,
        pool: Pool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        *,
        timeout: float,
        unhealthy_after: int = 1,
        healthy_after: int = 1,
    ) -> None:
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._timeout = timeout
        self._unhealthy_after = unhealthy_after
        self._healthy_after = healthy_after

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(endpoint) for endpoint in self._pool.endpoints()))

    async def probe(self, endpoint: Endpoint) -> bool:
        try:
            response = await self._client.get(f"{endpoint.url}/health", timeout=self._timeout)
            ok = response.status_code == 200
            error = None if ok else f"health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"health probe failed: {type(exc).__name__}"
        changed = endpoint.record_probe(
            ok, error, unhealthy_after=self._unhealthy_after, healthy_after=self._healthy_after
        )
        if changed:
            log.warning(
                "endpoint %s (%s) is now %s%s",
                endpoint.url,
                endpoint.role,
                endpoint.state,
                f": {error}" if error else "",
            )
        return ok
