"""The LMCache connector: the prefill and decode bodies, the ProxyNotif socket, and the client's answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio

from dpd_router.config import load_settings
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineCalls
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import PrefillFailed
from dpd_router.startup.connectors import build_connector
from dpd_router.transfer import chat_chunks
from dpd_router.transfer.base import Handoff, StagedKV
from dpd_router.transfer.lmcache.bodies import decode_body, prefill_body
from dpd_router.transfer.lmcache.compat import unsupported
from dpd_router.transfer.lmcache.connector import LMCacheConnector
from dpd_router.transfer.lmcache.notify import ProxyNotifications
from dpd_router.transfer.lmcache.receivers import Receiver, ReceiverMap
from dpd_router.transfer.lmcache.rewrite import Continuation, FirstToken, answered_by_prefill
from dpd_sim.ports import free_port

PREFILLER = Endpoint("http://10.0.0.1:8000", "prefill")
DECODER = Endpoint("http://10.0.0.9:8000", "decode")
PROMPT = Prompt(token_ids=[5, 6, 7, 8], num_tokens=4, seconds=0.0)
SPEC = {"req_id": "r-1", "receiver_host": "10.0.0.9", "receiver_init_port": [8300], "receiver_alloc_port": [8400]}


def client_chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "a long prompt"}],
        "max_completion_tokens": 20,
        "min_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def prefill_answer(**params: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 17,
        "model": "m",
        "choices": [{"index": 0, "text": " river", "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 1,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 2},
        },
        "kv_transfer_params": params or {"first_tok": 42},
    }


def test_prefill_body_sends_token_ids_one_token_and_where_to_push_the_kv() -> None:
    request = parse_request("chat", orjson.dumps(client_chat()))
    body = prefill_body(request, PROMPT, SPEC)
    assert body["prompt"] == [5, 6, 7, 8]
    assert (body["max_tokens"], body["stream"]) == (1, False)
    assert body["kv_transfer_params"] == {"ret_first_tok": True, "disagg_spec": SPEC}
    for dropped in ("messages", "max_completion_tokens", "stream_options"):
        assert dropped not in body
    assert body["min_tokens"] == 1, "the client's minimum of 3 starts with the prefiller's token"
    assert body["temperature"] == 0 and body["model"] == "m"
    assert request.body == client_chat(), "the client's body stays as sent"


@pytest.mark.parametrize(
    ("minimum", "on_prefill", "on_decode"),
    [(None, None, None), (0, None, None), (1, 1, None), (3, 1, 2)],
)
def test_a_minimum_length_keeps_the_first_token_from_ending_the_answer(
    minimum: int | None, on_prefill: int | None, on_decode: int | None
) -> None:
    request = parse_request("chat", orjson.dumps(client_chat(min_tokens=minimum)))
    assert prefill_body(request, PROMPT, SPEC).get("min_tokens") == on_prefill
    assert decode_body(request, PROMPT, 42).get("min_tokens") == on_decode


def test_decode_body_continues_after_the_first_token_as_a_plain_completion() -> None:
    request = parse_request("chat", orjson.dumps(client_chat()))
    body = decode_body(request, PROMPT, 42)
    assert body["prompt"] == [5, 6, 7, 8, 42]
    assert body["max_tokens"] == 19 and "max_completion_tokens" not in body
    assert body["min_tokens"] == 2
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "messages" not in body and "kv_transfer_params" not in body


@pytest.mark.parametrize(
    ("kind", "body", "max_tokens"),
    [
        ("chat", {"messages": [{"role": "user", "content": "x"}]}, None),  # the rest of the context, as vLLM does
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}, 4),
        ("completion", {"prompt": "x"}, 15),  # vLLM's completion default is 16
        ("completion", {"prompt": "x", "max_tokens": 2}, 1),
    ],
)
def test_decode_body_asks_for_the_tokens_left(kind: Any, body: dict[str, Any], max_tokens: int | None) -> None:
    request = parse_request(kind, orjson.dumps(body))
    assert decode_body(request, PROMPT, 1)["max_tokens"] == max_tokens


def test_receivers_default_to_the_decoders_host_unless_named() -> None:
    special = Endpoint("http://10.0.0.8:8000", "decode")
    receivers = ReceiverMap([8300, 8301], [8400, 8401], {special.url: Receiver("rdma-8", (9000,), (9100,))})
    assert receivers.for_decoder(DECODER).spec("r") == {
        "req_id": "r",
        "receiver_host": "10.0.0.9",
        "receiver_init_port": [8300, 8301],
        "receiver_alloc_port": [8400, 8401],
    }
    assert receivers.for_decoder(special) == Receiver("rdma-8", (9000,), (9100,))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "the 'tools' field"),
        ({"logprobs": True, "top_logprobs": 2}, "the 'logprobs' field"),
        ({"n": 2}, "n > 1"),
        ({"response_format": {"type": "json_object"}}, "the 'response_format' field"),
        ({"response_format": {"type": "text"}}, None),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, None),
        ({"temperature": 0.7, "stop": ["\n"], "echo": False}, None),
        ({"max_tokens": 1}, "a one-token answer"),
        ({"max_completion_tokens": 1, "max_tokens": 9}, "a one-token answer"),
        ({"chat_template": "{{ messages }}"}, "the 'chat_template' field"),
        ({"add_special_tokens": True}, "the 'add_special_tokens' field"),
        ({"add_special_tokens": False}, None),
        ({"truncate_prompt_tokens": 100}, "the 'truncate_prompt_tokens' field"),
        ({"documents": [{"text": "d"}]}, "the 'documents' field"),
        ({"mm_processor_kwargs": {"fps": 1}}, "the 'mm_processor_kwargs' field"),
        ({"reasoning_effort": "low"}, "the 'reasoning_effort' field"),
        ({"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True}, None),
    ],
)
def test_requests_the_continuation_cannot_reproduce_are_served_direct(body: dict[str, Any], why: str | None) -> None:
    raw = orjson.dumps({"messages": [{"role": "user", "content": "x"}], **body})
    request = parse_request("chat", raw, trust_chat_template=True)
    assert unsupported(request) == why


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ([{"type": "text", "text": "x"}], None),
        ([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}], "content that is not text"),
        ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "content that is not text"),
        ([{"type": "text", "text": "x"}, {"type": "text", "text": "y"}], "content in several parts"),
    ],
)
def test_content_the_router_cannot_render_is_served_direct(content: list[dict[str, Any]], why: str | None) -> None:
    request = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": content}]}))
    assert unsupported(request) == why


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"add_generation_prompt": False},
        {"continue_final_message": True},
    ],
)
def test_without_a_local_tokenizer_only_plain_chat_templates_are_continued(body: dict[str, Any]) -> None:
    """An engine's /tokenize is told the messages alone: these would render another prompt there."""
    request = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": "x"}], **body}))
    assert unsupported(request, local_tokenizer=True) is None
    assert unsupported(request, local_tokenizer=False) == f"the '{next(iter(body))}' field"
    plain = parse_request(
        "chat",
        orjson.dumps(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
        ),
    )
    assert unsupported(plain, local_tokenizer=False) is None, "the engine joins content parts itself"


