"""Active health probes of every endpoint, run as one background task."""

from __future__ import annotations

import asyncio
import logging

import httpx

from dpd_router.metrics import RouterMetrics
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool

log = logging.getLogger("dpd_router.health")


class HealthChecker:
    """Probes `GET /health` on every endpoint; the app runs a round every `health_interval` seconds.

    A failed probe marks the endpoint unhealthy at once (it receives no new traffic); a passing
    probe marks it healthy again, which is how an endpoint that failed requests comes back.
    """

    def __init__(
        self,
        pool: Pool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        *,
        timeout: float,
    ) -> None:
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._timeout = timeout

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(endpoint) for endpoint in self._pool.endpoints()))

    async def probe(self, endpoint: Endpoint) -> bool:
        try:
            response = await self._client.get(f"{endpoint.url}/health", timeout=self._timeout)
            ok = response.status_code == 200
            error = None if ok else f"health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"health probe failed: {type(exc).__name__}"
        was_healthy = endpoint.healthy
        if ok:
            endpoint.record_success()
            endpoint.probed_ok = True
        else:
            endpoint.healthy = False
            endpoint.last_error = error
        if was_healthy != endpoint.healthy:
            log.warning(
                "endpoint %s (%s) is now %s%s",
                endpoint.url,
                endpoint.role,
                endpoint.state,
                f": {error}" if error else "",
            )
        self._metrics.set_endpoint_health(endpoint)
        return ok
