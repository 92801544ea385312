"""The SGLang connector: bootstrap fields, one body for both engines, and the prefill call running beside the decode."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from dpd_router.config import load_settings
from dpd_router.gateway.concurrent import prefiller_cached_tokens, unless_prefill_fails
from dpd_router.gateway.errors import HANDOFF_FAILED, DecodeFailed
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineCalls
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import PrefillFailed
from dpd_router.startup.connectors import build_connector
from dpd_router.transfer.base import ENGINE_PATHS, StagedKV
from dpd_router.transfer.sglang import SGLangConnector, bootstrap_fields

PREFILLER = Endpoint("http://10.0.0.1:8000", "prefill")
OTHER_PREFILLER = Endpoint("http://10.0.0.2:8000", "prefill")
DECODER = Endpoint("http://10.0.0.9:8000", "decode")
PROMPT = Prompt(token_ids=[1, 2, 3], num_tokens=3, seconds=0.0)


def connector(handler: Any = None, **options: Any) -> SGLangConnector:
    transport = httpx.MockTransport(handler or (lambda _: httpx.Response(500)))
    return SGLangConnector(EngineCalls(transport, {}), timeout=httpx.Timeout(5.0), path_for=ENGINE_PATHS, **options)


def chat(**extra: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, **extra}
    return parse_request("chat", orjson.dumps(body))


def test_one_prompt_gets_one_random_63_bit_room() -> None:
    fields = bootstrap_fields(chat(), "10.0.0.1", 8998)
    assert (fields["bootstrap_host"], fields["bootstrap_port"]) == ("10.0.0.1", 8998)
    room = fields["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    assert bootstrap_fields(chat(), "10.0.0.1", 8998)["bootstrap_room"] != room


def test_a_batch_gets_a_room_a_host_and_a_port_per_prompt() -> None:
    request = parse_request("completion", orjson.dumps({"prompt": ["a", "b", "c"]}))
    fields = bootstrap_fields(request, "10.0.0.1", 7000)
    assert fields["bootstrap_host"] == ["10.0.0.1"] * 3 and fields["bootstrap_port"] == [7000] * 3
    assert len(set(fields["bootstrap_room"])) == 3


def test_bootstrap_port_is_the_default_unless_the_prefiller_has_its_own() -> None:
    sglang = connector(bootstrap_ports={OTHER_PREFILLER.url: 9100})
    assert sglang.handoff(chat(), PROMPT, PREFILLER, DECODER, "r").transfer["bootstrap_port"] == 8998
    other = sglang.handoff(chat(), PROMPT, OTHER_PREFILLER, DECODER, "r").transfer
    assert (other["bootstrap_host"], other["bootstrap_port"]) == ("10.0.0.2", 9100)


async def test_prefiller_and_decoder_get_the_same_body_with_the_same_room() -> None:
    seen: list[httpx.Request] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}}
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {}}], "usage": usage})

    sglang = connector(engine)
    request = chat(stream=True, stream_options={"include_usage": True})
    handoff = sglang.handoff(request, PROMPT, PREFILLER, DECODER, "req-3")
    staged = await sglang.stage(handoff)
    assert (staged.prompt_tokens, staged.cached_tokens) == (3, 2)
    (call,) = seen
    assert str(call.url) == "http://10.0.0.1:8000/v1/chat/completions"
    assert call.headers["X-Request-Id"] == "req-3"
    decode = sglang.decode_call(handoff, staged)
    assert decode.path == "/v1/chat/completions" and decode.answer is None and decode.head == b""
    assert decode.body == call.content, "one body for both engines"
    sent = orjson.loads(decode.body)
    assert {k: sent[k] for k in request.body} == request.body, "the client's fields, unchanged"
    assert sent["bootstrap_room"] == handoff.transfer["bootstrap_room"]


async def test_a_streamed_prefill_answer_is_read_to_its_end() -> None:
    events = (
        b'data: {"choices":[{"index":0,"delta":{"content":" a"},"finish_reason":"length"}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
        b"data: [DONE]\n\n"
    )
    sglang = connector(lambda _: httpx.Response(200, content=events))
    staged = await sglang.stage(sglang.handoff(chat(stream=True), PROMPT, PREFILLER, DECODER, "r"))
    assert (staged.prompt_tokens, staged.cached_tokens) == (3, 1)


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (httpx.Response(500, text="boom"), "status_5xx"),
        (httpx.Response(400, json={"error": {"message": "bad"}}), "status_4xx"),
        (
            httpx.Response(200, content=b'data: {"error": {"message": "transfer failed"}}\n\ndata: [DONE]\n\n'),
            "in_band_error",
        ),
        (httpx.Response(200, json={"choices": [{"index": 0, "finish_reason": "error"}]}), "in_band_error"),
        (httpx.Response(200, content=b"{not json"), "bad_answer"),
    ],
)
async def test_a_failed_prefill_call_is_prefill_failed(response: httpx.Response, reason: str) -> None:
    sglang = connector(lambda _: response)
    with pytest.raises(PrefillFailed) as failure:
        await sglang.stage(sglang.handoff(chat(), PROMPT, PREFILLER, DECODER, "r"))
    assert failure.value.reason == reason


def test_kv_connector_setting_selects_sglang() -> None:
    settings = load_settings(
        prefill_urls=["http://10.0.0.1:8000"],
        decode_urls=["http://10.0.0.9:8000"],
        kv_connector="sglang",
        sglang_bootstrap_port=9000,
        sglang_bootstrap_ports={"10.0.0.1:8000": 9001},
    )
    built = build_connector(settings, EngineCalls(httpx.AsyncHTTPTransport(), {}))
    assert isinstance(built, SGLangConnector) and built.concurrent and built.batches
    assert not built.serves_direct, "a decode-mode server needs a bootstrap room"
    assert built.bootstrap_port(PREFILLER) == 9001 and built.bootstrap_port(OTHER_PREFILLER) == 9000


# -- the decode call racing the prefill call ------------------------------------------------------


async def test_a_prefill_that_fails_first_cancels_the_decode_call() -> None:
    cancelled = asyncio.Event()

    async def decode() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "answer"

    async def prefill() -> StagedKV:
        await asyncio.sleep(0.01)
        raise PrefillFailed("status_5xx", "boom")

    with pytest.raises(PrefillFailed):
        await unless_prefill_fails(decode(), asyncio.ensure_future(prefill()))
    assert cancelled.is_set()


async def test_a_prefill_that_succeeds_lets_the_decode_call_finish() -> None:
    async def decode() -> str:
        await asyncio.sleep(0.05)
        return "answer"

    async def prefill() -> StagedKV:
        return StagedKV(params={}, prompt_tokens=3, cached_tokens=1)

    pending = asyncio.ensure_future(prefill())
    assert await unless_prefill_fails(decode(), pending) == "answer"
    staged = StagedKV(params={}, prompt_tokens=None, cached_tokens=0, pending=pending)
    assert prefiller_cached_tokens(staged) == 1, "the prefiller's count, once its call ended"


async def test_a_decoder_that_answers_first_wins_even_if_the_prefill_later_fails() -> None:
    async def prefill() -> StagedKV:
        await asyncio.sleep(0.05)
        raise PrefillFailed("timeout", "late")

    async def decode() -> str:
        return "answer"

    pending = asyncio.ensure_future(prefill())
    assert await unless_prefill_fails(decode(), pending) == "answer"
    assert prefiller_cached_tokens(StagedKV(params={}, prompt_tokens=None, cached_tokens=0, pending=pending)) is None
    with pytest.raises(PrefillFailed):
        await pending


def decoder_failure() -> DecodeFailed:
    return DecodeFailed("http://10.0.0.9:8000 answered 500: boom", kv_consumed=True, failure="status 500")


async def failing_decode() -> str:
    raise decoder_failure()


async def test_a_decoder_failing_while_the_prefill_runs_waits_for_the_prefills_outcome() -> None:
    async def prefill() -> StagedKV:
        await asyncio.sleep(0.05)
        raise PrefillFailed("status_5xx", "the prefiller failed too")

    with pytest.raises(PrefillFailed) as failure:
        await unless_prefill_fails(failing_decode(), asyncio.ensure_future(prefill()), grace=5)
    assert failure.value.reason == "status_5xx", "the prefill's failure, not the decoder's"


async def test_a_decoder_failing_while_the_prefill_still_runs_is_a_failed_hand_off() -> None:
    pending = asyncio.ensure_future(asyncio.sleep(10))
    with pytest.raises(PrefillFailed) as failure:
        await unless_prefill_fails(failing_decode(), pending, grace=0.05)  # type: ignore[arg-type]
    assert failure.value.reason == HANDOFF_FAILED
    assert not pending.done(), "the caller cancels it"
    pending.cancel()


async def test_a_decoder_failing_after_the_prefill_did_its_part_is_the_decoders_failure() -> None:
    async def prefill() -> StagedKV:
        return StagedKV(params={}, prompt_tokens=3, cached_tokens=0)

    pending = asyncio.ensure_future(prefill())
    await pending
    with pytest.raises(DecodeFailed):
        await unless_prefill_fails(failing_decode(), pending, grace=5)

    pending = asyncio.ensure_future(asyncio.sleep(0.05, StagedKV(params={}, prompt_tokens=3, cached_tokens=0)))
    with pytest.raises(DecodeFailed):
        await unless_prefill_fails(failing_decode(), pending, grace=5)


async def test_a_cancelled_caller_is_not_turned_into_a_prefill_failure() -> None:
    """The client left while the decode call, cancelled after the prefill failed, was still closing."""
    closing = asyncio.Event()

    async def decode() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            closing.set()
            await asyncio.sleep(0.2)  # closing its connection takes a moment
            raise
        return "answer"

    async def prefill() -> StagedKV:
        await asyncio.sleep(0.01)
        raise PrefillFailed("status_5xx", "boom")

    caller = asyncio.ensure_future(unless_prefill_fails(decode(), asyncio.ensure_future(prefill())))
    await closing.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
