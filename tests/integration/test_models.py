"""Several models behind one router, each through its own prefill and decode pools: the official clients
against two simulated models, each with its own threshold and strategy, and LoRA adapters of the first
loaded on some of its engines only."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster

from .conftest import engine_stats, fresh, kinds_seen, metric, openai_client, rid, running_router, settled

ALPHA, BETA = "alpha-7b", "beta-70b"
# Alpha disaggregates prompts from 40 tokens; beta's threshold keeps everything on its decoder.
ALPHA_THRESHOLD, BETA_THRESHOLD = 40, 100_000
LONG = "The quarterly report shows steady growth across every region and product line. " * 12
ADMIN = {"Authorization": "Bearer ops-secret"}


# Alpha's LoRA adapters: SQL on one prefiller and one decoder, CHAT on a decoder alone, DRAFT on a prefiller alone.
SQL, CHAT, DRAFT = "alpha-sql", "alpha-chat", "alpha-draft"


@pytest.fixture(scope="module")
async def alpha(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    adapters = {
        "prefill-0": ["--lora-modules", f"{DRAFT}=/adapters/draft"],
        "prefill-1": ["--lora-modules", f"{SQL}=/adapters/sql"],
        "decode-0": ["--lora-modules", f"{CHAT}=/adapters/chat"],
        "decode-1": ["--lora-modules", f"{SQL}=/adapters/sql"],
    }
    async with SimCluster(
        in_process=True, prefill=2, decode=2, tokenizer=tokenizer_dir, model=ALPHA, engine_args=adapters
    ) as engines:
        yield engines


@pytest.fixture(scope="module")
async def beta(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    async with SimCluster(in_process=True, prefill=1, decode=1, tokenizer=tokenizer_dir, model=BETA) as engines:
        yield engines


def two_models(alpha: SimCluster, beta: SimCluster, tokenizer_dir: Path, **extra: Any) -> dict[str, Any]:
    return {
        "tokenizer": str(tokenizer_dir),
        "threshold_mode": "static",
        "models": {
            ALPHA: {
                "prefill_urls": alpha.prefill_urls,
                "decode_urls": alpha.decode_urls,
                "routing_threshold": ALPHA_THRESHOLD,
                "threshold_mode": "cache_aware",
            },
            BETA: {
                "prefill_urls": beta.prefill_urls,
                "decode_urls": beta.decode_urls,
                "routing_threshold": BETA_THRESHOLD,
                "prefill_strategy": "roundrobin",
            },
        },
        **extra,
    }


@pytest.fixture(scope="module")
async def router(alpha: SimCluster, beta: SimCluster, tokenizer_dir: Path) -> AsyncIterator[str]:
    async with running_router(**two_models(alpha, beta, tokenizer_dir)) as base_url:
        yield base_url


def engines_of(cluster: SimCluster) -> list[str]:
    return [*cluster.prefill_urls, *cluster.decode_urls]


async def requests_on(clusters: list[SimCluster]) -> int:
    return sum([(await engine_stats(url))["requests_total"] for c in clusters for url in engines_of(c)])


async def test_each_models_prompts_use_only_its_own_engines_under_its_own_threshold(
    router: str, alpha: SimCluster, beta: SimCluster
) -> None:
    client = openai_client(router)
    long = fresh(LONG)
    first, second = rid(), rid()
    to_alpha = await client.chat.completions.create(
        model=ALPHA, messages=[{"role": "user", "content": long}], max_tokens=5, extra_headers={"X-Request-Id": first}
    )
    assert to_alpha.model == ALPHA and to_alpha.choices[0].message.content
    assert await kinds_seen(alpha.prefill_urls, first) == ["remote_prefill"]
    assert await kinds_seen(alpha.decode_urls, first) == ["kv_decode"]
    assert await kinds_seen(engines_of(beta), first) == []

    to_beta = await client.chat.completions.create(
        model=BETA, messages=[{"role": "user", "content": long}], max_tokens=5, extra_headers={"X-Request-Id": second}
    )
    assert to_beta.model == BETA
    assert to_beta.usage is not None and to_beta.usage.prompt_tokens > ALPHA_THRESHOLD
    assert await kinds_seen(beta.decode_urls, second) == ["local"], "beta's threshold keeps it on its decoder"
    assert await kinds_seen([*beta.prefill_urls, *engines_of(alpha)], second) == []


async def test_a_streamed_completion_and_a_request_naming_no_model(
    router: str, alpha: SimCluster, beta: SimCluster
) -> None:
    client = openai_client(router)
    streamed, unnamed = rid(), rid()
    stream = await client.completions.create(
        model=BETA, prompt=fresh(LONG), max_tokens=6, stream=True, extra_headers={"X-Request-Id": streamed}
    )
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text
    assert await kinds_seen(engines_of(beta), streamed) == ["local"]
    assert await kinds_seen(engines_of(alpha), streamed) == []

    async with httpx.AsyncClient(base_url=router, timeout=30) as http:
        answer = await http.post(
            "/v1/completions", json={"prompt": fresh(LONG), "max_tokens": 3}, headers={"X-Request-Id": unnamed}
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == ALPHA, "a request naming no model goes to the first one configured"
    assert await kinds_seen(engines_of(alpha), unnamed) == ["remote_prefill", "kv_decode"]


async def test_a_responses_follow_up_and_a_messages_request_stay_on_their_models_engines(
    router: str, alpha: SimCluster, beta: SimCluster
) -> None:
    client = openai_client(router)
    first, follow_id, message_id = rid(), rid(), rid()
    started = await client.responses.create(
        model=BETA, input=fresh(LONG), max_output_tokens=4, extra_headers={"X-Request-Id": first}
    )
    follow = await client.responses.create(
        model=BETA,
        input="And next quarter?",
        previous_response_id=started.id,
        max_output_tokens=4,
        extra_headers={"X-Request-Id": follow_id},
    )
    assert follow.output_text and follow.previous_response_id == started.id
    assert follow.usage is not None and follow.usage.input_tokens > ALPHA_THRESHOLD, "the history went with it"
    for request_id in (first, follow_id):
        assert await kinds_seen(beta.decode_urls, request_id) == ["local"]
        assert await kinds_seen([*beta.prefill_urls, *engines_of(alpha)], request_id) == []

    messages = anthropic.AsyncAnthropic(base_url=router, api_key="unused", max_retries=0)
    answer = await messages.messages.create(
        model=ALPHA,
        max_tokens=4,
        messages=[{"role": "user", "content": fresh(LONG)}],
        extra_headers={"X-Request-Id": message_id},
    )
    assert answer.model == ALPHA and answer.content
    assert await kinds_seen(engines_of(alpha), message_id) == ["remote_prefill", "kv_decode"]
    assert await kinds_seen(engines_of(beta), message_id) == []


async def test_an_unknown_model_is_vllms_404_and_no_engine_is_asked(
    router: str, alpha: SimCluster, beta: SimCluster
) -> None:
    before = await requests_on([alpha, beta])
    client = openai_client(router)
    with pytest.raises(openai.NotFoundError) as refused:
        await client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["message"], error["type"], error["param"]) == (
        "The model `gamma` does not exist.",
        "NotFoundError",
        "model",
    )
    async with httpx.AsyncClient(base_url=router, timeout=30) as http:
        counted = await http.post("/v1/messages/count_tokens", json={"model": "gamma", "messages": []})
        tokenized = await http.post("/tokenize", json={"model": "gamma", "prompt": "hi"})
    assert counted.status_code == tokenized.status_code == 404
    assert await requests_on([alpha, beta]) == before


async def test_models_lists_every_model_and_tokenize_reaches_the_named_models_engines(
    router: str, alpha: SimCluster, beta: SimCluster
) -> None:
    listed = await openai_client(router).models.list()
    assert [(model.id, getattr(model, "parent", None)) for model in listed.data] == [
        (ALPHA, None),
        (DRAFT, ALPHA),
        (SQL, ALPHA),
        (CHAT, ALPHA),
        (BETA, None),
    ]
    assert [getattr(model, "max_model_len", None) for model in listed.data][::4] == [32768, 32768]
    async with httpx.AsyncClient(base_url=router, timeout=30) as http:
        before = (await engine_stats(beta.decode_urls[0]))["tokenize_requests"]
        answer = await http.post("/tokenize", json={"model": BETA, "prompt": "count these words"})
        assert answer.status_code == 200 and answer.json()["count"] > 0
        assert (await engine_stats(beta.decode_urls[0]))["tokenize_requests"] == before + 1
        ready = (await http.get("/ready")).json()
        console = (await http.get("/admin/state")).json()
    assert ready["ready"] is True and ready["models"] == {ALPHA: True, BETA: True}
    assert [(pool["name"], len(pool["endpoints"])) for pool in console["pools"]] == [(ALPHA, 4), (BETA, 2)]
    assert console["router"]["model"] == f"{ALPHA} · {BETA}"


async def test_one_models_settings_change_live_without_touching_the_others(
    alpha: SimCluster, beta: SimCluster, tokenizer_dir: Path
) -> None:
    settings = two_models(alpha, beta, tokenizer_dir, admin_key_hashes=[hash_key("ops-secret")])
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        models = settings["models"]
        raised = {**models, ALPHA: {**models[ALPHA], "routing_threshold": BETA_THRESHOLD}}
        answer = await http.put("/admin/config", json={"models": raised}, headers=ADMIN)
        assert answer.status_code == 200, answer.text
        request_id = rid()
        body = {"model": ALPHA, "messages": [{"role": "user", "content": fresh(LONG)}], "max_tokens": 3}
        assert (
            await http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": request_id})
        ).status_code == 200
        assert await kinds_seen(engines_of(alpha), request_id) == ["local"], "alpha's new threshold holds"

        lowered = {**raised, BETA: {**models[BETA], "routing_threshold": ALPHA_THRESHOLD}}
        assert (await http.put("/admin/config", json={"models": lowered}, headers=ADMIN)).status_code == 200
        request_id = rid()
        body["model"] = BETA
        assert (
            await http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": request_id})
        ).status_code == 200
        assert await kinds_seen(engines_of(beta), request_id) == ["remote_prefill", "kv_decode"]

        moved = {**lowered, BETA: {**lowered[BETA], "decode_urls": alpha.decode_urls}}
        refused = await http.put("/admin/config", json={"models": moved}, headers=ADMIN)
        assert refused.status_code == 400
        renamed = {ALPHA: lowered[ALPHA]}
        refused = await http.put("/admin/config", json={"models": renamed}, headers=ADMIN)
        assert refused.status_code == 400 and "restart" in refused.json()["error"]["message"]


async def answer(client: openai.AsyncOpenAI, model: str, content: str, request_id: str) -> str:
    completion = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
        extra_headers={"X-Request-Id": request_id},
    )
    assert completion.model == model
    return completion.choices[0].message.content or ""


async def adapters_seen(urls: list[str], request_id: str) -> list[tuple[str, str | None]]:
    return [(entry["kind"], entry["adapter"]) for url in urls for entry in await requests_on_engine(url, request_id)]


async def requests_on_engine(url: str, request_id: str) -> list[dict[str, Any]]:
    return [entry for entry in (await engine_stats(url))["recent"] if entry["request_id"] == request_id]


async def test_an_adapters_long_prompts_run_both_hops_on_the_engines_that_hold_it(
    router: str, alpha: SimCluster
) -> None:
    client = openai_client(router)
    prefill_sql, decode_sql = alpha.prefill_urls[1], alpha.decode_urls[1]
    for _ in range(3):
        content, request_id = fresh(LONG), rid()
        text = await answer(client, SQL, content, request_id)
        assert await adapters_seen([prefill_sql], request_id) == [("remote_prefill", SQL)]
        assert await adapters_seen([decode_sql], request_id) == [("kv_decode", SQL)]
        assert await adapters_seen([alpha.prefill_urls[0], alpha.decode_urls[0]], request_id) == []
        alone = await answer(openai_client(decode_sql), SQL, content, rid())
        assert text == alone, "greedy: as the decoder alone answers with the adapter"
        assert text != await answer(openai_client(decode_sql), ALPHA, content, rid()), "not the base model's answer"


async def test_an_adapters_prefix_index_never_matches_the_base_models(router: str, alpha: SimCluster) -> None:
    """The base model's prompt cached on the adapter's decoder: the adapter's own prompt is not cached there."""
    client = openai_client(router)
    content = fresh(LONG)
    other_decoder, decode_sql = alpha.decode_urls
    async with engine_fault(router, other_decoder, "unhealthy"):  # the base model's prompt goes to decode_sql
        await answer(client, ALPHA, content, rid())
        again = rid()
        await answer(client, ALPHA, content, again)
        assert await kinds_seen([decode_sql], again) == ["local"], "cached on the decoder the adapter uses too"
        request_id = rid()
        await answer(client, SQL, content, request_id)
        assert await adapters_seen(engines_of(alpha), request_id) == [("remote_prefill", SQL), ("kv_decode", SQL)]


