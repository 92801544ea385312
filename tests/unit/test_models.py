"""Several models from one config: each entry's settings over the top level's, checked apart and together;
the request's model picks its gateway; an adapter's engines are those that list it."""

from __future__ import annotations

from typing import Any, cast

import pytest

from dpd_router.client_request import parse_request
from dpd_router.config import SettingsError, load_settings, models_restart_needed, updated_settings
from dpd_router.errors import ModelNotFound
from dpd_router.gateway.models import Models, ServingModel
from dpd_router.metrics import RouterMetrics
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.pool.served_model import ServedModel
from dpd_router.routing.adapters import AdapterPlanners
from dpd_router.routing.planner import build_planner

A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def two_models(**top: Any) -> dict[str, Any]:
    return {
        "routing_threshold": 500,
        "models": {
            "alpha": {"decode_urls": [A], "routing_threshold": 100},
            "beta": {"decode_urls": B, "prefill_strategy": "roundrobin"},
        },
        **top,
    }


def test_each_model_takes_the_top_levels_settings_under_its_own() -> None:
    each = load_settings(**two_models(prefill_timeout=7.0)).each_model()
    assert list(each) == ["alpha", "beta"]
    alpha, beta = each["alpha"], each["beta"]
    assert (alpha.model, alpha.decode_urls, alpha.routing_threshold, alpha.prefill_timeout) == ("alpha", [A], 100, 7.0)
    assert (beta.model, beta.decode_urls, beta.routing_threshold, beta.prefill_strategy) == (
        "beta",
        [B],
        500,
        "roundrobin",
    )
    assert alpha.models == {} and beta.models == {}


def test_one_model_without_models_is_the_top_level() -> None:
    settings = load_settings(decode_urls=[A], model="m")
    assert settings.each_model() == {"m": settings}