def test_a_batched_prompt_is_not_for_lmcache() -> None:
    assert unsupported(parse_request("completion", orjson.dumps({"prompt": ["a", "b"]}))) == "a batched prompt"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"logprobs": 0}, "the 'logprobs' field"),
        ({"best_of": 1}, None),
        ({"max_tokens": 1}, "a one-token answer"),
        ({"add_special_tokens": True}, None),
        ({"add_special_tokens": False}, "the 'add_special_tokens' field"),
    ],
)
def test_text_completion_fields_count_by_value(body: dict[str, Any], why: str | None) -> None:
    assert unsupported(parse_request("completion", orjson.dumps({"prompt": "x", **body}))) == why


def test_the_first_token_must_be_in_the_prefill_answer() -> None:
    first = FirstToken.from_answer(prefill_answer())
    assert (first.token_id, first.text, first.finish_reason) == (42, " river", "length")
    assert not first.ends_the_answer
    with pytest.raises(PrefillFailed) as failure:
        FirstToken.from_answer({**prefill_answer(), "kv_transfer_params": {"num_lmcache_cached_tokens": 0}})
    assert failure.value.reason == "bad_answer"
    with pytest.raises(PrefillFailed):
        FirstToken.from_answer({**prefill_answer(), "kv_transfer_params": None})