@contextlib.asynccontextmanager
async def engine_fault(router: str, url: str, mode: str) -> AsyncIterator[None]:
    """The engine at `url` in fault `mode` until the router sees it unavailable; cleared, until it sees it back."""

    async def state() -> str:
        async with httpx.AsyncClient(base_url=router) as http:
            ready = (await http.get("/ready")).json()
        return next(endpoint["state"] for endpoint in ready["endpoints"] if endpoint["url"] == url)

    async with httpx.AsyncClient(timeout=10) as http:
        await http.post(f"{url}/sim/fault", json={"mode": mode})
        try:
            async with asyncio.timeout(15):
                while await state() == "healthy":  # noqa: ASYNC110 - polling the router's view
                    await asyncio.sleep(0.1)
            yield
        finally:
            await http.post(f"{url}/sim/fault", json={"mode": "none"})
            async with asyncio.timeout(15):
                while await state() != "healthy":  # noqa: ASYNC110 - polling the router's view
                    await asyncio.sleep(0.1)


async def test_an_adapter_without_a_prefiller_decodes_alone_and_one_without_a_decoder_is_a_404(
    router: str, alpha: SimCluster
) -> None:
    client = openai_client(router)
    request_id = rid()
    await answer(client, CHAT, fresh(LONG), request_id)
    assert await adapters_seen(engines_of(alpha), request_id) == [("local", CHAT)]

    before = await requests_on([alpha])
    with pytest.raises(openai.NotFoundError) as refused:
        await answer(client, DRAFT, fresh(LONG), rid())
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["message"] == f"The model `{DRAFT}` does not exist."
    assert await requests_on([alpha]) == before


