"""The decode hop: one call to one decoder, up to its first token (streams) or its whole answer.

Every way a decode call can fail before the client saw a byte becomes a `DecodeFailed` here (the
one error map of the hop), which `DecoderReplacement` turns into the next decoder to try. A learned
deadline, where another decoder could take the request, and before there is history a look at the
decoder (gateway/watch.py) bound the wait for a hung decoder; a busy one is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterator

import anyio
import httpx

from dpd_router.gateway.answer import Answer, StreamedAnswer, WholeAnswer
from dpd_router.gateway.concurrent import prefiller_cached_tokens
from dpd_router.gateway.deadlines import LearnedDeadline
from dpd_router.gateway.errors import DecodeFailed, missed_learned_deadline
from dpd_router.gateway.exchange import Exchange
from dpd_router.gateway.policy import Deadline
from dpd_router.gateway.relay import DecodeFailedEarly, EventStream, RelayedBody, failed_before_output, relay_body
from dpd_router.gateway.resume import Resumer
from dpd_router.gateway.watch import EngineProbe, HopWatch, watch_hop
from dpd_router.gateway.wires import Wire, wire_of
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.engine_pool import PooledAnswer
from dpd_router.pool.served_model import ServedModel
from dpd_router.pool.transport import EngineAnswer, EngineCalls, arrived_whole
from dpd_router.prompt.context_window import output_budget
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.errors import UpstreamError, UpstreamTimeout
from dpd_router.transfer.base import Connector, DecodeCall, StagedKV

log = logging.getLogger("dpd_router.gateway")

# Seconds before the only decoder is tried again (times the attempt number).
SAME_DECODER_BACKOFF = 0.25


class DecodeHop:
    """Sends decode calls and reads their answers; built once, shared by all requests."""

    def __init__(
        self, engines: EngineCalls, connector: Connector, metrics: RouterMetrics, model: ServedModel, probe: EngineProbe
    ) -> None:
        self._engines = engines
        self._connector = connector
        self._metrics = metrics
        self._model = model
        self._probe = probe
        self._stream_disconnects = metrics.client_disconnects.labels("stream")  # built once, not per stream

    async def answer(
        self, exchange: Exchange, decoder: Endpoint, call: DecodeCall, staged: StagedKV | None, *, replaceable: bool
    ) -> Answer:
        """The decode call, until its first token (a stream) or its whole answer; `replaceable`: another
        decoder could take the request, so a learned deadline may judge this one."""
        request = exchange.request
        if call.answered is not None:
            return self.answer_from_prefill(exchange, call, staged)
        deadline = self._deadline(exchange, decoder, with_kv=staged is not None, replaceable=replaceable)
        try:
            exchange.done.kv_sent()
            upstream = await self.open(exchange, decoder, call, deadline)
            if upstream.status_code != 200 or not request.stream:
                exchange.done.kv_answered_by(decoder)  # a refusal, or the whole answer's status line
            if upstream.status_code != 200:
                return await self._engine_refusal(exchange, upstream, decoder)
            if not request.stream:
                return await self._whole_answer(exchange, upstream, decoder, staged, call, deadline)
            stream = await self.primed_stream(exchange, upstream, decoder, staged, call, deadline)
        finally:
            deadline.stop()
        # A stream's first token: vLLM sends a stream's status line before its engine has the request.
        exchange.done.kv_answered_by(decoder)
        return StreamedAnswer(stream, stream.close, exchange.headers, media_type=stream.media_type)

    async def open(self, exchange: Exchange, decoder: Endpoint, call: DecodeCall, deadline: Deadline) -> EngineAnswer:
        """Send the decode call and wait for its status line (reads are timed by the caller)."""
        headers = {
            "X-Request-Id": exchange.request_id,
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",  # the relay passes the bytes through as the decoder wrote them
        }
        late = "The decoder did not answer in time."
        with decode_errors(decoder, deadline, late=late, timeout_failure="timeout", broke="broke the connection"):
            async with deadline.bound():
                return await self._engines.post(
                    f"{decoder.url}{call.path}", call.body, headers, connect_timeout=exchange.timeouts.connect
                )

    async def primed_stream(
        self,
        exchange: Exchange,
        upstream: EngineAnswer,
        decoder: Endpoint,
        staged: StagedKV | None,
        call: DecodeCall,
        deadline: Deadline,
    ) -> EventStream:
        """The decoder's stream, read up to its first token (so a failing decoder can still be replaced)."""
        stream = self.event_stream(exchange, upstream, call, staged, decoder)
        if staged is not None and staged.pending is not None:
            # The prefiller's cache hit is known once its call ends, usually before the decoder's usage.
            staged.pending.add_done_callback(
                lambda _: setattr(stream, "cached_tokens", prefiller_cached_tokens(staged))
            )
        late = f"The decoder produced no token within {exchange.timeouts.first_token:g} s."
        primed = False
        try:
            with decode_errors(
                decoder, deadline, late=late, timeout_failure="no first token in time", broke="broke its stream"
            ):
                async with deadline.bound():
                    await stream.prime(deadline.at)
            primed = True
        except DecodeFailedEarly as exc:
            raise DecodeFailed(exc.detail, kv_consumed=True, failure=exc.detail, answered=True, in_band=True) from None
        finally:
            if not primed:
                await stream.discard()  # not handed to the client: close it here, whatever happened
        exchange.decode_judge.succeeded(decoder)
        self._learn(exchange, deadline, staged)
        return stream

    def answer_from_prefill(self, exchange: Exchange, call: DecodeCall, staged: StagedKV | None) -> Answer:
        """The prefill produced the whole answer (one token): relay it as a decoder's, without a decoder."""
        assert call.answered is not None
        exchange.output.decoder = None
        if not exchange.request.stream:
            content = self._relayed_whole(exchange, call.answered, call, staged, wire_of(exchange.request)).content
            exchange.done()
            return WholeAnswer(content, exchange.headers)
        stream = self.answered_stream(exchange, call, staged)
        return StreamedAnswer(stream, stream.close, exchange.headers)

    def answered_stream(self, exchange: Exchange, call: DecodeCall, staged: StagedKV | None) -> EventStream:
        """The prefill's own answer (its one token), relayed as a stream."""
        assert call.answered is not None
        upstream = httpx.Response(
            200, stream=httpx.ByteStream(call.answered), headers={"content-type": "text/event-stream"}
        )
        return self.event_stream(exchange, upstream, call, staged)

    def event_stream(
        self,
        exchange: Exchange,
        upstream: EngineAnswer,
        call: DecodeCall,
        staged: StagedKV | None,
        decoder: Endpoint | None = None,
    ) -> EventStream:
        """The relay of a decoder's stream (or of the prefill's answer, `decoder` None) to this client; a
        decoder's own stream (not one another API's answer is rebuilt from) may be continued elsewhere."""
        resumer = None
        wire = wire_of(exchange.request)
        continue_with = exchange.continue_with
        if exchange.resume is not None and continue_with is not None and decoder is not None and call.answer is None:
            resumer = Resumer(
                exchange.request,
                exchange.request_id,
                exchange.asked.started,
                exchange.ending,
                exchange.output,
                exchange.resume,
                decoder,
                self._metrics,
                open=functools.partial(continue_with, exchange),
                timeouts=exchange.timeouts,
                strip_usage=exchange.strip_usage,
                wire=wire,
            )
        return EventStream(
            upstream,
            exchange.ending,
            exchange.output,
            request_id=exchange.request_id,
            engine=decoder,
            cached_tokens=prefiller_cached_tokens(staged),
            on_close=exchange.done,
            idle_timeout=exchange.timeouts.idle,
            strip_usage=exchange.strip_usage,
            rewrite=None if call.answer is None else call.answer.chunk,
            on_disconnect=self._stream_disconnects.inc,
            wire=wire,
            resumer=resumer,
            on_first_token=exchange.first_token.reach,
        )

    async def _whole_answer(
        self,
        exchange: Exchange,
        upstream: EngineAnswer,
        decoder: Endpoint,
        staged: StagedKV | None,
        call: DecodeCall,
        deadline: Deadline,
    ) -> Answer:
        late = f"The decoder did not finish within {exchange.timeouts.total:g} s."
        try:
            # Mostly the answer came whole with its status line: then its read waits for nothing, and the
            # timeout scope around it (3 us) would bound nothing.
            content = arrived_whole(upstream)
            if content is None:
                with decode_errors(
                    decoder, deadline, late=late, timeout_failure="timeout", broke="broke off its answer"
                ):
                    async with deadline.bound():
                        content = await upstream.aread()
        finally:
            await close_quietly(upstream)
        decoder.progressed(asyncio.get_running_loop().time())
        # Judged on the decoder's own answer: a rewrite (LMCache's) counts the prefiller's token as output.
        wire = wire_of(exchange.request)
        failure = failed_before_output(content, wire)
        if failure is not None:
            raise DecodeFailed(
                f"the decoder failed the request in-band: {failure}",
                kv_consumed=True,
                failure=failure,
                answered=True,
                in_band=True,
            )
        relayed = self._relayed_whole(exchange, content, call, staged, wire)
        exchange.decode_judge.succeeded(decoder)
        self._learn(exchange, deadline, staged, relayed.output_tokens)
        exchange.done()
        return WholeAnswer(relayed.content, exchange.headers)

    @staticmethod
    def _relayed_whole(
        exchange: Exchange, content: bytes, call: DecodeCall, staged: StagedKV | None, wire: Wire
    ) -> RelayedBody:
        """A whole answer as its client gets it, marked on the request's output (the client's first token);
        an error the engine wrote in it is how the request ended."""
        rewrite = None if call.answer is None else call.answer.body
        relayed = relay_body(content, exchange.output, prefiller_cached_tokens(staged), rewrite, wire)
        if relayed.failure is not None:
            exchange.ending.fail("upstream_error", relayed.failure)
        exchange.first_token.reach()
        return relayed

    async def _engine_refusal(self, exchange: Exchange, upstream: EngineAnswer, decoder: Endpoint) -> Answer:
        """Pass an engine's 4xx through as it is (the request's fault); a 5xx is a decoder failure."""
        content = await read_refusal(upstream, decoder)
        status = upstream.status_code
        exchange.ending.fail("engine_rejected", f"decoder answered {status}", status=status)
        exchange.done()
        media_type = upstream.headers.get("content-type", "application/json")
        return WholeAnswer(content, exchange.headers, status=status, media_type=media_type)

    def _deadline(self, exchange: Exchange, decoder: Endpoint, *, with_kv: bool, replaceable: bool) -> Deadline:
        """When the decoder must have answered: its first token (streams) or its whole answer, by the
        phase's timeout, and the watch that may tell sooner that it will not.

        The learned deadline, where one is known and shorter than the phase's timeout, judges a
        non-streamed answer by its `max_tokens` (vLLM sends nothing before the whole answer), so a
        long answer still has the time an answer that long takes. It applies only while another
        decoder could take the request (a retry left, a decoder to take it): the last attempt, or
        the only decoder, merely slower than usual, keeps the timeout rather than fail for nothing;
        there, and before there is history, the watch cuts the call short only for a hung decoder.
        """
        request, timeouts = exchange.request, exchange.timeouts
        started = asyncio.get_running_loop().time()
        # Judged as if the decoder held none of the prompt it is to compute (it may have evicted what
        # the router believes it caches); learned by the router's estimate of what it computed.
        tokens = exchange.prompt.num_tokens if not with_kv else exchange.uncached_tokens
        cap = timeouts.first_token if request.stream else timeouts.total
        learned = None
        others = exchange.planner.pool.healthy("decode")
        if replaceable and any(other is not decoder for other in others):
            policy, deadlines = timeouts.learned, exchange.deadlines
            if request.stream:
                learned = deadlines.deadline_later("first_token", (tokens,), policy, cap, with_kv=with_kv)
            elif (output := self._most_output(exchange)) is not None:
                learned = deadlines.deadline_later("answer", (tokens, output), policy, cap, with_kv=with_kv)
        return Deadline(started, started + cap, self._watch(exchange, decoder, tokens, learned, cap))

    def continuation_deadline(self, exchange: Exchange, decoder: Endpoint) -> Deadline:
        """The deadline of a decode call whose client has its head already: the phase's timeout,
        cut short only for a hung decoder."""
        cap = exchange.timeouts.first_token
        started = asyncio.get_running_loop().time()
        return Deadline(started, started + cap, self._watch(exchange, decoder, exchange.prompt.num_tokens, None, cap))

    def _watch(
        self, exchange: Exchange, decoder: Endpoint, tokens: int, learned: LearnedDeadline | None, cap: float
    ) -> HopWatch | None:
        """The call's watch: at its learned deadline or, before there is history, when its first
        token should have come (a whole answer may take far longer, but an engine that answers the
        probe is waited for)."""
        timeouts = exchange.timeouts
        return watch_hop(
            decoder,
            tokens=tokens,
            learned=learned,
            cap=cap,
            floor=timeouts.learned.floor,
            probe=self._probe,
            model=_model_of(exchange),
            probe_timeout=timeouts.hang_probe,
        )

    def _most_output(self, exchange: Exchange) -> int | None:
        """The most output tokens the answer may have (None: not known, so no learned deadline)."""
        body, prompt = exchange.request.body, exchange.prompt
        _, limit = output_budget(exchange.request)
        if not isinstance(limit, int):
            # Unset, vLLM lets the answer run to the end of the context window.
            if self._model.max_model_len is None:
                return None
            limit = self._model.max_model_len - prompt.num_tokens
        choices = body.get("n")
        sequences = (choices if isinstance(choices, int) and choices > 1 else 1) * exchange.request.batch_size
        return max(limit, 1) * sequences

    @staticmethod
    def _learn(exchange: Exchange, deadline: Deadline, staged: StagedKV | None, output: int | None = None) -> None:
        """Learn from a decoder that answered in time: its first token, or its whole answer (of `output`
        tokens, as its usage counts them)."""
        seconds = asyncio.get_running_loop().time() - deadline.started
        tokens = exchange.uncached_tokens
        with_kv = staged is not None
        if exchange.request.stream:
            exchange.deadlines.learn("first_token", (tokens,), seconds, with_kv=with_kv)
        elif output is not None:
            exchange.deadlines.learn("answer", (tokens, output), seconds, with_kv=with_kv)