@pytest.mark.parametrize("finish_reason", ["error", "abort"])
def test_a_prefill_the_engine_failed_is_a_failed_hop_not_a_finished_answer(finish_reason: str) -> None:
    failed = {**prefill_answer(), "choices": [{"index": 0, "text": "", "finish_reason": finish_reason}]}
    with pytest.raises(PrefillFailed) as failure:
        FirstToken.from_answer(failed)
    assert failure.value.reason == "in_band_error"


def test_chat_stream_starts_with_role_and_the_prefillers_token_then_converts_completion_chunks() -> None:
    answer = Continuation("chat", FirstToken.from_answer(prefill_answer()))
    head = [orjson.loads(event[len(b"data: ") :]) for event in answer.head().split(b"\n\n") if event]
    assert [event["object"] for event in head] == ["chat.completion.chunk"] * 2
    assert head[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert head[1]["choices"][0]["delta"] == {"content": " river"}
    assert {event["id"] for event in head} == {"chatcmpl-abc"}

    head_fields = {"object": "text_completion", "created": 18, "model": "m"}
    token = {"index": 0, "text": " flows", "finish_reason": None, "logprobs": None}
    chunk = answer.chunk({"id": "cmpl-other", **head_fields, "choices": [token]})
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-abc"
    assert chunk["created"] == head[0]["created"] == 17, "one answer: the head's creation time"
    assert chunk["choices"] == [{"index": 0, "delta": {"content": " flows"}, "logprobs": None, "finish_reason": None}]
    usage = answer.chunk(
        {
            "id": "x",
            **head_fields,
            "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        }
    )
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    error = {"error": {"message": "boom"}}
    assert answer.chunk(dict(error)) == error


def test_whole_chat_answer_puts_the_first_token_in_front() -> None:
    answer = Continuation("chat", FirstToken.from_answer(prefill_answer()))
    body = answer.body(
        {
            "id": "cmpl-d",
            "object": "text_completion",
            "created": 18,
            "model": "m",
            "choices": [{"index": 0, "text": " flows on", "finish_reason": "length", "prompt_logprobs": None}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            "kv_transfer_params": None,
        }
    )
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-abc"
    assert body["created"] == 17, "the prefiller's answer began it"
    assert body["choices"][0]["message"]["content"] == " river flows on"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert "kv_transfer_params" not in body


def test_text_completion_keeps_its_own_shape() -> None:
    answer = Continuation("completion", FirstToken.from_answer(prefill_answer()))
    (head,) = [orjson.loads(event[len(b"data: ") :]) for event in answer.head().split(b"\n\n") if event]
    assert head["object"] == "text_completion" and head["choices"][0]["text"] == " river"
    body = answer.body({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " on"}]})
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " river on"


@pytest.mark.parametrize("stream", [True, False])
def test_a_one_token_answer_is_built_from_the_prefill_alone(stream: bool) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    request = parse_request("chat", orjson.dumps(body))
    first = FirstToken.from_answer(prefill_answer())
    raw = answered_by_prefill(request, 4, first)
    answer = Continuation("chat", first)
    if not stream:
        whole = answer.body(orjson.loads(raw))
        assert whole["choices"][0]["message"]["content"] == " river"
        assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
        return
    events = [event for event in raw.split(b"\n\n") if event]
    assert events[-1] == b"data: [DONE]"
    chunks = [answer.chunk(orjson.loads(event[len(b"data: ") :])) for event in events[:-1]]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}


