"""Several models from one config: each entry's settings over the top level's, checked apart and together;
the request's model picks its gateway; an adapter's engines are those that list it."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import httpx
import pytest

from dpd_router.config import SettingsError, load_settings, models_restart_needed, updated_settings
from dpd_router.gateway.models import Models, ServingModel
from dpd_router.pool import adapters as adapters_module
from dpd_router.pool.adapters import AdapterLoader
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.pool.served_model import ServedModel
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import ModelNotFound, UpstreamError
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
        ({"alpha": {"decode_urls": [A], "lora_adapters": {"fin": " "}}}, {}, "fin: the adapter's path on the engines"),
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


def loader_over(answers: dict[str, httpx.Response], calls: list[str]) -> AdapterLoader:
    """A loader whose engines answer /v1/load_lora_adapter as `answers` says (by engine URL)."""

    def engine(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        calls.append(url)
        return answers[url]

    client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    return AdapterLoader(client, {"fin": "/adapters/fin"}, RouterMetrics(), model=ServedModel("m"), timeout=5)


async def test_an_adapter_is_loaded_once_per_role_however_many_requests_need_it() -> None:
    calls: list[str] = []
    ok = httpx.Response(200, text="Success: LoRA adapter 'fin' added successfully.")
    already = httpx.Response(400, json={"error": {"message": "The lora adapter 'fin' has already been loaded."}})
    loader = loader_over({A: ok, B: already}, calls)
    pool = Pool([A], [B])
    await asyncio.gather(*(loader.ensure(pool, "fin") for _ in range(5)))
    assert sorted(calls) == [A, B], "one load a role, shared by every request waiting for it"
    assert all("fin" in endpoint.adapters for endpoint in pool.endpoints())
    assert pool.endpoints()[0].adapters["fin"]["parent"] == "m"
    await loader.ensure(pool, "fin")
    await loader.ensure(pool, "other")  # not one of lora_adapters: nothing to load
    assert len(calls) == 2


async def test_a_decoder_that_cannot_load_fails_the_request_and_a_prefiller_only_its_hop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    broken = httpx.Response(500, json={"error": {"message": "No adapter found at /adapters/fin"}})
    ok = httpx.Response(200, text="Success")
    loader = loader_over({A: broken, B: ok}, calls)
    pool = Pool([A], [B])
    await loader.ensure(pool, "fin")  # the prefiller's failure leaves its hop out
    assert "fin" in pool.endpoints()[1].adapters and "fin" not in pool.endpoints()[0].adapters
    loader = loader_over({A: ok, B: broken}, calls)
    pool = Pool([A], [B])
    with pytest.raises(UpstreamError, match="No adapter found at /adapters/fin") as refused:
        await loader.ensure(pool, "fin")
    assert refused.value.status_code == 502
    asked = len(calls)
    with pytest.raises(UpstreamError, match="No adapter found"):
        await loader.ensure(pool, "fin")
    assert len(calls) == asked, "a failed load answers for the next requests a while, the engine is not asked"
    monkeypatch.setattr(adapters_module, "LOAD_RETRY_AFTER", 0.0)
    loader = loader_over({A: ok, B: broken}, calls)
    for _ in range(2):
        with pytest.raises(UpstreamError):
            await loader.ensure(pool, "fin")
    assert calls[asked:] == [B, B], "the decoder asked again once the failure has stood its time"


@pytest.mark.parametrize(
    ("aliases", "words"),
    [
        ({"assistant": {"gamma": 1}}, "model_aliases.assistant: gamma is not a served model"),
        ({"alpha": {"beta": 1}}, "model_aliases.alpha: a served model's name cannot be an alias"),
        ({"assistant": {"alpha": 0}}, "model_aliases.assistant.alpha: a weight is above 0"),
        ({"assistant": {}}, "model_aliases.assistant: name the models it stands for"),
    ],
)
def test_an_alias_names_served_models_with_weights(aliases: dict[str, Any], words: str) -> None:
    with pytest.raises(SettingsError, match=words):
        load_settings(**two_models(), model_aliases=aliases)


def test_an_alias_sends_each_session_to_one_of_its_models_by_weight() -> None:
    settings = load_settings(**two_models(), model_aliases={"assistant": {"alpha": 95, "beta": 5}})
    models = Models([serving("alpha", Pool([], [A])), serving("beta", Pool([], [B]))])
    models.reconfigure(settings)
    chosen = [models.route("assistant", sticky=f"user-{i}")[0].name for i in range(4000)]
    assert 0.035 < chosen.count("beta") / len(chosen) < 0.065, "about 5% of the sessions"
    for i in range(50):  # sticky: every request of a session, in any process (a stable hash)
        assert {models.route("assistant", sticky=f"user-{i}")[0].name for _ in range(5)} == {chosen[i]}
    unkeyed = [models.route("assistant")[0].name for _ in range(4000)]
    assert 0.035 < unkeyed.count("beta") / len(unkeyed) < 0.065
    request = parse_request("chat", b'{"model": "assistant", "messages": [{"role": "user", "content": "hi"}]}')
    served, adapter = models.resolve(request, sticky="user-1")
    assert (served.name, adapter) == (chosen[1], None)
    assert request.body["model"] == chosen[1] and request.body_changed, "the engines are asked for the model"
    listed = {card["id"]: card for card in models.listing()["data"]}
    assert {**listed["assistant"], "id": "alpha"} == listed["alpha"], "listed as its most weighted model"
    models.reconfigure(updated_settings(settings, {"model_aliases": {"assistant": {"beta": 1}}}))
    assert {models.route("assistant", sticky=f"user-{i}")[0].name for i in range(50)} == {"beta"}
    models.reconfigure(updated_settings(settings, {"model_aliases": {}}))
    with pytest.raises(ModelNotFound):
        models.route("assistant")
