"""Admin endpoints (admin API key required): the effective configuration, and changing it live."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from dpd_router.api.errors import error_response, response_for
from dpd_router.live import ConfigRejected
from dpd_router.record.metrics import model_label
from dpd_router.request.errors import RateLimited, RouterError
from dpd_router.routing.adaptive import LEARNED_HOPS, LEARNING_EXPLORE_SHARE

if TYPE_CHECKING:
    from dpd_router.api.auth import Gatekeeper
    from dpd_router.config import Settings
    from dpd_router.gateway.models import Models
    from dpd_router.live import LiveConfig
    from dpd_router.record.metrics import RouterMetrics
    from dpd_router.routing.adaptive import AdaptiveModel
    from dpd_router.routing.planner import Planner


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value, default=_jsonable), status_code=status, media_type="application/json")


def _jsonable(value: object) -> object:
    """A setting's value as JSON: a nested settings model (`experiments`) as its fields, the rest as text."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else str(value)


def authorize(request: Request, gatekeeper: Gatekeeper, *, open_without_keys: bool = False) -> Response | None:
    """None for a caller with an admin key; else the refusal to send. `open_without_keys`: a router
    with no keys at all (as in `make demo`) lets anyone read."""
    if open_without_keys and not gatekeeper.keys.configured:
        return None
    try:
        gatekeeper.authenticate_admin(request.headers.get("authorization"), gatekeeper.source_of(request))
    except RouterError as exc:
        headers = {"WWW-Authenticate": "Bearer"}
        if isinstance(exc, RateLimited):
            headers["Retry-After"] = str(max(1, round(exc.retry_after)))
        return response_for(exc, headers=headers)
    return None


class AdminApi:
    """The admin routes, over the key check, the live configuration and each model's shared-pool planner."""

    def __init__(
        self,
        *,
        gatekeeper: Gatekeeper,
        live: LiveConfig,
        models: Models,
        metrics: RouterMetrics,
    ) -> None:
        self._gatekeeper = gatekeeper
        self._live = live
        self._models = models
        self._metrics = metrics

    def routes(self) -> APIRouter:
        routes = APIRouter(prefix="/admin")
        routes.add_api_route("/config", self.get_config, methods=["GET"])
        routes.add_api_route("/config", self.put_config, methods=["PUT"])
        routes.add_api_route("/reload", self.reload, methods=["POST"])
        routes.add_api_route("/routing", self.routing, methods=["GET"])
        return routes

    async def get_config(self, request: Request) -> Response:
        refusal = authorize(request, self._gatekeeper)
        if refusal is not None:
            return refusal
        return _json(self._live.effective())

    async def put_config(self, request: Request) -> Response:
        """Change live settings: a JSON object of setting names and values."""
        refusal = authorize(request, self._gatekeeper)
        if refusal is not None:
            return refusal
        try:
            changes = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return error_response(f"The body is not valid JSON: {exc}", "BadRequestError", 400)
        if not isinstance(changes, dict) or not changes:
            return error_response("Send a JSON object of settings to change.", "BadRequestError", 400)
        try:
            changed = await self._live.update(changes, source="admin")
        except ConfigRejected as exc:
            return error_response(str(exc), "BadRequestError", 400)
        return _json({"changed": changed, "config": self._live.effective()})

    async def reload(self, request: Request) -> Response:
        """Re-read flags, environment and the config file, as SIGHUP does (in every worker of several)."""
        refusal = authorize(request, self._gatekeeper)
        if refusal is not None:
            return refusal
        changed = await self._live.reload_everywhere("admin")
        return _json({"changed": changed, "config": self._live.effective()})

    async def routing(self, request: Request) -> Response:
        """The routing decision of one served model (`?model=NAME`, else the first) in words: the threshold
        in force, what the adaptive model learned, and the decisions taken so far by reason."""
        refusal = authorize(request, self._gatekeeper)
        if refusal is not None:
            return refusal
        try:
            served = self._models.named(request.query_params.get("model"))
        except RouterError as exc:  # vLLM's 404 for a model it does not serve
            return response_for(exc)
        planner = served.gateway.planner_for(None)
        every = self._live.settings.each_model()
        # A lone model's settings are the top level's, under a name learnt from its engines or not yet.
        settings = every.get(served.name) or self._live.settings
        label = model_label(served.name)
        decisions: dict[str, int] = collections.Counter()
        for metric in self._metrics.route_decisions.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and (len(self._models) == 1 or sample.labels["model"] == label):
                    decisions[f"{sample.labels['path']}/{sample.labels['reason']}"] += int(sample.value)  # over arms
        view = planner.adaptive_view()
        summary = _routing_summary(planner, settings, view)
        body = {
            "model": served.name,
            "models": [model.name for model in self._models],
            "threshold_mode": settings.threshold_mode,
            "routing_threshold": settings.routing_threshold,
            "summary": summary,
            "decoders": view,
            "learned": planner.adaptive.describe() if planner.adaptive is not None else None,
            "decisions": dict(decisions),
            # The experiment arms in force and the routing settings each plans with (the rest is arm `live`).
            "arms": [] if (experiments := served.gateway.experiments) is None else experiments.describe(),
        }
        return _json(body)


