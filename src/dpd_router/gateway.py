"""Gateway.handle(): the one place that knows a request's whole path.

prepare (tokenize) -> plan (threshold, engines) -> execute (prefill hop) -> relay (decoder) -> observe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dpd_router.errors import PrefillFailed, RouterError, UpstreamError, UpstreamTimeout
from dpd_router.metrics import RouterMetrics
from dpd_router.observe import Observer, RequestTrace
from dpd_router.pool.endpoint import Endpoint
from dpd_router.relay import EventStream, relay_body
from dpd_router.request import ClientRequest
from dpd_router.routing.planner import PREFILL_FAILED, Plan, Planner
from dpd_router.tokenizer import TokenCounter
from dpd_router.transfer.base import Connector, StagedKV

log = logging.getLogger("dpd_router.gateway")

ENGINE_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}

# Passive outlier detection: this many failed calls in a row take an endpoint out of rotation
# until its next passing health probe.
UNHEALTHY_AFTER_FAILURES = 3


class Gateway:
    """Serves one request end to end; built once at startup with its collaborators."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        tokenizer: TokenCounter,
        planner: Planner,
        connector: Connector,
        observer: Observer,
        metrics: RouterMetrics,
        stream_timeout: httpx.Timeout,
        body_timeout: httpx.Timeout,
    ) -> None:
        self._client = client
        self._tokenizer = tokenizer
        self._planner = planner
        self._connector = connector
        self._observer = observer
        self._metrics = metrics
        self._stream_timeout = stream_timeout
        self._body_timeout = body_timeout

    async def handle(
        self, request: ClientRequest, request_id: str, headers: Mapping[str, str] | None = None
    ) -> Response:
        trace = RequestTrace(request_id=request_id, kind=request.kind, stream=request.stream)
        done = Completion(trace, self._observer, self._metrics)
        try:
            prompt = await self._tokenizer.tokenize(request)
            trace.prompt_tokens = prompt.num_tokens
            trace.tokenize_seconds = prompt.seconds
            self._metrics.tokenize.observe(prompt.seconds)

            planner = self._planner
            session_key = planner.session_key(headers or {}, request.body)
            kv_hint = await planner.lookup_kv(prompt)
            plan = planner.plan(prompt, batch_size=request.batch_size, session_key=session_key, kv_hint=kv_hint)
            done.hold(plan.decoder)
            body, cached_tokens, plan = await self._execute(request, plan, request_id, trace)
            self._record_plan(trace, plan)
            return await self._decode(request, plan.decoder, body, request_id, trace, cached_tokens, done)
        except RouterError as exc:
            trace.fail("error", exc.message, status=exc.status_code)
            done()
            raise
        except asyncio.CancelledError:
            trace.fail("client_disconnect", "the client went away before the answer started", status=499)
            done()
            raise
        except Exception as exc:
            trace.fail("error", f"internal error: {type(exc).__name__}: {exc}", status=500)
            done()
            raise

    async def _execute(
        self, request: ClientRequest, plan: Plan, request_id: str, trace: RequestTrace
    ) -> tuple[bytes, int | None, Plan]:
        """Run the prefill hop when the plan calls for it; fall back to the decoder alone if it fails."""
        trace.threshold = self._planner.threshold
        if plan.prefiller is None:
            return request.encoded(), None, plan
        try:
            staged = await self._prefill(request, plan.prefiller, request_id, trace)
        except PrefillFailed as exc:
            trace.prefill_error = str(exc)
            self._metrics.prefill_fallbacks.labels(exc.reason).inc()
            log.warning(
                "request %s: prefill on %s failed (%s); serving on the decoder alone",
                request_id,
                plan.prefiller.url,
                exc,
            )
            return request.encoded(), None, plan.direct(PREFILL_FAILED)
        return self._connector.decode_body(request, staged), staged.cached_tokens, plan

    async def _prefill(
        self, request: ClientRequest, prefiller: Endpoint, request_id: str, trace: RequestTrace
    ) -> StagedKV:
        trace.prefiller = prefiller.url
        started = time.perf_counter()
        prefiller.start()
        outcome = "ok"
        try:
            staged = await self._connector.prefill(request, prefiller, request_id)
            prefiller.record_success()
            return staged
        except PrefillFailed as exc:
            outcome = exc.reason
            if exc.reason != "status_4xx":
                prefiller.record_failure(str(exc), unhealthy_after=UNHEALTHY_AFTER_FAILURES)
                self._metrics.set_endpoint_health(prefiller)
            raise
        finally:
            prefiller.finish()
            trace.prefill_seconds = time.perf_counter() - started
            self._metrics.prefill.labels(outcome).observe(trace.prefill_seconds)

    def _record_plan(self, trace: RequestTrace, plan: Plan) -> None:
        trace.path = plan.path
        trace.reason = plan.reason
        trace.uncached_tokens = plan.uncached_tokens
        trace.decoder = plan.decoder.url
        self._metrics.route_decisions.labels(plan.path, plan.reason).inc()

    async def _decode(
        self,
        request: ClientRequest,
        decoder: Endpoint,
        body: bytes,
        request_id: str,
        trace: RequestTrace,
        cached_tokens: int | None,
        done: Completion,
    ) -> Response:
        upstream = await self._open(request, decoder, body, request_id)
        headers = {"X-Request-Id": request_id}
        if upstream.status_code != 200:
            return await self._engine_refusal(upstream, decoder, trace, headers, done)
        decoder.record_success()
        if request.stream:
            stream = EventStream(upstream, trace, cached_tokens=cached_tokens, on_close=done)
            media_type = upstream.headers.get("content-type", "text/event-stream")
            return RelayedStream(stream, media_type=media_type, headers=headers)
        try:
            content = await upstream.aread()
        except httpx.TimeoutException:
            await upstream.aclose()
            raise UpstreamTimeout(f"The decoder did not finish within {self._body_timeout.read} s.") from None
        except httpx.HTTPError as exc:
            await upstream.aclose()
            raise UpstreamError(f"The connection to the decoder broke: {type(exc).__name__}.") from None
        content = relay_body(content, trace, cached_tokens)
        done()
        return Response(content, media_type="application/json", headers=headers)

    async def _open(self, request: ClientRequest, decoder: Endpoint, body: bytes, request_id: str) -> httpx.Response:
        timeout = self._stream_timeout if request.stream else self._body_timeout
        outgoing = self._client.build_request(
            "POST",
            f"{decoder.url}{ENGINE_PATHS[request.kind]}",
            content=body,
            headers={
                "X-Request-Id": request_id,
                "Content-Type": "application/json",
                "Accept-Encoding": "identity",
            },
            timeout=timeout,
        )
        try:
            return await self._client.send(outgoing, stream=True)
        except httpx.TimeoutException:
            decoder.record_failure("timeout", unhealthy_after=UNHEALTHY_AFTER_FAILURES)
            raise UpstreamTimeout(f"The decoder did not answer within {timeout.read} s.") from None
        except httpx.HTTPError as exc:
            decoder.record_failure(type(exc).__name__, unhealthy_after=UNHEALTHY_AFTER_FAILURES)
            self._metrics.set_endpoint_health(decoder)
            raise UpstreamError(f"The decoder could not be reached: {type(exc).__name__}.") from None

    async def _engine_refusal(
        self,
        upstream: httpx.Response,
        decoder: Endpoint,
        trace: RequestTrace,
        headers: dict[str, str],
        done: Completion,
    ) -> Response:
        """Pass an engine's 4xx through as it is (the request's fault); a 5xx becomes a 502."""
        content = await upstream.aread()
        await upstream.aclose()
        status = upstream.status_code
        if status >= 500:
            decoder.record_failure(f"status {status}", unhealthy_after=UNHEALTHY_AFTER_FAILURES)
            self._metrics.set_endpoint_health(decoder)
            raise UpstreamError(f"The decoder failed with status {status}: {content[:300].decode(errors='replace')}")
        trace.fail("engine_rejected", f"decoder answered {status}", status=status)
        done()
        media_type = upstream.headers.get("content-type", "application/json")
        return Response(content, status_code=status, media_type=media_type, headers=headers)


class Completion:
    """Releases what a request holds, exactly once: its decoder slot, the in-flight gauge, its trace."""

    def __init__(self, trace: RequestTrace, observer: Observer, metrics: RouterMetrics) -> None:
        self._trace = trace
        self._observer = observer
        self._metrics = metrics
        self._decoder: Endpoint | None = None
        self._done = False
        metrics.in_flight.inc()

    def hold(self, decoder: Endpoint) -> None:
        decoder.start()
        self._decoder = decoder

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        if self._decoder is not None:
            self._decoder.finish()
        self._metrics.in_flight.dec()
        self._observer.finish(self._trace)


class RelayedStream(StreamingResponse):
    """A streaming response that closes its upstream even if the client left before the body began."""

    def __init__(self, stream: EventStream, *, media_type: str, headers: dict[str, str]) -> None:
        super().__init__(stream, media_type=media_type, headers=headers)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.close()
