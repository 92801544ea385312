"""Operator endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

if TYPE_CHECKING:
    from dpd_router.app import Router

routes = APIRouter()


@routes.get("/health")
@routes.get("/healthcheck")  # the path of vLLM's toy PD proxy, which its accuracy scripts probe
async def health() -> Response:
    """The router process is up (it says nothing of the engines; see /ready)."""
    return Response(b'{"status":"ok"}', media_type="application/json")


@routes.get("/ready")
async def ready(request: Request) -> Response:
    """Ready when at least one decoder answers its health probe; lists every endpoint's state."""
    router: Router = request.app.state.router
    is_ready = router.pool.ready()
    body = {
        "ready": is_ready,
        "model": router.model.name,
        "endpoints": [
            {
                "url": endpoint.url,
                "role": endpoint.role,
                "state": endpoint.state,
                "in_flight": endpoint.in_flight,
                "last_error": endpoint.last_error,
            }
            for endpoint in router.pool.endpoints()
        ],
    }
    return Response(orjson.dumps(body), status_code=200 if is_ready else 503, media_type="application/json")


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    router: Router = request.app.state.router
    return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)
