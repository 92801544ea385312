from __future__ import annotations

import orjson
import pytest

from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import PrefillFailed
from dpd_router.transfer.nixl import decode_body, prefill_body, staged_from_answer

KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "e-1",
    "remote_request_id": "cmpl-1",
    "remote_host": "10.1.2.3",
    "remote_port": 5600,
    "tp_size": 1,
}


def client_chat() -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "long prompt"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 200,
        "max_completion_tokens": 200,
        "min_tokens": 10,
        "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "lookup"}}],
    }


def test_prefill_body_asks_for_one_token_and_remote_decode() -> None:
    request = parse_request("chat", orjson.dumps(client_chat()))
    body = prefill_body(request)
    assert body["max_tokens"] == 1
    assert body["max_completion_tokens"] == 1
    assert body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert body["tools"] == client_chat()["tools"]
    assert request.body == client_chat(), "the client's body must stay as sent for the decoder"


def test_prefill_body_adds_max_completion_tokens_only_when_the_client_sent_it() -> None:
    request = parse_request("completion", orjson.dumps({"prompt": "x", "max_tokens": 50}))
    assert "max_completion_tokens" not in prefill_body(request)


def test_the_prefill_answer_brings_the_prompts_ids_only_where_the_router_wants_them() -> None:
    """Asked of the decoder (by the client, or for a stream's continuation), not of the prefiller: the router
    decides whether thousands of prompt ids come back from the prefill call."""
    request = parse_request("chat", orjson.dumps({**client_chat(), "return_token_ids": True}))
    assert prefill_body(request, ids=True)["return_token_ids"] is True
    assert "return_token_ids" not in prefill_body(request, ids=False)
    assert request.body["return_token_ids"] is True, "the decode call still asks for them"


def test_decode_body_is_the_original_plus_params_verbatim() -> None:
    request = parse_request("chat", orjson.dumps(client_chat()))
    body = decode_body(request, KV_PARAMS)
    assert body == {**client_chat(), "kv_transfer_params": KV_PARAMS}
    assert body["kv_transfer_params"]["remote_host"] == "10.1.2.3"  # never rewritten


def test_staged_kv_reads_params_and_prefiller_cache_view() -> None:
    answer = {
        "id": "cmpl-1",
        "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 32},
        },
        "kv_transfer_params": KV_PARAMS,
    }
    staged = staged_from_answer(answer)
    assert staged.params is KV_PARAMS
    assert (staged.prompt_tokens, staged.cached_tokens) == (300, 32)


@pytest.mark.parametrize("params", [None, {}, "x"])
def test_answer_without_kv_params_is_a_prefill_failure(params: object) -> None:
    with pytest.raises(PrefillFailed) as caught:
        staged_from_answer({"choices": [], "kv_transfer_params": params})
    assert caught.value.reason == "no_kv_params"
