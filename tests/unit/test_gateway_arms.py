"""Which planner a request takes: its tenant's reserved pool, else the shared pool's experiment arm."""

from __future__ import annotations

from typing import Any, cast

import orjson

from dpd_router.api.auth import ANONYMOUS, Principal
from dpd_router.config import load_settings
from dpd_router.gateway import Gateway, PhaseTimeouts, RetryPolicy
from dpd_router.pool.pool import Pool
from dpd_router.pool.served_model import ServedModel
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import DEFAULT_ARM, Observer
from dpd_router.request.client_request import parse_request
from dpd_router.routing.adaptive import AdaptiveModel
from dpd_router.routing.experiments import ExperimentArms, arm_position
from dpd_router.routing.planner import Planner, adaptive_policy, build_planner
from dpd_router.startup.connectors import build_connector

SHARED = ("http://10.0.0.1:8100", "http://10.0.0.2:8200")
RESERVED = ("http://10.0.1.1:8100", "http://10.0.1.2:8200")
EVERYONE = {"arms": [{"name": "all", "share": 1.0, "routing_threshold": 8192}]}


def routers(experiments: dict[str, Any] | None) -> tuple[Gateway, Planner, Planner]:
    settings = load_settings(
        prefill_urls=[SHARED[0]],
        decode_urls=[SHARED[1]],
        tenants={"acme": {"prefill_urls": [RESERVED[0]], "decode_urls": [RESERVED[1]]}},
        experiments=experiments,
    )
    metrics = RouterMetrics()
    adaptive = AdaptiveModel(adaptive_policy(settings), settings.routing_threshold)
    shared = build_planner(settings, Pool([SHARED[0]], [SHARED[1]]), metrics, adaptive=adaptive)
    reserved = build_planner(settings, Pool([RESERVED[0]], [RESERVED[1]]), metrics, adaptive=adaptive)
    gateway = Gateway(
        engines=cast(Any, None),
        tokenizers={},
        planners={None: shared, "acme": reserved},
        connector=build_connector(settings, cast(Any, None)),  # never called: no request is served
        observer=Observer(metrics),
        metrics=metrics,
        model=ServedModel("m"),
        timeouts=PhaseTimeouts(first_token=5, idle=5, total=5, prefill=5),
        retries=RetryPolicy(),
        experiments=ExperimentArms(settings, shared, adaptive),
    )
    return gateway, shared, reserved


def planned(gateway: Gateway, principal: Principal, headers: dict[str, str] | None = None) -> tuple[Planner, str]:
    request = parse_request("chat", orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    planner, arm = gateway._planner_of(request, principal, headers or {}, "r-1", None)
    return planner, arm or DEFAULT_ARM


def test_requests_on_the_shared_pool_take_their_arm_and_are_labelled_with_it() -> None:
    gateway, shared, _ = routers(EVERYONE)
    planner, arm = planned(gateway, ANONYMOUS, {"x-session-id": "s-1"})
    assert arm == "all" and planner is not shared and planner.threshold == 8192
    # A tenant without reserved engines shares the main pool, and its arms.
    assert planned(gateway, Principal(key_id="k", tenant="solo"))[1] == "all"


def test_a_tenant_with_reserved_engines_takes_no_part() -> None:
    gateway, _, reserved = routers(EVERYONE)
    assert planned(gateway, Principal(key_id="k", tenant="acme")) == (reserved, "live")


def test_without_experiments_every_request_is_live_on_the_shared_planner() -> None:
    gateway, shared, _ = routers(None)
    assert planned(gateway, ANONYMOUS, {"x-session-id": "s-1"}) == (shared, "live")


def test_the_api_key_places_a_request_without_a_session_key() -> None:
    half = {"arms": [{"name": "half", "share": 0.5}]}
    gateway, _, _ = routers(half)
    inside = next(f"{i:012x}" for i in range(100) if arm_position(f"{i:012x}") < 0.5)
    outside = next(f"{i:012x}" for i in range(100) if arm_position(f"{i:012x}") >= 0.5)
    assert planned(gateway, Principal(key_id=inside))[1] == "half"
    assert planned(gateway, Principal(key_id=outside))[1] == "live"