def _routing_summary(planner: Planner, settings: Settings, view: list[dict[str, Any]]) -> list[str]:
    """The routing decision in words: the settings in force, and each decoder's adaptive view."""
    summary = [
        f"threshold_mode {settings.threshold_mode}, routing_threshold {settings.routing_threshold} tokens, "
        f"prefill_strategy {settings.prefill_strategy}."
    ]
    if settings.threshold_mode == "adaptive":
        summary += _slo_summary(settings)
    for entry in view:
        tokens = entry["threshold_tokens"]
        where = (
            "would keep every prompt (no prefiller, or an idle decoder)"
            if tokens is None or tokens == float("inf")
            else f"would disaggregate prompts from {tokens:,.0f} uncached tokens"
        )
        summary.append(
            f"Decoder {entry['decoder']} runs {entry['running_streams']:.0f} streams"
            + (f" ({entry['decoder_queue']:,.0f} prompt tokens await its prefill)" if entry["decoder_queue"] else "")
            + f": adaptive mode {where}"
            + (
                f" (prefiller {entry['prefiller']}, {entry['prefiller_queue']:.0f} queued)."
                if "prefiller" in entry
                else "."
            )
        )
        if settings.itl_slo is not None:
            summary.append(
                f"Direct prefills longer than itl_slo ({settings.itl_slo:g} s) made {entry['late_gap_share']:.2%} "
                f"of decoder {entry['decoder']}'s recent inter-token gaps; itl_slo_share allows "
                f"{settings.itl_slo_share:.2%}."
            )
    if planner.adaptive is not None:
        summary += _unlearned_summary(planner.adaptive, [e["prefiller"] for e in view if "prefiller" in e], settings)
    return summary


def _unlearned_summary(adaptive: AdaptiveModel, prefillers: list[str], settings: Settings) -> list[str]:
    """A line per prefiller in the view that has not served LEARNED_HOPS calls yet, while exploring."""
    if settings.explore_share <= 0:
        return []
    return [
        f"Prefiller {url} has served {adaptive.hop_observations(url)} of {LEARNED_HOPS} prefill calls: until "
        f"then exploration sends it at least {LEARNING_EXPLORE_SHARE:.0%} of the prompts near the boundary that "
        "the model would keep direct."
        for url in dict.fromkeys(prefillers)
        if not adaptive.hop_learned(url)
    ]


def _slo_summary(settings: Settings) -> list[str]:
    """The SLOs adaptive mode decides by, in words (none: no line)."""
    slos = []
    if settings.ttft_slo is not None:
        scope = settings.ttft_slo_max_tokens
        within = f"prompts up to {scope:,} uncached tokens (longer ones have none)" if scope else "every prompt"
        slos.append(f"ttft_slo {settings.ttft_slo:g} s for {within}")
    if settings.itl_slo is not None:
        slos.append(f"itl_slo {settings.itl_slo:g} s")
    return [f"SLOs: {'; '.join(slos)}."] if slos else []