class DecoderReplacement:
    """The decoders one request has tried, and the next one after a failure: the one place a decoder
    that failed before the client saw a byte is judged and replaced (at most `decode_retries` times)."""

    def __init__(self, exchange: Exchange, metrics: RouterMetrics) -> None:
        self._exchange = exchange
        self._metrics = metrics
        self._tried: list[Endpoint] = []
        self.attempt = 0

    @property
    def replaceable(self) -> bool:
        """Whether a decoder failing now could still be replaced (a retry is left)."""
        return self.attempt < self._exchange.retries.decode_retries

    def failed(self, decoder: Endpoint, failure: DecodeFailed) -> None:
        """Judge `decoder`'s failure, and settle the staged KV it took or never received."""
        exchange = self._exchange
        exchange.decode_judge.failed(decoder, failure.failure, answered=failure.answered)
        self._tried.append(decoder)
        log.warning("request %s: decoder %s failed before answering: %s", exchange.request_id, decoder.url, failure)
        if failure.kv_consumed:
            exchange.done.kv_maybe_used_by(decoder)  # else held for the next decoder, or released

    async def next(self, decoder: Endpoint, failure: DecodeFailed) -> Endpoint:
        """The decoder to try after `decoder` failed; UpstreamError when none is left."""
        exchange = self._exchange
        replacement = exchange.planner.alternative("decode", exchange.prompt, exclude=self._tried)
        if replacement is None and decoder.available:
            # The only decoder left: try it again (with fresh KV if it may have used the staged
            # one). An unreachable one never saw the request, so resending it is safe.
            replacement = decoder
        if replacement is None or not self.replaceable:
            raise UpstreamError(f"The decoder failed before answering: {failure.detail}") from None
        self._metrics.retries.labels("decode").inc()
        if replacement is decoder:
            await asyncio.sleep(SAME_DECODER_BACKOFF * (self.attempt + 1))
        self.attempt += 1
        return replacement


