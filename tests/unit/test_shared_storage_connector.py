"""The shared-storage connector (vLLM ExampleConnector): bodies, answers and failures of the prefill hop."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from dpd_router.config import load_settings
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineCalls
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import PrefillFailed
from dpd_router.startup.connectors import build_connector
from dpd_router.transfer.base import ENGINE_PATHS, StagedKV
from dpd_router.transfer.shared_storage import SharedStorageConnector, prefill_body, staged_from_answer

PREFILLER = Endpoint("http://127.0.0.1:9", "prefill")


def client_chat() -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "a long prompt"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 200,
        "max_completion_tokens": 200,
        "min_tokens": 10,
        "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "lookup"}}],
    }


def answer(prompt_tokens: int = 300, cached: int | None = 32) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": "a", "finish_reason": "length"}], "usage": usage}


def connector(handler: Any) -> SharedStorageConnector:
    engines = EngineCalls(httpx.MockTransport(handler), {})
    return SharedStorageConnector(engines, timeout=httpx.Timeout(5.0), path_for=ENGINE_PATHS)


def test_prefill_body_asks_for_one_unstreamed_token_and_no_transfer_params() -> None:
    request = parse_request("chat", orjson.dumps(client_chat()))
    body = prefill_body(request)
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    assert "kv_transfer_params" not in body
    assert body["messages"] == client_chat()["messages"] and body["tools"] == client_chat()["tools"]
    assert request.body == client_chat(), "the client's body must stay as sent for the decoder"


def test_prefill_body_adds_max_completion_tokens_only_when_the_client_sent_it() -> None:
    request = parse_request("completion", orjson.dumps({"prompt": "x", "max_tokens": 50}))
    assert prefill_body(request) == {"prompt": "x", "max_tokens": 1, "stream": False, "return_token_ids": True}


def test_decode_body_is_the_clients_request_unchanged() -> None:
    raw = orjson.dumps(client_chat())
    request = parse_request("chat", raw)
    staged = StagedKV(params={}, prompt_tokens=300, cached_tokens=0)
    assert connector(lambda r: httpx.Response(500)).decode_body(request, staged) == raw


def test_staged_kv_keeps_the_prefillers_token_counts() -> None:
    staged = staged_from_answer(answer(prompt_tokens=300, cached=32))
    assert staged == StagedKV(params={}, prompt_tokens=300, cached_tokens=32)
    assert staged_from_answer(answer(cached=None)).cached_tokens == 0


def test_staged_kv_rejects_an_answer_that_is_not_an_object() -> None:
    with pytest.raises(PrefillFailed) as failure:
        staged_from_answer([1, 2])
    assert failure.value.reason == "bad_answer"


async def test_prefill_posts_the_one_token_call_to_the_prefiller_with_the_request_id() -> None:
    seen: list[httpx.Request] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer(prompt_tokens=120, cached=0))

    request = parse_request("completion", orjson.dumps({"prompt": "p", "max_tokens": 9, "stream": True}))
    staged = await connector(engine).prefill(request, PREFILLER, "req-7")
    assert staged == StagedKV(params={}, prompt_tokens=120, cached_tokens=0)
    (call,) = seen
    assert str(call.url) == "http://127.0.0.1:9/v1/completions"
    assert call.headers["X-Request-Id"] == "req-7"
    assert orjson.loads(call.content) == {"prompt": "p", "max_tokens": 1, "stream": False, "return_token_ids": True}


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (httpx.Response(503, text="busy"), "status_5xx"),
        (httpx.Response(400, json={"error": {"message": "too long"}}), "status_4xx"),
        (httpx.Response(200, content=b"not json"), "bad_answer"),
    ],
)
async def test_prefill_fails_on_anything_but_a_200_json_answer(response: httpx.Response, reason: str) -> None:
    request = parse_request("chat", orjson.dumps(client_chat()))
    with pytest.raises(PrefillFailed) as failure:
        await connector(lambda _: response).prefill(request, PREFILLER, "req-1")
    assert failure.value.reason == reason


@pytest.mark.parametrize(
    ("error", "reason"),
    [(httpx.ConnectError("refused"), "connect_error"), (httpx.ReadTimeout("slow"), "timeout")],
)
async def test_prefill_fails_when_the_prefiller_cannot_be_reached(error: Exception, reason: str) -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        raise error

    request = parse_request("chat", orjson.dumps(client_chat()))
    with pytest.raises(PrefillFailed) as failure:
        await connector(engine).prefill(request, PREFILLER, "req-1")
    assert failure.value.reason == reason


def test_kv_connector_setting_selects_the_shared_storage_connector() -> None:
    settings = load_settings(decode_urls=["http://127.0.0.1:1"], kv_connector="shared_storage")
    built = build_connector(settings, EngineCalls(httpx.AsyncHTTPTransport(), {}))
    assert isinstance(built, SharedStorageConnector) and built.name == "shared_storage"


def test_the_prompt_ids_of_a_prefill_answer_are_kept_when_they_are_what_its_usage_counted() -> None:
    chat = {**answer(prompt_tokens=3, cached=0), "prompt_token_ids": [5, 6, 7]}
    assert staged_from_answer(chat).prompt_ids == [5, 6, 7]
    text = {**answer(prompt_tokens=2, cached=0), "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2]}]}
    assert staged_from_answer(text).prompt_ids == [1, 2]
    for wrong in ([5, 6], [5, 6, "7"], [5, 6, 7.0], None, "567"):
        assert staged_from_answer({**answer(prompt_tokens=3, cached=0), "prompt_token_ids": wrong}).prompt_ids is None
