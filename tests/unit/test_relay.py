from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpd_router.gateway.relay import DecodeFailedEarly, EventStream, relay_body
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Ending, Observer, Output, RequestTrace


class Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], error: Exception | None = None) -> None:
        self.chunks = chunks
        self.error = error
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


def event(payload: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
TOKEN = event({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
LAST = event({"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]})
USAGE = event(
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 2,
            "total_tokens": 302,
            "prompt_tokens_details": {"cached_tokens": 300},
        },
    }
)
DONE = b"data: [DONE]\n\n"


async def relay(chunks: list[bytes], *, cached: int | None = None, error: Exception | None = None):
    stream = Chunks(chunks, error)
    trace, output, ending = RequestTrace(request_id="r", kind="chat", stream=True), Output(), Ending()
    closed: list[bool] = []

    def on_close() -> None:  # the request ends: its record takes the output and the ending (Completion)
        closed.append(True)
        trace.take(output, ending=ending)

    relayed = EventStream(
        httpx.Response(200, stream=stream), ending, output, cached_tokens=cached, on_close=on_close, idle_timeout=5
    )
    out = b"".join([part async for part in relayed])
    return out, trace, stream, closed


async def test_events_pass_through_unchanged_and_upstream_is_closed() -> None:
    chunks = [ROLE, TOKEN, LAST, USAGE, DONE]
    out, trace, stream, closed = await relay(chunks)
    assert out == b"".join(chunks)
    assert stream.closed and closed == [True]
    assert trace.outcome == "ok"
    assert trace.token_chunks == 2  # neither the role-only chunk nor the usage chunk carries a token
    assert trace.completion_tokens == 2
    assert trace.cached_tokens == 300


async def test_events_split_across_reads_are_reassembled() -> None:
    whole = ROLE + TOKEN + LAST + DONE
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    out, trace, _, _ = await relay(pieces)
    assert out == whole
    assert trace.first_token_at is not None and trace.outcome == "ok"


async def test_usage_reports_the_prefillers_cached_tokens() -> None:
    out, trace, _, _ = await relay([TOKEN, LAST, USAGE, DONE], cached=16)
    usage_event = next(e for e in out.split(b"\n\n") if b"usage" in e)
    usage = orjson.loads(usage_event[len(b"data: ") :])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 16
    assert usage["prompt_tokens"] == 300
    assert trace.cached_tokens == 16


async def test_continuous_usage_chunks_pass_as_the_engine_wrote_them() -> None:
    """stream_options.continuous_usage_stats: vLLM puts a usage block without prompt_tokens_details on
    every chunk, and the details on the last usage only; the router reconciles that one alone."""
    running = {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301}
    token = event({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}], "usage": running})
    last = event(
        {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}], "usage": {**running}}
    )
    out, trace, _, _ = await relay([token, last, USAGE, DONE], cached=16)
    events = out.split(b"\n\n")
    assert events[0] + b"\n\n" == token and events[1] + b"\n\n" == last, "no block the engine did not send"
    assert orjson.loads(events[2][len(b"data: ") :])["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert trace.cached_tokens == 16 and trace.decoder_cached_tokens == 300


async def test_usage_without_cached_tokens_is_not_given_any() -> None:
    """An engine run without --enable-prompt-tokens-details reports none: the router adds none."""
    usage = event({"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 2, "total_tokens": 302}})
    out, trace, _, _ = await relay([TOKEN, LAST, usage, DONE], cached=16)
    assert out == TOKEN + LAST + usage + DONE
    assert trace.cached_tokens == 16, "the metrics still count the prefiller's view"


async def test_stream_cut_before_done_ends_with_an_error_event() -> None:
    out, trace, _, _ = await relay([TOKEN], error=httpx.ReadError("reset"))
    assert out.startswith(TOKEN)
    assert b'"error"' in out and out.endswith(DONE)
    assert trace.outcome == "upstream_error"


async def test_stream_closed_without_done_is_flagged_and_terminated() -> None:
    out, trace, _, _ = await relay([TOKEN, LAST])
    assert trace.outcome == "upstream_truncated"
    assert out.endswith(DONE)


async def test_in_band_engine_error_is_recorded() -> None:
    failed = event({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]})
    out, trace, _, _ = await relay([failed, DONE])
    assert out == failed + DONE
    assert trace.outcome == "upstream_error"


async def test_closing_before_the_end_counts_a_client_disconnect() -> None:
    stream = Chunks([TOKEN, LAST, DONE])
    ending = Ending()
    relayed = EventStream(
        httpx.Response(200, stream=stream), ending, Output(), cached_tokens=None, on_close=lambda: None, idle_timeout=5
    )
    iterator = relayed.__aiter__()
    await iterator.__anext__()
    await iterator.aclose()
    assert stream.closed
    assert ending.outcome == "client_disconnect"


def test_whole_answer_usage_is_reconciled() -> None:
    answer = {
        "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 10},
        },
    }
    output = Output()
    relayed = relay_body(orjson.dumps(answer), output, cached_tokens=0)
    assert orjson.loads(relayed.content)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert output.completion_tokens == 1 and output.first_token_at is not None and relayed.failure is None
    failed = {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "error"}]}
    assert (
        relay_body(orjson.dumps(failed), Output(), None).failure
        == "the engine ended the request with finish_reason=error"
    )


