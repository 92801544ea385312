"""A Messages API answer relayed: its named events watched for the first token, the end and the usage; the
usage reconciled to the prefiller's cache hit; a cut stream ended with the API's own error event."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from dpd_router.gateway.relay import DecodeFailedEarly, EventStream, failed_before_output, relay_body
from dpd_router.gateway.wires import MESSAGES_WIRE
from dpd_router.record.observe import Ending, Output, RequestTrace
from tests.unit.test_relay import Chunks


def named(name: str, payload: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


START_USAGE = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 300}
START = named("message_start", {"type": "message_start", "message": {"id": "m", "content": [], "usage": START_USAGE}})
BLOCK = named("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}})
TOKEN = named("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"text": "hi"}})
STOP_BLOCK = named("content_block_stop", {"type": "content_block_stop", "index": 0})
END_USAGE = {"input_tokens": 0, "output_tokens": 2, "cache_read_input_tokens": 300}
DELTA = named("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": END_USAGE})
STOP = named("message_stop", {"type": "message_stop"})


async def relay(chunks: list[bytes], *, cached: int | None = None, error: Exception | None = None):
    stream = Chunks(chunks, error)
    trace, output, ending = RequestTrace(request_id="r", kind="messages", stream=True), Output(), Ending()
    relayed = EventStream(
        httpx.Response(200, stream=stream), ending, output, cached_tokens=cached,
        on_close=lambda: trace.take(output, ending=ending), idle_timeout=5, wire=MESSAGES_WIRE,
    )  # fmt: skip
    return b"".join([part async for part in relayed]), trace


def usage_of(out: bytes, name: bytes) -> dict[str, int]:
    event = next(e for e in out.split(b"\n\n") if e.startswith(b"event: " + name))
    payload = orjson.loads(event.split(b"\ndata: ", 1)[1])
    return payload["usage"] if "usage" in payload else payload["message"]["usage"]


async def test_a_whole_stream_passes_unchanged_its_tokens_and_usage_counted() -> None:
    chunks = [START, BLOCK, TOKEN, TOKEN, STOP_BLOCK, DELTA, STOP]
    out, trace = await relay(chunks)
    assert out == b"".join(chunks)
    assert trace.outcome == "ok"
    assert trace.first_token_at is not None
    assert trace.token_chunks == 3  # the two text deltas and the message's end
    assert trace.completion_tokens == 2
    assert trace.engine_prompt_tokens == 300 and trace.cached_tokens == 300


async def test_the_prefillers_cache_hit_replaces_the_decoders_with_the_uncached_rest() -> None:
    out, trace = await relay([START, BLOCK, TOKEN, STOP_BLOCK, DELTA, STOP], cached=100)
    for name in (b"message_start", b"message_delta"):
        usage = usage_of(out, name)
        assert usage["cache_read_input_tokens"] == 100
        assert usage["input_tokens"] == 200, "the prompt's total stays the engine's"
    assert trace.cached_tokens == 100 and trace.decoder_cached_tokens == 300


async def test_a_stream_cut_before_message_stop_ends_with_the_apis_error_event() -> None:
    out, trace = await relay([START, BLOCK, TOKEN], error=httpx.ReadError("reset"))
    assert trace.outcome == "upstream_error"
    last = out.split(b"\n\n")[-2]
    assert last.startswith(b"event: error\ndata: ")
    assert orjson.loads(last.split(b"data: ", 1)[1])["error"]["type"] == "api_error"

    _, truncated = await relay([START, BLOCK, TOKEN, STOP_BLOCK, DELTA])
    assert truncated.outcome == "upstream_truncated", "no message_stop"


async def test_an_error_event_before_any_token_fails_the_stream_early() -> None:
    error = named("error", {"type": "error", "error": {"type": "internal_error", "message": "engine broke"}})
    stream = EventStream(
        httpx.Response(200, stream=Chunks([START, error])),
        Ending(),
        Output(),
        cached_tokens=None, on_close=lambda: None, idle_timeout=5, wire=MESSAGES_WIRE,
    )  # fmt: skip
    with pytest.raises(DecodeFailedEarly, match="engine broke"):  # another decoder may still serve it
        await stream.prime(asyncio.get_running_loop().time() + 5)


def test_a_whole_message_has_its_usage_reconciled() -> None:
    answer = {"type": "message", "content": [{"type": "text", "text": "hi"}], "usage": dict(END_USAGE)}
    output = Output()
    content, output_tokens, failure = relay_body(orjson.dumps(answer), output, 40, wire=MESSAGES_WIRE)
    usage = orjson.loads(content)["usage"]
    assert output_tokens == 2 and failure is None  # what the decode hop learns its deadline by
    assert usage == {"input_tokens": 260, "output_tokens": 2, "cache_read_input_tokens": 40}
    assert output.completion_tokens == 2 and output.prompt_tokens == 300

    failed = {"type": "error", "error": {"type": "api_error", "message": "no"}, "usage": {"output_tokens": 0}}
    assert failed_before_output(orjson.dumps(failed), MESSAGES_WIRE) == "no"