@contextlib.contextmanager
def decode_errors(
    decoder: Endpoint, deadline: Deadline, *, late: str, timeout_failure: str, broke: str
) -> Iterator[None]:
    """The one map of a decode call's failures before the client saw a byte.

    Unreachable: `DecodeFailed`, the KV not delivered. Broken after it connected: `DecodeFailed`, the
    KV possibly used. Past a learned deadline: a hang, replaced (`missed_learned_deadline`). Past the
    phase's timeout: the decoder's failure and the client's 504 (`late` says which phase).
    """
    try:
        yield
    except TimeoutError:
        verdict = None if deadline.watch is None else deadline.watch.verdict
        if verdict == "slow" and deadline.watch is not None:  # only a watch at a learned deadline says it
            raise missed_learned_deadline(deadline.watch.expected) from None
        if verdict == "hung":
            raise hung(decoder, deadline) from None
        decoder.record_failure(timeout_failure)
        raise UpstreamTimeout(late) from None
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        failure = type(exc).__name__
        detail = f"{decoder.url} could not be reached: {failure}"
        raise DecodeFailed(detail, kv_consumed=False, failure=failure) from None
    except httpx.HTTPError as exc:
        failure = type(exc).__name__
        raise DecodeFailed(f"{decoder.url} {broke}: {failure}", kv_consumed=True, failure=failure) from None


