"""The operator console: `GET /ui`, one self-contained page, and `GET /admin/state`, the JSON it polls.

The state is read from what the router records anyway (its metrics registry, its endpoints, the
last log lines' fields), only when asked: the console costs the request path nothing. Counters and
histograms are sent cumulative; the page differences consecutive polls into rates and percentiles.

So that a page opened on a busy router shows its last minutes at once, not "no data yet", the router
keeps the charts' counters and histograms of the last HISTORY_SECONDS, one sample every
HISTORY_INTERVAL seconds (`ConsoleHistory`), and sends them with the first poll (`?history=1`). Each
worker samples /metrics as it renders (every worker's sum), so whichever worker answers has them all.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from importlib.resources import files
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from dpd_router import __version__
from dpd_router.advise.analysis import analyse
from dpd_router.advise.scrape import AdviseError, Scrape
from dpd_router.api.admin import authorize
from dpd_router.metrics import PREFIX, RouterMetrics

if TYPE_CHECKING:
    from dpd_router.api.auth import Gatekeeper
    from dpd_router.gateway.models import Models
    from dpd_router.live import LiveConfig
    from dpd_router.observe import Observer
    from dpd_router.pool.endpoint import Endpoint
    from dpd_router.pool.pool import Pool
    from dpd_router.routing.planner import Planner

# Histograms the page charts, by their name without the prefix, and the label it splits them by.
HISTOGRAMS = {
    "time_to_first_token_seconds": ("path",),
    "inter_token_latency_seconds": ("path",),
    "phase_seconds": ("path", "phase"),
    "prompt_tokens": ("path",),
}
COUNTERS = {
    "route_decisions_total": ("path", "reason"),
    "requests_total": ("path", "outcome"),
    "prefill_fallbacks_total": ("reason",),
    "kv_transfer_ineffective_total": (),
}


# The history a page opened now starts with: as much as the page itself keeps (its KEEP polls).
HISTORY_SECONDS = 300.0
HISTORY_INTERVAL = 5.0


class ConsoleHistory:
    """The charts' counters and histograms of the last `keep` seconds, sampled every `interval` seconds."""

    def __init__(self, metrics: RouterMetrics, *, interval: float = HISTORY_INTERVAL, keep: float = HISTORY_SECONDS):
        self._metrics = metrics
        self._interval = interval
        self._samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(1, round(keep / interval)))

    def sample(self) -> None:
        self._samples.append({"time": time.time(), **charted(Scrape.parse(self._metrics.render().decode()))})

    def samples(self) -> list[dict[str, Any]]:
        return list(self._samples)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self.sample()


class ConsoleApi:
    """The console's routes, over what the page shows: endpoints, metrics, settings, the adaptive view
    of the shared pool's planner and the last requests."""

    def __init__(
        self,
        *,
        gatekeeper: Gatekeeper,
        live: LiveConfig,
        metrics: RouterMetrics,
        models: Models,
        pool: Pool,
        planner: Planner,
        observer: Observer,
        history: ConsoleHistory | None = None,
    ) -> None:
        self._gatekeeper = gatekeeper
        self._live = live
        self._metrics = metrics
        self._models = models
        self._pool = pool
        self._planner = planner
        self._observer = observer
        self._history = history

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/ui", console_page, methods=["GET"])
        routes.add_api_route("/admin/state", self.state, methods=["GET"])
        return routes

    async def state(self, request: Request) -> Response:
        """Everything the console shows, at this moment. Open when the router has no API keys at all (as in
        `make demo`); otherwise it needs an admin key, like every /admin endpoint."""
        refusal = authorize(request, self._gatekeeper, open_without_keys=True)
        if refusal is not None:
            return refusal
        state = self.snapshot()
        if request.query_params.get("history") == "1":
            state["history"] = [] if self._history is None else self._history.samples()
        return Response(orjson.dumps(state, default=str), media_type="application/json")

    def snapshot(self) -> dict[str, Any]:
        settings = self._live.effective()
        scrape = Scrape.parse(self._metrics.render().decode())
        return {
            "time": time.time(),
            "router": {
                "version": __version__,
                # Every model served, by name; their pools are listed apart (each named after its model).
                "model": " · ".join(served.name or "(not yet known)" for served in self._models),
                "routing_threshold": settings["routing_threshold"],
                "threshold_mode": settings["threshold_mode"],
                "prefill_strategy": settings["prefill_strategy"],
                "kv_connector": settings["kv_connector"],
                "admin_key_needed": self._gatekeeper.keys.configured,
                # Under `--workers N` the state below is this worker's (its pools, settings, recent
                # requests); the counters and histograms, read from /metrics, are every worker's.
                "worker": os.getpid(),
                "workers": settings["workers"],
            },
            "pools": [
                {"name": pool.name, "endpoints": [_endpoint(e) for e in pool.endpoints()]} for pool in self._pool.parts
            ],
            **charted(scrape),
            "adaptive": self._planner.adaptive_view(),
            "adaptive_costs": _adaptive_costs(scrape) if settings["threshold_mode"] == "adaptive" else [],
            "advice": _advice(scrape),
            "recent": [{"finished_at": at, **fields} for at, fields in self._observer.recent],
        }


