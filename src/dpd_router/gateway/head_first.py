"""A stream the router starts itself, with the first token the prefill call produced (LMCache), and
continues with a decoder's stream.

The client has seen bytes from the head on: a decoder that fails before its first token is replaced
within the stream (the continuation is a plain request any decoder can compute), and what cannot be
served ends the stream with an in-band error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

import anyio

from dpd_router.gateway.answer import StreamedAnswer
from dpd_router.gateway.decode import DecodeHop, DecoderReplacement, read_refusal
from dpd_router.gateway.errors import DecodeFailed
from dpd_router.gateway.exchange import Exchange
from dpd_router.gateway.relay import EventStream
from dpd_router.gateway.wires import error_event
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineAnswer
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.errors import RouterError, UpstreamError
from dpd_router.routing.planner import Plan
from dpd_router.transfer.base import DecodeCall, StagedKV

log = logging.getLogger("dpd_router.gateway")


class HeadFirst:
    """Streams the head at once and the decoder's continuation after it."""

    def __init__(self, decode: DecodeHop, metrics: RouterMetrics) -> None:
        self._decode = decode
        self._metrics = metrics

    def stream(self, exchange: Exchange, plan: Plan, call: DecodeCall, staged: StagedKV | None) -> StreamedAnswer:
        """The answer: the head now, the continuation once a decoder streams it."""
        assert call.head is not None
        ending, done, head = exchange.ending, exchange.done, call.head
        relayed: list[EventStream] = []
        failed: list[bool] = []  # the continuation could not be served: the request ended with its failure

        async def events() -> AsyncGenerator[bytes, None]:
            exchange.output.mark_token_chunk(time.perf_counter())
            exchange.first_token.reach()
            yield head
            try:
                stream = await self._continuation(exchange, plan, call, staged)
            except RouterError as exc:
                failed.append(True)
                ending.fail("upstream_error", exc.message)
                yield error_event(exc.message)
                return
            except Exception as exc:  # a bug, not the client: the stream still ends, in-band
                log.exception("request %s: the continuation after the first token failed", exchange.request_id)
                failed.append(True)
                ending.fail("error", f"internal error: {type(exc).__name__}: {exc}")
                yield error_event("The router failed to continue this answer.")
                return
            relayed.append(stream)
            async for chunk in stream:
                yield chunk

        generator = events()

        async def close() -> None:
            """Close the continuation's upstream and end the request (also when it never began)."""
            with anyio.CancelScope(shield=True):
                await generator.aclose()
                if relayed:
                    await relayed[0].close()
            if not done.ended and not failed:
                # Ended without a decoder's stream to close (or never began): the client left.
                self._metrics.client_disconnects.labels("serve").inc()
                ending.fail("client_disconnect", "the client left before the decoder answered", status=499)
            done()

        return StreamedAnswer(generator, close, exchange.headers)

    async def _continuation(
        self, exchange: Exchange, plan: Plan, call: DecodeCall, staged: StagedKV | None
    ) -> EventStream:
        """The decoder's stream after the head, primed; decoders failing before their first token are replaced."""
        done = exchange.done
        if call.answered is not None:
            exchange.output.decoder = None
            return self._decode.answered_stream(exchange, call, staged)
        replacement = DecoderReplacement(exchange, self._metrics)
        while True:
            decoder = plan.decoder
            done.hold(decoder)
            exchange.output.decoder = decoder.url
            # The client already has the head: the continuation keeps the phase's timeout.
            deadline = self._decode.continuation_deadline(exchange, decoder)
            try:
                done.kv_sent()
                upstream = await self._decode.open(exchange, decoder, call, deadline)
                if upstream.status_code != 200:
                    done.kv_answered_by(decoder)
                    await _refused_after_head(upstream, decoder)
                stream = await self._decode.primed_stream(exchange, upstream, decoder, staged, call, deadline)
                done.kv_answered_by(decoder)  # its first token (see DecodeHop._answer)
            except DecodeFailed as exc:
                replacement.failed(decoder, exc)
                plan = replace(plan, decoder=await replacement.next(decoder, exc))
                if plan.decoder is not decoder:
                    done.release_kv()  # the continuation is computed whole elsewhere: nobody takes it here
            else:
                return stream
            finally:
                deadline.stop()


async def _refused_after_head(upstream: EngineAnswer, decoder: Endpoint) -> None:
    """A decoder's refusal once the client has the head: a 5xx may be retried elsewhere, a 4xx not."""
    content = await read_refusal(upstream, decoder)
    detail = f"{decoder.url} answered {upstream.status_code}: {content[:300].decode(errors='replace')}"
    raise UpstreamError(f"The decoder refused the continuation: {detail}")