def test_observer_records_metrics_once() -> None:
    metrics = RouterMetrics()
    observer = Observer(metrics)
    trace = RequestTrace(request_id="r", kind="chat", stream=True, path="disaggregated", prompt_tokens=500)
    output = Output()
    output.mark_token_chunk(trace.started + 0.5)
    trace.take(output)
    observer.finish(trace)
    observer.finish(trace)
    value = metrics.registry.get_sample_value
    live = {"model": "", "arm": "live", "path": "disaggregated"}
    assert value("dpd_router_requests_total", {**live, "api": "chat", "outcome": "ok"}) == 1
    # under its prompt-length bucket (500 tokens: the 512 bucket), once, under the same arm
    in_bucket = {**live, "prompt_tokens": "512"}
    assert value("dpd_router_time_to_first_token_seconds_count", in_bucket) == 1
    assert value("dpd_router_time_to_first_token_seconds_sum", in_bucket) == 0.5
    assert value("dpd_router_e2e_latency_seconds_count", in_bucket) == 1
    # a request whose prompt nobody counted: the empty bucket
    uncounted = RequestTrace(request_id="u", kind="chat", stream=False, path="direct")
    observer.finish(uncounted)
    assert (
        value(
            "dpd_router_e2e_latency_seconds_count", {"model": "", "arm": "live", "path": "direct", "prompt_tokens": ""}
        )
        == 1
    )


def stream_of(
    chunks: list[bytes], *, idle: float = 5, gap: float = 0.0
) -> tuple[EventStream, RequestTrace, Chunks, Ending]:
    class Slow(Chunks):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for chunk in self.chunks:
                await asyncio.sleep(gap)
                yield chunk

    upstream = Slow(chunks)
    trace, output, ending = RequestTrace(request_id="r", kind="chat", stream=True), Output(), Ending()
    return (
        EventStream(
            httpx.Response(200, stream=upstream),
            ending,
            output,
            cached_tokens=None,
            on_close=lambda: trace.take(output, ending=ending),
            idle_timeout=idle,
        ),
        trace,
        upstream,
        ending,
    )


async def test_prime_reads_up_to_the_first_token_and_the_stream_replays_it() -> None:
    stream, trace, _, _ = stream_of([ROLE, TOKEN, LAST, DONE])
    await stream.prime(asyncio.get_running_loop().time() + 5)
    out = b"".join([part async for part in stream])
    assert out == ROLE + TOKEN + LAST + DONE
    assert trace.first_token_at is not None and trace.token_chunks == 2


async def test_an_error_before_the_first_token_is_retryable_and_nothing_was_sent() -> None:
    failed = event({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]})
    stream, _, upstream, ending = stream_of([ROLE, failed, DONE])
    with pytest.raises(DecodeFailedEarly):
        await stream.prime(asyncio.get_running_loop().time() + 5)
    assert upstream.closed
    assert ending.outcome == "ok", "a retried attempt leaves no failure on the request"


async def test_no_first_token_by_the_deadline_times_out() -> None:
    stream, _, _, _ = stream_of([TOKEN, DONE], gap=1.0)
    with pytest.raises(TimeoutError):
        await stream.prime(asyncio.get_running_loop().time() + 0.05)
    await stream.close()


async def test_a_stream_idle_for_too_long_ends_with_an_error_event() -> None:
    stream, trace, _, _ = stream_of([TOKEN, LAST, DONE], idle=0.05, gap=0.5)
    out = b"".join([part async for part in stream])
    assert b'"error"' in out and out.endswith(DONE)
    assert trace.outcome == "upstream_timeout"