@pytest.mark.parametrize("stream", [True, False])
def test_a_prefill_that_stopped_keeps_its_stop_reason(stream: bool) -> None:
    stopped = {**prefill_answer(), "choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": 7}]}
    first = FirstToken.from_answer(stopped)
    assert first.ends_the_answer and first.stop_reason == 7
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stream": stream}
    raw = answered_by_prefill(parse_request("chat", orjson.dumps(body)), 4, first)
    answer = Continuation("chat", first)
    if stream:
        choice = answer.chunk(orjson.loads(raw.split(b"\n\n")[0][len(b"data: ") :]))["choices"][0]
    else:
        choice = answer.body(orjson.loads(raw))["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 7)


def test_completion_chunks_to_chat_pass_errors_through() -> None:
    assert chat_chunks.chunk_to_chat({"error": {"message": "x"}}) == {"error": {"message": "x"}}
    assert chat_chunks.chat_id("cmpl-1") == "chatcmpl-1" and chat_chunks.chat_id("other") == "other"


# -- the ProxyNotif socket and the prefill hop ----------------------------------------------------


@pytest.fixture
async def notifications() -> AsyncIterator[ProxyNotifications]:
    board = ProxyNotifications(f"tcp://127.0.0.1:{free_port()}")
    await board.start()
    yield board
    await board.close()


async def push(address: str, *messages: Any) -> None:
    context = zmq.asyncio.Context()
    sender = context.socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 1000)
    sender.connect(address)
    for message in messages:
        await sender.send(message if isinstance(message, bytes) else msgpack.packb(message))
    sender.close()
    context.term()


async def test_a_hand_off_lands_when_every_rank_has_notified(notifications: ProxyNotifications) -> None:
    notifications.expect("r-1", 2)
    await push(notifications.address, {"type": "ProxyNotif", "req_id": "r-1"})
    assert not await notifications.wait("r-1", 0.2), "one of two ranks is not enough"
    await push(notifications.address, {"type": "ProxyNotif", "req_id": "r-1"})
    assert await notifications.wait("r-1", 5.0)


async def test_other_messages_and_unknown_ids_are_ignored(notifications: ProxyNotifications) -> None:
    notifications.expect("mine", 1)
    await push(
        notifications.address,
        b"\xc1 not msgpack",
        {"type": "AllocRequest", "req_id": "mine"},
        {"type": "ProxyNotif", "req_id": "someone-else"},
        {"type": "ProxyNotif", "req_id": 7},
    )
    assert not await notifications.wait("mine", 0.3)
    assert notifications.ignored == 4 and notifications.received == 0


def connector(handler: Any, notifications: ProxyNotifications, **options: Any) -> LMCacheConnector:
    return LMCacheConnector(
        EngineCalls(httpx.MockTransport(handler), {}),
        timeout=httpx.Timeout(5.0),
        receivers=ReceiverMap([8300], [8400]),
        notifications=notifications,
        notify_timeout=options.pop("notify_timeout", 5.0),
        **options,
    )


def chat_handoff(lmcache: LMCacheConnector, **extra: Any) -> Handoff:
    request = parse_request("chat", orjson.dumps(client_chat(**extra)))
    return lmcache.handoff(request, PROMPT, PREFILLER, DECODER, "req-9")


