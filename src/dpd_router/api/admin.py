"""Admin endpoints (admin API key required): the effective configuration, and changing it live."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from dpd_router.api.auth import source_of
from dpd_router.api.errors import error_response, response_for
from dpd_router.errors import RateLimited, RouterError
from dpd_router.live import ConfigRejected
from dpd_router.routing.adaptive import LEARNED_HOPS, LEARNING_EXPLORE_SHARE

if TYPE_CHECKING:
    from dpd_router.app import Router
    from dpd_router.config import Settings
    from dpd_router.routing.adaptive import AdaptiveModel

routes = APIRouter(prefix="/admin")


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value, default=str), status_code=status, media_type="application/json")


def authorize(request: Request, *, open_without_keys: bool = False) -> Router | Response:
    """The router, for a caller with an admin key; else the refusal to send. `open_without_keys`: a
    router with no keys at all (as in `make demo`) lets anyone read."""
    router: Router = request.app.state.router
    if open_without_keys and not router.gatekeeper.keys.configured:
        return router
    try:
        router.gatekeeper.authenticate_admin(request.headers.get("authorization"), source_of(request))
    except RouterError as exc:
        headers = {"WWW-Authenticate": "Bearer"}
        if isinstance(exc, RateLimited):
            headers["Retry-After"] = str(max(1, round(exc.retry_after)))
        return response_for(exc, headers=headers)
    return router


@routes.get("/config")
async def get_config(request: Request) -> Response:
    router = authorize(request)
    if isinstance(router, Response):
        return router
    return _json(router.live.effective())


@routes.put("/config")
async def put_config(request: Request) -> Response:
    """Change live settings: a JSON object of setting names and values."""
    router = authorize(request)
    if isinstance(router, Response):
        return router
    try:
        changes = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        return error_response(f"The body is not valid JSON: {exc}", "BadRequestError", 400)
    if not isinstance(changes, dict) or not changes:
        return error_response("Send a JSON object of settings to change.", "BadRequestError", 400)
    try:
        changed = await router.live.update(changes, source="admin")
    except ConfigRejected as exc:
        return error_response(str(exc), "BadRequestError", 400)
    return _json({"changed": changed, "config": router.live.effective()})


@routes.post("/reload")
async def reload(request: Request) -> Response:
    """Re-read flags, environment and the config file, as SIGHUP does."""
    router = authorize(request)
    if isinstance(router, Response):
        return router
    changed = await router.live.reload("admin")
    return _json({"changed": changed, "config": router.live.effective()})


@routes.get("/routing")
async def routing(request: Request) -> Response:
    """The routing decision in words: the threshold in force, what the adaptive model learned, and the
    decisions taken so far by reason."""
    router = authorize(request)
    if isinstance(router, Response):
        return router
    planner = router.planner
    settings = router.settings
    decisions = {
        f"{sample.labels['path']}/{sample.labels['reason']}": int(sample.value)
        for metric in router.metrics.route_decisions.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }
    view = planner.adaptive_view()
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
    body = {
        "threshold_mode": settings.threshold_mode,
        "routing_threshold": settings.routing_threshold,
        "summary": summary,
        "decoders": view,
        "learned": planner.adaptive.describe() if planner.adaptive is not None else None,
        "decisions": decisions,
    }
    return _json(body)


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