@pytest.mark.parametrize(
    ("models", "top", "words"),
    [
        ({"alpha": {"decode_urls": [A]}, "beta": {"decode_urls": [A]}}, {}, "already an engine of model alpha"),
        ({"alpha": {"decode_urls": [A], "port": 9}}, {}, "models.alpha: port cannot be set for one model"),
        ({"alpha": {"decode_urls": [A], "routing_threshold": 0}}, {}, "models.alpha: routing_threshold"),
        ({"alpha": {}}, {}, "models.alpha: settings: decode_urls: at least one decoder URL is required"),
        ({"alpha": {"decode_urls": [A]}}, {"tenants": {"t": {"decode_urls": [B]}}}, "tenants: engines reserved"),
        ({"alpha": {"decode_urls": [A]}}, {"discovery": "kubernetes"}, "models.alpha: with discovery: kubernetes"),
        (
            {"alpha": {"kubernetes_decode_selector": "m=alpha"}},
            {"discovery": "kubernetes"},
            "models.alpha: with discovery: kubernetes, each model names its own pods",
        ),
        ({"alpha": {"kubernetes_api_url": "https://k"}}, {}, "kubernetes_api_url cannot be set for one model"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(models: dict[str, Any], top: dict[str, Any], words: str) -> None:
    with pytest.raises(SettingsError, match=words):
        load_settings(models=models, **top)


def test_with_discovery_each_model_names_its_own_pods_or_lists_its_engines() -> None:
    settings = load_settings(
        discovery="kubernetes",
        kubernetes_selector="app=engines",
        models={
            "alpha": {"kubernetes_selector": "dpd-router.io/model=alpha"},
            "beta": {"kubernetes_prefill_selector": "role=p,m=beta", "kubernetes_decode_selector": "role=d,m=beta"},
            "gamma": {"discovery": "static", "decode_urls": [A]},
            "delta": {"decode_urls": [B], "kubernetes_prefill_selector": "role=p,m=delta"},
        },
    )
    each = settings.each_model()
    assert each["alpha"].kubernetes_selector == "dpd-router.io/model=alpha"
    assert (each["gamma"].discovery, each["gamma"].decode_urls) == ("static", [A])
    assert each["delta"].decode_urls == [B] and each["delta"].discovery == "kubernetes"


def test_an_entrys_live_settings_change_live_and_the_rest_need_a_restart() -> None:
    settings = load_settings(**two_models())
    models = settings.models
    threshold = {**models, "alpha": {**models["alpha"], "routing_threshold": 900}}
    assert models_restart_needed(settings, updated_settings(settings, {"models": threshold})) == []
    moved = {**models, "alpha": {"decode_urls": ["http://127.0.0.1:9003"]}}
    assert models_restart_needed(settings, updated_settings(settings, {"models": moved})) == [
        "models.alpha.decode_urls"
    ]
    fewer = {"alpha": models["alpha"]}
    assert models_restart_needed(settings, updated_settings(settings, {"models": fewer})) == [
        "models (the served models)"
    ]
    # A top-level change reaches the entries that do not set it.
    raised = updated_settings(settings, {"routing_threshold": 800}).each_model()
    assert (raised["alpha"].routing_threshold, raised["beta"].routing_threshold) == (100, 800)


def serving(name: str | None, pool: Pool) -> ServingModel:
    return ServingModel(ServedModel(name), cast(Any, object()), {None: pool})


def test_a_request_goes_to_the_model_it_names_and_one_naming_none_to_the_first() -> None:
    alpha_pool, beta_pool = Pool([], [A]), Pool([], [B])
    beta_pool.decoders[0].adapters = {"beta-sql": {"id": "beta-sql", "parent": "beta"}}
    models = Models([serving("alpha", alpha_pool), serving("beta", beta_pool)])
    unnamed = parse_request("chat", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert models.resolve(unnamed)[0].name == "alpha" and unnamed.body["model"] == "alpha"
    assert models.route("beta") == (models.named("beta"), None)
    served, adapter = models.route("beta-sql")
    assert (served.name, adapter) == ("beta", "beta-sql")
    with pytest.raises(ModelNotFound, match=r"The model `gamma` does not exist\."):
        models.route("gamma")
    listed = [entry["id"] for entry in models.listing()["data"]]
    assert listed == ["alpha", "beta", "beta-sql"]


def test_an_adapter_listed_by_prefillers_alone_is_not_served() -> None:
    pool = Pool([A], [B])
    pool.prefillers[0].adapters = {"draft": {"id": "draft", "parent": "alpha"}}
    models = Models([serving("alpha", pool)])
    with pytest.raises(ModelNotFound):
        models.route("draft")


def test_a_lone_model_not_yet_named_lets_its_engines_judge_any_name() -> None:
    models = Models([serving(None, Pool([], [A]))])
    assert models.route("whatever") == (models.default, None)


def test_an_adapters_planner_sees_the_engines_that_list_it_as_they_change() -> None:
    settings = load_settings(prefill_urls=[A, "http://127.0.0.1:9003"], decode_urls=[B, "http://127.0.0.1:9004"])
    pool = Pool(settings.prefill_urls, settings.decode_urls)
    base = build_planner(settings, pool, RouterMetrics())
    planners = AdapterPlanners(settings, capacity=2)
    sql = planners.planner_for(base, "sql")
    assert sql.pool.endpoints() == []
    lists_sql: list[Endpoint] = [pool.prefillers[1], pool.decoders[0]]
    for endpoint in lists_sql:
        endpoint.adapters = {"sql": {"id": "sql", "parent": "m"}}
    assert sql.pool.endpoints() == lists_sql
    assert sql.cache is not base.cache, "an index of its own"
    assert planners.planner_for(base, "sql") is sql
    planners.planner_for(base, "chat")
    planners.planner_for(base, "draft")
    assert len(planners) == 2 and planners.planner_for(base, "sql") is not sql, "the least recently used is dropped"
    planners.reconfigure(updated_settings(settings, {"routing_threshold": 77}))
    assert planners.planner_for(base, "draft").threshold == 77