async def console_page() -> Response:
    """The page itself holds no data; what it shows comes from /admin/state, under its key."""
    page = files("dpd_router").joinpath("console/index.html").read_bytes()
    return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


def _endpoint(endpoint: Endpoint) -> dict[str, Any]:
    load = endpoint.load
    return {
        "url": endpoint.url,
        "role": endpoint.role,
        "healthy": endpoint.healthy,
        "available": endpoint.available,
        "breaker": endpoint.breaker.state,
        "draining": endpoint.draining,
        "in_flight": endpoint.in_flight,
        "queued_tokens": endpoint.queued_tokens,
        "running": None if load is None else load.running,
        "waiting": None if load is None else load.waiting,
        "kv_cache_usage": None if load is None else load.kv_cache_usage,
        "last_error": endpoint.last_error,
    }


def charted(scrape: Scrape) -> dict[str, Any]:
    """The counters and histograms the page charts, cumulative."""
    return {
        "counters": {name: _counter_rows(scrape, name, labels) for name, labels in COUNTERS.items()},
        "histograms": {name: _histogram_rows(scrape, name, labels) for name, labels in HISTOGRAMS.items()},
    }


def _counter_rows(scrape: Scrape, name: str, labels: tuple[str, ...]) -> list[dict[str, Any]]:
    return [
        {**dict(zip(labels, values, strict=True)), "count": count}
        for values, count in sorted(scrape.counters(f"{PREFIX}_{name}", labels).items())
    ]


def _histogram_rows(scrape: Scrape, name: str, labels: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for values, histogram in sorted(scrape.histograms(f"{PREFIX}_{name}", labels).items()):
        rows.append(
            {
                **dict(zip(labels, values, strict=True)),
                "bounds": [bound if bound != float("inf") else None for bound in histogram.bounds],
                "cumulative": histogram.cumulative,
                "sum": histogram.sum,
                "count": histogram.count,
            }
        )
    return rows


def _adaptive_costs(scrape: Scrape) -> list[dict[str, Any]]:
    """What adaptive mode learned: each model's terms per endpoint (dpd_router_adaptive_cost)."""
    return [
        {"model": labels.get("model"), "endpoint": labels.get("endpoint"), "term": labels.get("term"), "value": value}
        for labels, value in scrape.gauge_values(f"{PREFIX}_adaptive_cost")
    ]


def _advice(scrape: Scrape) -> dict[str, Any] | None:
    """`dpd-router advise` on the router's own metrics: the threshold and prefill:decode ratio it recommends."""
    try:
        report = analyse(scrape).to_dict()
    except AdviseError as exc:
        return {"error": str(exc)}
    return {key: report[key] for key in ("recommendation", "ratio", "shares", "warnings", "prompt_tokens")}