def hung(decoder: Endpoint, deadline: Deadline) -> DecodeFailed:
    """The decoder produced nothing for any call and left a one-token probe unanswered: its breaker
    opens, and another decoder (if one is left) takes the request."""
    waited = asyncio.get_running_loop().time() - deadline.started
    detail = f"{decoder.url} is hung: nothing from it for {waited:.3g} s and no answer to a one-token probe"
    decoder.record_hang(detail)
    return DecodeFailed(detail, kv_consumed=True, failure="hung")


def _model_of(exchange: Exchange) -> str | None:
    """The model name the engine was asked for (the probe's)."""
    model = exchange.request.body.get("model")
    return model if isinstance(model, str) else None


async def read_refusal(upstream: EngineAnswer, decoder: Endpoint) -> bytes:
    """The body of a decoder's non-200 answer, the response closed; a 5xx raises DecodeFailed (retryable)."""
    try:
        content = await upstream.aread()
    except httpx.HTTPError:
        content = b""
    finally:
        await close_quietly(upstream)
    status = upstream.status_code
    if status >= 500:
        detail = f"{decoder.url} answered {status}: {content[:300].decode(errors='replace')}"
        raise DecodeFailed(detail, kv_consumed=True, failure=f"status {status}", answered=True)
    return content


async def close_quietly(response: EngineAnswer) -> None:
    """Close an upstream response even while the request is being cancelled."""
    if isinstance(response, PooledAnswer):
        response.release()  # at once: nothing to wait for, so nothing a cancellation could cut short
        return
    with anyio.CancelScope(shield=True):
        await response.aclose()