async def test_stage_posts_the_prefill_and_waits_for_the_notification(notifications: ProxyNotifications) -> None:
    seen: list[httpx.Request] = []

    async def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        req_id = orjson.loads(request.content)["kv_transfer_params"]["disagg_spec"]["req_id"]
        asyncio.get_running_loop().call_later(
            0.05, lambda: asyncio.ensure_future(push(notifications.address, {"type": "ProxyNotif", "req_id": req_id}))
        )
        return httpx.Response(200, json=prefill_answer())

    lmcache = connector(engine, notifications)
    handoff = chat_handoff(lmcache)
    staged = await lmcache.stage(handoff)
    assert staged == StagedKV(params={"first_tok": 42}, prompt_tokens=4, cached_tokens=2)
    (call,) = seen
    assert str(call.url) == "http://10.0.0.1:8000/v1/completions"
    assert call.headers["X-Request-Id"] == "req-9"
    spec = orjson.loads(call.content)["kv_transfer_params"]["disagg_spec"]
    assert spec["req_id"].startswith("req-9-") and spec["receiver_host"] == "10.0.0.9"
    assert notifications._waiting == {}, "nothing is kept once the hop is over"

    decode = lmcache.decode_call(handoff, staged)
    assert decode.path == "/v1/completions" and decode.answered is None
    assert orjson.loads(decode.body)["prompt"] == [5, 6, 7, 8, 42]
    assert decode.head.startswith(b"data: ")


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (httpx.Response(200, json=prefill_answer()), "no_notification"),
        (httpx.Response(200, json={**prefill_answer(), "kv_transfer_params": {}}), "bad_answer"),
        (httpx.Response(500, text="boom"), "status_5xx"),
    ],
)
async def test_stage_fails_without_first_token_or_notification(
    notifications: ProxyNotifications, response: httpx.Response, reason: str
) -> None:
    lmcache = connector(lambda _: response, notifications, notify_timeout=0.1)
    with pytest.raises(PrefillFailed) as failure:
        await lmcache.stage(chat_handoff(lmcache))
    assert failure.value.reason == reason
    if reason == "no_notification":
        assert len(notifications._waiting) == 1, "still listened for: the KV may land late"
        await lmcache.close()
    assert notifications._waiting == {}


class Engines:
    """A prefiller that answers with token 42, and a decoder that records what it is asked."""

    def __init__(self, notifications: ProxyNotifications, *, notify: bool = True, decoder_delay: float = 0.0) -> None:
        self.notifications = notifications
        self.notify = notify
        self.decoder_delay = decoder_delay
        self.req_ids: list[str] = []
        self.decoder_calls: list[httpx.Request] = []
        self.decoder_called = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == PREFILLER.url.split("//")[1].split(":")[0]:
            self.req_ids.append(orjson.loads(request.content)["kv_transfer_params"]["disagg_spec"]["req_id"])
            if self.notify:
                await self.land()
            return httpx.Response(200, json=prefill_answer())
        self.decoder_calls.append(request)
        self.decoder_called.set()
        await asyncio.sleep(self.decoder_delay)
        return httpx.Response(200, json={"choices": [{"index": 0, "text": " x", "finish_reason": "length"}]})

    async def land(self) -> None:
        await push(self.notifications.address, {"type": "ProxyNotif", "req_id": self.req_ids[-1]})


def assert_drained(call: httpx.Request) -> None:
    assert str(call.url) == "http://10.0.0.9:8000/v1/completions"
    assert call.headers["X-Request-Id"] == "req-9-drain"
    assert orjson.loads(call.content) == {"prompt": [5, 6, 7, 8, 42], "max_tokens": 1, "stream": False, "model": "m"}


async def test_kv_no_decode_call_picks_up_is_drained_with_a_one_token_continuation(
    notifications: ProxyNotifications,
) -> None:
    engines = Engines(notifications)
    lmcache = connector(engines, notifications)
    handoff = chat_handoff(lmcache)
    staged = replace(await lmcache.stage(handoff), handoff=handoff)
    assert engines.decoder_calls == []
    lmcache.release_unused(staged)
    async with asyncio.timeout(5):
        await engines.decoder_called.wait()
    (call,) = engines.decoder_calls
    assert_drained(call)
    async with asyncio.timeout(5):
        while lmcache.drained == 0:  # noqa: ASYNC110 - the drain task reads the answer
            await asyncio.sleep(0.01)
    await lmcache.close()


