"""Operator endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

if TYPE_CHECKING:
    from dpd_router.gateway.models import Models
    from dpd_router.pool.pool import Pool
    from dpd_router.record.metrics import RouterMetrics


class OpsApi:
    """The operator routes, over every engine, the served model and the metrics."""

    def __init__(self, *, pool: Pool, models: Models, metrics: RouterMetrics) -> None:
        self._pool = pool
        self._models = models
        self._metrics = metrics

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/health", health, methods=["GET"])
        routes.add_api_route("/healthcheck", health, methods=["GET"])  # the path vLLM's toy PD proxy's scripts probe
        routes.add_api_route("/ready", self.ready, methods=["GET"])
        routes.add_api_route("/metrics", self.metrics, methods=["GET"])
        return routes

    async def ready(self) -> Response:
        """Ready when at least one decoder answers its health probe; lists every endpoint's state and, with
        several models, whether each has a decoder up (a router with one model down still serves the others)."""
        is_ready = self._pool.ready()
        body: dict[str, object] = {
            "ready": is_ready,
            "model": self._models.default.name,
            "endpoints": [
                {
                    "url": endpoint.url,
                    "role": endpoint.role,
                    "state": endpoint.state,
                    "in_flight": endpoint.in_flight,
                    "last_error": endpoint.last_error,
                }
                for endpoint in self._pool.endpoints()
            ],
        }
        if len(self._models) > 1:
            body["models"] = {served.name: served.pools[None].ready() for served in self._models}
        return Response(orjson.dumps(body), status_code=200 if is_ready else 503, media_type="application/json")

    async def metrics(self) -> Response:
        return Response(self._metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def health() -> Response:
    """The router process is up (it says nothing of the engines; see /ready)."""
    return Response(b'{"status":"ok"}', media_type="application/json")