async def test_a_usage_chunk_the_client_did_not_ask_for_is_read_then_dropped() -> None:
    upstream = Chunks([TOKEN, LAST, USAGE, DONE])
    output = Output()
    relayed = EventStream(
        httpx.Response(200, stream=upstream),
        Ending(),
        output,
        cached_tokens=None,
        on_close=lambda: None,
        idle_timeout=5,
        strip_usage=True,
    )
    out = b"".join([part async for part in relayed])
    assert out == TOKEN + LAST + DONE
    assert output.completion_tokens == 2 and output.decoder_cached_tokens == 300


def test_a_decoder_that_recomputed_the_staged_prompt_is_an_ineffective_transfer() -> None:
    from dpd_router.record.observe import transfer_was_ineffective

    def trace(decoder_cached: int | None, staged: int | None, path: str = "disaggregated") -> RequestTrace:
        t = RequestTrace(request_id="r", kind="chat", stream=True, path=path)
        t.decoder_cached_tokens, t.staged_tokens = decoder_cached, staged
        return t

    assert transfer_was_ineffective(trace(0, 300))
    assert not transfer_was_ineffective(trace(299, 300))
    assert not transfer_was_ineffective(trace(None, 300)), "an engine that does not report cached tokens"
    assert not transfer_was_ineffective(trace(0, 300, path="direct"))
    echoed = trace(0, 300)
    echoed.usage_shows_transfer = False  # vLLM >= 0.32 decoders report the prefiller's cache hit
    assert not transfer_was_ineffective(echoed)
    metrics = RouterMetrics()
    Observer(metrics).finish(trace(0, 300))
    assert metrics.registry.get_sample_value("dpd_router_kv_transfer_ineffective_total") == 1


def test_the_request_log_line_carries_the_evidence_of_the_routing_decision(caplog: pytest.LogCaptureFixture) -> None:
    trace = RequestTrace(request_id="r", kind="chat", stream=True, path="disaggregated", reason="adaptive_interference")
    trace.prompt_tokens, trace.uncached_tokens, trace.decoder_streams, trace.prefiller_queue = 900, 900, 12.0, 3000.0
    with caplog.at_level("INFO", logger="dpd_router.request"):
        Observer(RouterMetrics()).finish(trace)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("Conditional routing")]
    fields = record.fields  # type: ignore[attr-defined]
    assert (fields["reason"], fields["decoder_streams"], fields["prefiller_queue_tokens"]) == (
        "adaptive_interference",
        12.0,
        3000.0,
    )


async def test_a_slow_client_is_not_taken_for_an_idle_decoder() -> None:
    stream, trace, _, _ = stream_of([TOKEN, LAST, DONE], idle=0.1)
    out = b""
    async for part in stream:
        out += part
        await asyncio.sleep(0.3)  # the client takes its time; the decoder had everything ready
    assert out == TOKEN + LAST + DONE and trace.outcome == "ok"


async def test_each_read_gets_the_whole_idle_limit_however_long_the_stream() -> None:
    stream, trace, _, _ = stream_of([TOKEN] * 8 + [LAST, DONE], idle=0.25, gap=0.1)
    out = b"".join([part async for part in stream])
    assert out.endswith(DONE) and b'"error"' not in out and trace.outcome == "ok"


async def test_a_cancel_from_outside_during_a_read_stays_a_cancel() -> None:
    stream, trace, _, _ = stream_of([TOKEN, LAST, DONE], idle=0.2, gap=0.15)

    async def relay() -> None:
        async for _ in stream:
            pass

    task = asyncio.create_task(relay())
    await asyncio.sleep(0.2)  # inside the second read, whose idle limit is still ahead
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert trace.outcome == "client_disconnect"


@given(reads=st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(0, 400)), max_size=30))
def test_the_chunks_of_one_read_marked_together_leave_the_output_as_marked_one_by_one(
    reads: list[tuple[float, int]],
) -> None:
    """A read's token chunks reached the router together: one call for them records the same first token,
    gaps (bounded) and count as a call for each."""
    together, apart = Output(), Output()
    now = 0.0
    for wait, count in reads:
        now += wait
        together.mark_token_chunks(now, count)
        for _ in range(count):
            apart.mark_token_chunk(now)
    for field in ("first_token_at", "last_chunk_at", "token_chunks", "gaps"):
        assert getattr(together, field) == getattr(apart, field), field