async def test_a_hand_off_whose_notification_comes_late_is_drained_when_it_lands(
    notifications: ProxyNotifications,
) -> None:
    engines = Engines(notifications, notify=False)
    lmcache = connector(engines, notifications, notify_timeout=0.1)
    with pytest.raises(PrefillFailed):
        await lmcache.stage(chat_handoff(lmcache))
    await asyncio.sleep(0.1)
    assert engines.decoder_calls == [], "nothing landed yet: a drain would recompute the prompt"
    await engines.land()
    async with asyncio.timeout(5):
        await engines.decoder_called.wait()
    assert_drained(engines.decoder_calls[0])
    await lmcache.close()
    assert notifications._waiting == {}


async def test_a_hand_off_cancelled_after_the_prefill_answered_is_drained_once_it_lands(
    notifications: ProxyNotifications,
) -> None:
    engines = Engines(notifications, notify=False)
    lmcache = connector(engines, notifications)
    staging = asyncio.ensure_future(lmcache.stage(chat_handoff(lmcache)))
    async with asyncio.timeout(5):
        while not engines.req_ids:  # noqa: ASYNC110 - the prefill answered, the notification is awaited
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    staging.cancel()
    with pytest.raises(asyncio.CancelledError):
        await staging
    await engines.land()
    async with asyncio.timeout(5):
        await engines.decoder_called.wait()
    assert_drained(engines.decoder_calls[0])
    await lmcache.close()


async def test_closing_the_connector_cancels_its_drains(notifications: ProxyNotifications) -> None:
    engines = Engines(notifications, decoder_delay=30)
    lmcache = connector(engines, notifications)
    handoff = chat_handoff(lmcache)
    lmcache.release_unused(replace(await lmcache.stage(handoff), handoff=handoff))
    async with asyncio.timeout(5):
        await engines.decoder_called.wait()
        await lmcache.close()
    assert lmcache.drained == 0