async def test_an_adapter_loaded_at_runtime_is_served_after_the_next_health_round(
    router: str, alpha: SimCluster
) -> None:
    name = f"late-{rid()}"
    async with httpx.AsyncClient(timeout=10) as http:
        loaded = await http.post(
            f"{alpha.decode_urls[0]}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/adapters/late"}
        )
        assert loaded.status_code == 200, loaded.text
        try:
            async with asyncio.timeout(10):
                while name not in [model.id for model in (await openai_client(router).models.list()).data]:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
            request_id = rid()
            await answer(openai_client(router), name, "Hi.", request_id)
            assert await adapters_seen(alpha.decode_urls, request_id) == [("local", name)]
        finally:
            await http.post(f"{alpha.decode_urls[0]}/v1/unload_lora_adapter", json={"lora_name": name})


async def test_the_metrics_say_which_model_each_request_and_threshold_is_of(
    router: str, alpha: SimCluster, beta: SimCluster
) -> None:
    client = openai_client(router)
    for model in (ALPHA, BETA, SQL):
        await answer(client, model, fresh(LONG), rid())
    with pytest.raises(openai.NotFoundError):
        await answer(client, "made-up", "hi", rid())
    await settled(router)
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{router}/metrics")).text
    labelled = {
        sample.labels["model"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "model" in sample.labels and family.name != "dpd_router_adaptive_cost"
    }
    assert labelled == {ALPHA, BETA}, "only served models (an adapter's requests are its base model's)"
    decisions = "dpd_router_route_decisions_total"
    assert await metric(router, decisions, {"model": ALPHA, "path": "disaggregated"}) >= 2
    assert await metric(router, decisions, {"model": BETA, "path": "direct"}) >= 1
    assert await metric(router, decisions, {"model": BETA, "path": "disaggregated"}) == 0
    threshold = "dpd_router_routing_threshold_tokens"
    assert await metric(router, threshold, {"model": ALPHA}) == ALPHA_THRESHOLD
    assert await metric(router, threshold, {"model": BETA}) == BETA_THRESHOLD


async def test_an_adapter_of_lora_adapters_is_loaded_for_both_hops_where_a_request_needs_it(
    alpha: SimCluster, beta: SimCluster, tokenizer_dir: Path
) -> None:
    """No engine has it: the first requests (at once) load it on one prefiller and one decoder, once each, and
    run both hops with it; /v1/models lists it beforehand, with its base model; the other model does not
    know it."""
    fin = f"fin-{rid()}"
    settings = two_models(alpha, beta, tokenizer_dir)
    settings["models"][ALPHA]["lora_adapters"] = {fin: "/adapters/fin"}
    try:
        async with running_router(**settings) as base_url:
            client = openai_client(base_url)
            listed = {model.id: model for model in (await client.models.list()).data}
            assert fin in listed and listed[fin].model_extra is not None
            assert listed[fin].model_extra["parent"] == ALPHA
            ids = [rid() for _ in range(4)]
            await asyncio.gather(*(answer(client, fin, fresh(LONG), request_id) for request_id in ids))
            both_hops = [("remote_prefill", fin), ("kv_decode", fin)]
            for request_id in ids:
                assert await adapters_seen(engines_of(alpha), request_id) == both_hops
            holding = [url for url in engines_of(alpha) if fin in await listed_adapters(url)]
            assert len(holding) == 2 and holding[0] in alpha.prefill_urls and holding[1] in alpha.decode_urls
            for role in ("prefill", "decode"):
                loads = {"role": role, "outcome": "loaded"}
                assert await metric(base_url, "dpd_router_adapter_loads_total", loads) == 1
            with pytest.raises(openai.NotFoundError):
                await answer(client, f"{BETA}-{fin}", "hi", rid())
    finally:
        async with httpx.AsyncClient(timeout=10) as http:
            for url in engines_of(alpha):
                await http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": fin})


async def listed_adapters(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=10) as http:
        return [card["id"] for card in (await http.get(f"{url}/v1/models")).json()["data"] if card.get("parent")]


async def test_an_alias_sends_each_user_to_one_of_its_models_and_changes_live(
    alpha: SimCluster, beta: SimCluster, tokenizer_dir: Path
) -> None:
    settings = two_models(
        alpha,
        beta,
        tokenizer_dir,
        admin_key_hashes=[hash_key("ops-secret")],
        model_aliases={"assistant": {ALPHA: 1, BETA: 1}},
    )
    async with running_router(**settings) as base_url, httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        client = openai_client(base_url)

        async def served_as(user: str) -> str:
            completion = await client.chat.completions.create(
                model="assistant", messages=[{"role": "user", "content": "Hi."}], max_tokens=2, user=user
            )
            return completion.model

        listed = {model.id for model in (await client.models.list()).data}
        assert {ALPHA, BETA, "assistant"} <= listed, "the alias is listed beside the models"
        first = {user: await served_as(user) for user in (f"user-{i}" for i in range(12))}
        assert set(first.values()) == {ALPHA, BETA}, "both models take a share of the alias's users"
        for user, model in list(first.items())[:4]:
            assert await served_as(user) == model, "a user stays on the model it was given"
        changed = await http.put("/admin/config", json={"model_aliases": {"assistant": {BETA: 1}}}, headers=ADMIN)
        assert changed.status_code == 200, changed.text
        assert {await served_as(user) for user in first} == {BETA}
        refused = await http.put("/admin/config", json={"model_aliases": {"assistant": {"gamma": 1}}}, headers=ADMIN)
        assert refused.status_code == 400 and "gamma is not a served model" in refused.json()["error"]["message"]
