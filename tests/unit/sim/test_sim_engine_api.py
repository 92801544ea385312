"""The simulated engine's OpenAI/vLLM surface, driven in-process through httpx.ASGITransport."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

EngineFactory = Callable[..., AbstractAsyncContextManager[Any]]

CHAT = [{"role": "user", "content": "Tell me about the river and the mountain."}]


def sse_events(text: str) -> list[Any]:
    """Each `data:` payload of an SSE body, JSON-decoded except the final `[DONE]`."""
    assert text.endswith("data: [DONE]\n\n")
    payloads = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in text.split("\n\n") if block)
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in payloads]


async def test_models_lists_the_served_model_with_its_max_len(engine: EngineFactory) -> None:
    async with engine(model="m1", max_model_len=4096) as e:
        body = (await e.client.get("/v1/models")).json()
    assert body["object"] == "list"
    card = body["data"][0]
    assert (card["id"], card["object"], card["owned_by"], card["root"]) == ("m1", "model", "vllm", "m1")
    assert card["max_model_len"] == 4096 and card["parent"] is None and card["permission"] == []


async def test_tokenize_counts_prompt_and_chat_messages(engine: EngineFactory) -> None:
    async with engine(max_model_len=4096) as e:
        prompt = (await e.client.post("/tokenize", json={"prompt": "hello world"})).json()
        chat = (await e.client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": True})).json()
        completion = (await e.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})).json()
    assert prompt["count"] == len(prompt["tokens"]) and prompt["max_model_len"] == 4096
    assert prompt["token_strs"] is None
    assert chat["count"] == completion["usage"]["prompt_tokens"]


async def test_health_load_and_metrics_names(engine: EngineFactory) -> None:
    async with engine(model="m1") as e:
        assert (await e.client.get("/health")).status_code == 200
        assert (await e.client.get("/load")).json() == {"server_load": 0}
        await e.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        text = (await e.client.get("/metrics")).text
    samples = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_num_kv_expired_reqs_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:nixl_xfer_time_seconds_count",
        "sim:remote_prefills_total",
        "sim:kv_transfers_total",
        "sim:local_prefills_total",
    ):
        assert name in samples, name
    assert 'vllm:generation_tokens_total{engine="0",model_name="m1"} 2.0' in text
    assert not any(sample.endswith("_created") for sample in samples)


async def test_text_completion_body_shape_and_usage(engine: EngineFactory) -> None:
    async with engine() as e:
        response = await e.client.post(
            "/v1/completions",
            json={"model": "sim-model", "prompt": "hello world", "max_tokens": 5, "top_k": 3, "whatever": [1]},
            headers={"X-Request-Id": "req-1"},
        )
    body = response.json()
    assert response.status_code == 200
    assert body["id"] == "cmpl-req-1" and body["object"] == "text_completion" and body["model"] == "sim-model"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_chat_completion_body_shape(engine: EngineFactory) -> None:
    async with engine() as e:
        body = (await e.client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 3})).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"].split()) == 3
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 3


async def test_chat_stream_opens_with_role_and_ends_with_usage_and_done(engine: EngineFactory) -> None:
    async with engine() as e:
        response = await e.client.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    role, *tokens, usage, done = events
    assert done == "[DONE]"
    assert role["object"] == "chat.completion.chunk" and role["id"].startswith("chatcmpl-")
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(tokens) == 4
    assert [chunk["choices"][0]["finish_reason"] for chunk in tokens] == [None, None, None, "length"]
    assert all(set(chunk["choices"][0]["delta"]) == {"content"} for chunk in tokens)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert {chunk["id"] for chunk in events[:-1]} == {role["id"]}


async def test_text_stream_chunks_and_no_usage_unless_asked(engine: EngineFactory) -> None:
    async with engine() as e:
        response = await e.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
        whole = (await e.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})).json()
    *chunks, done = sse_events(response.text)
    assert done == "[DONE]" and len(chunks) == 3
    assert all(chunk["object"] == "text_completion" and "usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole["choices"][0]["text"]


async def test_batch_and_token_prompts_give_one_choice_each(engine: EngineFactory) -> None:
    async with engine() as e:
        batch = (await e.client.post("/v1/completions", json={"prompt": ["a b", "c d"], "max_tokens": 2})).json()
        ids = (await e.client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2})).json()
        flat = (await e.client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})).json()
    assert [choice["index"] for choice in batch["choices"]] == [0, 1]
    assert batch["usage"]["completion_tokens"] == 4
    assert ids["usage"]["prompt_tokens"] == 5 and len(ids["choices"]) == 2
    assert flat["choices"][0]["text"] == ids["choices"][0]["text"]


async def test_output_is_a_function_of_prompt_seed_and_position(engine: EngineFactory) -> None:
    request = {"prompt": "the quick river", "max_tokens": 8}
    async with engine() as first, engine() as second:
        a = (await first.client.post("/v1/completions", json=request)).json()["choices"][0]["text"]
        b = (await second.client.post("/v1/completions", json=request)).json()["choices"][0]["text"]
        seeded = await first.client.post("/v1/completions", json={**request, "seed": 7})
        longer = await first.client.post("/v1/completions", json={**request, "max_tokens": 12})
    assert a == b
    assert seeded.json()["choices"][0]["text"] != a
    assert longer.json()["choices"][0]["text"].startswith(a)


async def test_repeated_prompt_hits_the_prefix_cache(engine: EngineFactory) -> None:
    prompt = " ".join(["river mountain garden"] * 40)
    async with engine() as e:
        first = (await e.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).json()
        second = (await e.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).json()
        steps = list(e.core.scheduler.steps)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 16 * 16 and cached > 0
    prefills = [step.tokens for step in steps if step.kind == "prefill"]
    assert prefills == [prompt_tokens, prompt_tokens - cached]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/chat/completions", {"max_tokens": 2}, "messages"),
        ("/v1/completions", {"max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream"),
        ("/v1/completions", {"prompt": [1, "x"]}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "vocabulary"),
    ],
)
async def test_invalid_requests_answer_400_like_vllm(
    engine: EngineFactory, path: str, body: dict[str, Any], message: str
) -> None:
    async with engine(max_model_len=128) as e:
        response = await e.client.post(path, json=body)
        stats = (await e.client.get("/sim/stats")).json()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] is None
    assert message in error["message"]
    assert stats["requests_total"] == 0


async def test_the_output_is_capped_at_the_room_the_prompt_leaves_like_vllm(engine: EngineFactory) -> None:
    async with engine(max_model_len=128) as e:
        capped = await e.client.post("/v1/completions", json={"prompt": [7] * 120, "max_tokens": 100, "min_tokens": 8})
    usage = capped.json()["usage"]
    assert capped.status_code == 200 and (usage["prompt_tokens"], usage["completion_tokens"]) == (120, 8)
    assert capped.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 129}, "max_tokens=129 cannot be greater than", "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 129},
            "max_completion_tokens=129 cannot be greater than max_model_len=128",
            "max_completion_tokens",
        ),
        ("/v1/completions", {"prompt": [7] * 130}, "your prompt contains 130 input tokens", "input_tokens"),
        (
            "/v1/completions",
            {"prompt": "word " * 200},
            "your prompt contains at least 129 input tokens",
            "input_tokens",
        ),
        ("/v1/completions", {"prompt": [7] * 128}, "max_tokens must be at least 1, got 0.", "max_tokens"),
    ],
)
async def test_what_the_context_cannot_hold_is_refused_in_vllms_words(
    engine: EngineFactory, path: str, body: dict[str, Any], message: str, param: str
) -> None:
    async with engine(max_model_len=128) as e:
        response = await e.client.post(path, json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "BadRequestError"
    assert message in error["message"] and error["param"] == param


async def test_bad_json_and_unknown_model(engine: EngineFactory) -> None:
    async with engine() as e:
        bad = await e.client.post("/v1/completions", content=b"{not json")
        unknown = await e.client.post("/v1/completions", json={"model": "gpt-x", "prompt": "hi"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"


async def test_prefill_for_remote_decode_stages_kv_under_a_lease(engine: EngineFactory) -> None:
    async with engine(role="prefill", port=8123, engine_id="engine-p") as e:
        body = (
            await e.client.post(
                "/v1/completions",
                json={"prompt": "word " * 40, "max_tokens": 50, "kv_transfer_params": {"do_remote_decode": True}},
            )
        ).json()
        stats = (await e.client.get("/sim/stats")).json()
    params = body["kv_transfer_params"]
    tokens = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "engine-p" and params["remote_port"] == 8123
    assert params["remote_host"] == "127.0.0.1" and params["tp_size"] == 1
    assert params["remote_request_id"].startswith("cmpl-") and params["remote_num_tokens"] == tokens
    assert len(params["remote_block_ids"][0]) == -(-tokens // 16)
    assert stats["remote_prefills"] == 1 and stats["leases_active"] == 1
    assert stats["recent"][-1]["kind"] == "remote_prefill"


async def test_roles_refuse_the_other_half_of_nixl(engine: EngineFactory) -> None:
    async with engine(role="decode") as decoder, engine(role="prefill") as prefiller:
        as_prefiller = await decoder.client.post(
            "/v1/completions", json={"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}
        )
        as_decoder = await prefiller.client.post(
            "/v1/completions", json={"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}}
        )
        local = await prefiller.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        stats = (await prefiller.client.get("/sim/stats")).json()
    assert as_prefiller.status_code == 400 and as_decoder.status_code == 400
    assert local.status_code == 200 and stats["local_prefills"] == 1


async def test_decoder_without_valid_kv_fails_in_band(engine: EngineFactory) -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "cmpl-x"}
    async with engine(role="decode") as e:
        whole = await e.client.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": params})
        stream = await e.client.post(
            "/v1/chat/completions", json={"messages": CHAT, "stream": True, "kv_transfer_params": params}
        )
        stats = (await e.client.get("/sim/stats")).json()
        metrics = (await e.client.get("/metrics")).text
    assert whole.status_code == 200
    choice = whole.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "error")
    role, error, done = sse_events(stream.text)
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert error["choices"][0]["finish_reason"] == "error" and error["choices"][0]["delta"] == {"content": ""}
    assert done == "[DONE]"
    assert stats["failed_transfers"] == 2 and stats["kv_transfers"] == 0 and stats["local_prefills"] == 0
    assert [record["status"] for record in stats["recent"]] == ["error", "error"]
    assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="sim-model"} 2.0' in metrics


async def test_faults_dead_error_and_counts(engine: EngineFactory) -> None:
    async with engine() as e:
        await e.client.post("/sim/fault", json={"mode": "dead"})
        assert (await e.client.get("/health")).status_code == 503
        dead = await e.client.post("/v1/completions", json={"prompt": "hi"})
        await e.client.post("/sim/fault", json={"mode": "error_500", "count": 1})
        failed = await e.client.post("/v1/completions", json={"prompt": "hi"})
        recovered = await e.client.post("/v1/completions", json={"prompt": "hi"})
        bad_mode = await e.client.post("/sim/fault", json={"mode": "melt"})
    assert dead.status_code == 503
    assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
    assert recovered.status_code == 200 and recovered.json()["choices"][0]["finish_reason"] == "length"
    assert bad_mode.status_code == 400


async def test_fault_no_kv_params_and_reject_kv(engine: EngineFactory) -> None:
    async with engine(role="both") as e:
        await e.client.post("/sim/fault", json={"mode": "no_kv_params", "count": 1})
        prefill = await e.client.post(
            "/v1/completions", json={"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}
        )
        params = (
            await e.client.post(
                "/v1/completions", json={"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}
            )
        ).json()["kv_transfer_params"]
        await e.client.post("/sim/fault", json={"mode": "reject_kv"})
        rejected = await e.client.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": params})
        stats = (await e.client.get("/sim/stats")).json()
    assert prefill.status_code == 200 and prefill.json()["kv_transfer_params"] is None
    assert params is not None
    assert rejected.json()["choices"][0]["finish_reason"] == "error"
    assert stats["failed_transfers"] == 1 and stats["leases_active"] == 1


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk_like_vllm(engine: EngineFactory) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": CHAT, "max_tokens": 3, "min_tokens": 3, "stream": True, "stream_options": options}
    async with engine() as e:
        response = await e.client.post("/v1/chat/completions", json=body)
    *chunks, final, done = sse_events(response.text)
    assert [chunk["usage"]["completion_tokens"] for chunk in chunks] == [0, 1, 2, 3], "the role chunk counts none"
    assert all("prompt_tokens_details" not in chunk["usage"] for chunk in chunks)
    assert final["choices"] == [] and "prompt_tokens_details" in final["usage"] and done == "[DONE]"


async def test_more_choices_than_the_simulator_holds_are_refused_not_allocated(engine: EngineFactory) -> None:
    """A request for 2**63 - 1 choices once took a simulated decoder to 23 GB and the OOM killer."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2**63 - 1}
    async with engine() as e:
        refused = await e.client.post("/v1/chat/completions", json=body)
        served = await e.client.post("/v1/chat/completions", json={**body, "n": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    assert served.status_code == 200 and len(served.json()["choices"]) == 3


async def test_return_token_ids_puts_the_ids_where_vllm_does(engine: EngineFactory) -> None:
    async with engine(max_model_len=4096) as e:
        counted = (await e.client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": True})).json()
        chat = (
            await e.client.post(
                "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "return_token_ids": True}
            )
        ).json()
        plain = (await e.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3})).json()
        text = (
            await e.client.post(
                "/v1/completions", json={"prompt": "hello world", "max_tokens": 2, "return_token_ids": True}
            )
        ).json()
        prompt = (await e.client.post("/tokenize", json={"prompt": "hello world"})).json()
    assert chat["prompt_token_ids"] == counted["tokens"] and len(chat["choices"][0]["token_ids"]) == 3
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert text["choices"][0]["prompt_token_ids"] == prompt["tokens"] and "prompt_token_ids" not in text
    assert len(text["choices"][0]["token_ids"]) == 2