@pytest.mark.parametrize(
    ("answer", "max_tokens", "answered"),
    [
        (prefill_answer(), 1, True),
        ({**prefill_answer(), "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}, 8, True),
        (prefill_answer(), 8, False),
    ],
)
async def test_no_decoder_call_when_the_prefill_already_ended_the_answer(
    notifications: ProxyNotifications, answer: dict[str, Any], max_tokens: int, answered: bool
) -> None:
    lmcache = connector(lambda _: httpx.Response(500), notifications)
    handoff = chat_handoff(lmcache, max_completion_tokens=max_tokens)
    staged = StagedKV(params={"first_tok": 42}, prompt_tokens=4, cached_tokens=0, answer=answer)
    assert (lmcache.decode_call(handoff, staged).answered is not None) is answered


def test_kv_connector_setting_selects_lmcache_with_its_ports() -> None:
    settings = load_settings(
        decode_urls=["http://10.0.0.9:8000", "http://10.0.0.8:8000"],
        kv_connector="lmcache",
        lmcache_receiver_init_ports="8300,8301",
        lmcache_receiver_alloc_ports="8400,8401",
        lmcache_receivers={"http://10.0.0.8:8000": {"host": "rdma-8", "init_ports": [9000], "alloc_ports": [9100]}},
    )
    built = build_connector(settings, EngineCalls(httpx.AsyncHTTPTransport(), {}))
    assert isinstance(built, LMCacheConnector) and built.name == "lmcache" and not built.concurrent
    handoff = built.handoff(parse_request("completion", b'{"prompt": "x"}'), PROMPT, PREFILLER, DECODER, "r")
    assert handoff.transfer["disagg_spec"]["receiver_init_port"] == [8300, 8301]
    assert built.expected_notifications(handoff) == 2
    other = built.handoff(
        parse_request("completion", b'{"prompt": "x"}'),
        PROMPT,
        PREFILLER,
        Endpoint("http://10.0.0.8:8000", "decode"),
        "r",
    )
    assert other.transfer["disagg_spec"]["receiver_host"] == "rdma-8"


def test_lmcache_ports_need_one_pair_per_rank() -> None:
    from dpd_router.config import SettingsError

    with pytest.raises(SettingsError, match="lmcache_receiver_init_ports"):
        load_settings(decode_urls=["http://a:1"], lmcache_receiver_init_ports=[1, 2], lmcache_receiver_alloc_ports=[3])


async def test_the_relay_rewrites_a_continuation_stream_after_a_head_the_router_sent() -> None:
    from dpd_router.gateway.relay import EventStream
    from dpd_router.record.observe import Ending, Output

    def completion(text: str, finish: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        event = {"id": "cmpl-d", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
        return b"data: " + orjson.dumps(event) + b"\n\n"

    usage = {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    upstream_events = [
        completion(" flows"),
        completion(" on", "length"),
        b"data: " + orjson.dumps({"id": "cmpl-d", "choices": [], "usage": usage}) + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    output = Output()
    output.mark_token_chunk(0.0)  # the head (the prefiller's token) already went out
    answer = Continuation("chat", FirstToken.from_answer(prefill_answer()))
    upstream = httpx.Response(200, stream=httpx.ByteStream(b"".join(upstream_events)))
    stream = EventStream(
        upstream, Ending(), output, cached_tokens=0, on_close=lambda: None, idle_timeout=5, rewrite=answer.chunk
    )
    await stream.prime(asyncio.get_running_loop().time() + 5)
    out = b"".join([chunk async for chunk in stream])
    events = [orjson.loads(e[len(b"data: ") :]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"content": " flows"}, {"content": " on"}]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[2]["usage"]["prompt_tokens"] == 4 and events[2]["usage"]["completion_tokens"] == 3
    assert events[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, "the prefiller's view"
    assert output.completion_tokens == 3 and output.decoder_cached_tokens == 4
    assert output.token_chunks == 3, "the head and the decoder's two chunks"


async def test_a_notification_address_taken_stops_the_router_before_anything_else_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dpd_router.startup import components, model_stack

    address = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.asyncio.Context()
    holder = context.socket(zmq.PULL)
    holder.bind(address)
    clients: list[httpx.AsyncClient] = []
    built = components.build_client
    monkeypatch.setattr(
        components,
        "build_client",
        lambda settings, transport: clients.append(built(settings, transport)) or clients[-1],
    )

    async def no_tokenizer(*args: Any) -> Any:
        raise AssertionError("nothing else is started once the notification socket cannot be bound")

    monkeypatch.setattr(model_stack, "load_tokenizers", no_tokenizer)
    settings = load_settings(decode_urls=["http://127.0.0.1:1"], kv_connector="lmcache", lmcache_notify_address=address)
    try:
        with pytest.raises(zmq.ZMQError):
            await components.Components.start(settings)
    finally:
        holder.close(linger=0)
        context.term()
    assert [client.is_closed for client in clients] == [True]


@pytest.mark.parametrize(
    ("address", "prefillers", "warned"),
    [
        ("tcp://127.0.0.1:8500", ["http://10.0.0.1:8000"], True),
        ("tcp://localhost:8500", ["http://prefill-0.vllm:8000"], True),
        ("tcp://127.0.0.1:8500", ["http://127.0.0.1:8100"], False),
        ("tcp://0.0.0.0:8500", ["http://10.0.0.1:8000"], False),
        ("tcp://*:8500", ["http://10.0.0.1:8000"], False),
    ],
)
def test_a_loopback_notification_address_with_remote_prefillers_is_warned_about(
    caplog: pytest.LogCaptureFixture, address: str, prefillers: list[str], warned: bool
) -> None:
    from dpd_router.startup.connectors import warn_about_connector

    settings = load_settings(
        prefill_urls=prefillers,
        decode_urls=["http://10.0.0.9:8000"],
        kv_connector="lmcache",
        lmcache_notify_address=address,
    )
    with caplog.at_level("WARNING", logger="dpd_router.app"):
        warn_about_connector(settings)
    assert any("loopback" in record.getMessage() for record in caplog.records) is warned
