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
from collections.abc import Sequence
from importlib.resources import files
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from dpd_router import __version__
from dpd_router.advise.analysis import analyse
from dpd_router.advise.scrape import AdviseError, Scrape
from dpd_router.api.admin import authorize
from dpd_router.api.errors import response_for
from dpd_router.record.metrics import PREFIX, RouterMetrics, model_label
from dpd_router.request.errors import RouterError

if TYPE_CHECKING:
    from dpd_router.api.auth import Gatekeeper
    from dpd_router.gateway.models import Models, ServingModel
    from dpd_router.live import LiveConfig
    from dpd_router.pool.endpoint import Endpoint
    from dpd_router.pool.pool import Pool
    from dpd_router.record.observe import Observer

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
    "stream_continuations_total": ("outcome", "reason"),
}


# The history a page opened now starts with: as much as the page itself keeps (its KEEP polls).
HISTORY_SECONDS = 300.0
HISTORY_INTERVAL = 5.0


class ConsoleHistory:
    """The charts' counters and histograms of the last `keep` seconds, sampled every `interval` seconds;
    with several `models` (their names), each model's apart, as the page shows one at a time."""

    def __init__(
        self,
        metrics: RouterMetrics,
        *,
        models: Sequence[str] = (),
        interval: float = HISTORY_INTERVAL,
        keep: float = HISTORY_SECONDS,
    ):
        self._metrics = metrics
        self._models = list(models) if len(models) > 1 else []
        self._interval = interval
        self._samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(1, round(keep / interval)))

    def sample(self) -> None:
        scrape = Scrape.parse(self._metrics.render().decode())
        if not self._models:
            self._samples.append({"time": time.time(), **charted(scrape)})
            return
        by_model = {name: charted(scrape.model_only(model_label(name))) for name in self._models}
        self._samples.append({"time": time.time(), "models": by_model})

    def samples(self, model: str | None = None) -> list[dict[str, Any]]:
        """The samples, of `model` where they are kept by model (the first model's for None)."""
        if not self._models:
            return list(self._samples)
        name = model if model in self._models else self._models[0]
        return [{"time": sample["time"], **sample["models"][name]} for sample in self._samples]

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
        observer: Observer,
        history: ConsoleHistory | None = None,
    ) -> None:
        self._gatekeeper = gatekeeper
        self._live = live
        self._metrics = metrics
        self._models = models
        self._pool = pool
        self._observer = observer
        self._history = history

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/ui", console_page, methods=["GET"])
        routes.add_api_route("/admin/state", self.state, methods=["GET"])
        return routes

    async def state(self, request: Request) -> Response:
        """Everything the console shows, at this moment, of one served model (`?model=NAME`, else the first).
        Open when the router has no API keys at all (as in `make demo`); otherwise it needs an admin key,
        like every /admin endpoint."""
        refusal = authorize(request, self._gatekeeper, open_without_keys=True)
        if refusal is not None:
            return refusal
        try:
            served = self._models.named(request.query_params.get("model"))
        except RouterError as exc:  # vLLM's 404 for a model it does not serve
            return response_for(exc)
        state = self.snapshot(served)
        if request.query_params.get("history") == "1":
            state["history"] = [] if self._history is None else self._history.samples(served.name)
        return Response(orjson.dumps(state, default=str), media_type="application/json")

    def snapshot(self, served: ServingModel | None = None) -> dict[str, Any]:
        served = served or self._models.default
        settings = self._live.effective()
        # Its own settings: an entry of `models`, or (one model) the top level's.
        own = self._live.settings.each_model().get(served.name) or self._live.settings
        several = len(self._models) > 1
        scrape = Scrape.parse(self._metrics.render().decode())
        if several:
            scrape = scrape.model_only(model_label(served.name))
        recent = self._observer.recent
        return {
            "time": time.time(),
            "router": {
                "version": __version__,
                # Every model served, by name; their pools are listed apart (each named after its model).
                "model": " · ".join(model.name or "(not yet known)" for model in self._models),
                # The model this state describes (its settings, charts, adaptive view and recent requests),
                # every model the page may switch to, and the entries of `models:` (Apply changes one).
                "selected": served.name,
                "models": [model.name for model in self._models] if several else [],
                "model_entries": settings.get("models") or {},
                "routing_threshold": own.routing_threshold,
                "threshold_mode": own.threshold_mode,
                "prefill_strategy": own.prefill_strategy,
                "kv_connector": own.kv_connector,
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
            "adaptive": served.gateway.planner_for(None).adaptive_view(),
            "adaptive_costs": _adaptive_costs(scrape) if own.threshold_mode == "adaptive" else [],
            "advice": _advice(scrape),
            "recent": [
                {"finished_at": at, **fields}
                for at, fields in recent
                if not several or fields.get("model") == served.name
            ],
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
