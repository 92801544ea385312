"""Gateway.handle(): the one place that knows a request's whole path.

prepare (tokenize, limits) -> plan (threshold, engines) -> execute (prefill hop, with retry and
fallback) -> relay (decoder, replaced if it fails before the first byte) -> observe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dpd_router.api.auth import ANONYMOUS, Principal
from dpd_router.config import Settings
from dpd_router.errors import (
    InvalidRequest,
    PrefillFailed,
    PrefillUnavailable,
    RateLimited,
    RouterError,
    UpstreamError,
    UpstreamTimeout,
)
from dpd_router.metrics import RouterMetrics
from dpd_router.observe import Observer, RequestTrace
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.models import ServedModel
from dpd_router.relay import DecodeFailedEarly, EventStream, relay_body
from dpd_router.request import ClientRequest
from dpd_router.routing.planner import PREFILL_FAILED, Plan, Planner
from dpd_router.tokenizer import Prompt, TokenCounter
from dpd_router.transfer.base import Connector, StagedKV

log = logging.getLogger("dpd_router.gateway")

# Seconds before the only decoder is tried again (times the attempt number).
SAME_DECODER_BACKOFF = 0.25

ENGINE_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds each phase of a request may take."""

    connect: float = 5.0
    prefill: float = 120.0
    first_token: float = 120.0
    idle: float = 120.0
    total: float = 600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> PhaseTimeouts:
        return cls(
            connect=settings.connect_timeout,
            prefill=settings.prefill_timeout,
            first_token=settings.first_token_timeout,
            idle=settings.idle_timeout,
            total=settings.request_timeout,
        )


@dataclass(frozen=True)
class RetryPolicy:
    """How many other engines a failed hop is retried on, and what a failed prefill pool means."""

    prefill_retries: int = 1
    decode_retries: int = 1
    prefill_failure_policy: str = "fallback"

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(settings.prefill_retries, settings.decode_retries, settings.prefill_failure_policy)


class DecodeFailed(Exception):
    """The decoder failed before the client saw a byte: another decoder may serve the request."""

    def __init__(self, detail: str, *, kv_consumed: bool) -> None:
        super().__init__(detail)
        self.detail = detail
        # Whether the decoder may have used (and so released) the staged KV: then it must be staged again.
        self.kv_consumed = kv_consumed


class Gateway:
    """Serves one request end to end; built once at startup with its collaborators."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        tokenizer: TokenCounter,
        planners: Mapping[str | None, Planner],
        connector: Connector,
        observer: Observer,
        metrics: RouterMetrics,
        model: ServedModel,
        timeouts: PhaseTimeouts,
        retries: RetryPolicy,
    ) -> None:
        self._client = client
        self._tokenizer = tokenizer
        self._planners = planners
        self._connector = connector
        self._observer = observer
        self._metrics = metrics
        self._model = model
        self._timeouts = timeouts
        self._retries = retries

    def reconfigure(self, timeouts: PhaseTimeouts, retries: RetryPolicy) -> None:
        """Apply live timeout and retry settings to the requests that start from now on."""
        self._timeouts = timeouts
        self._retries = retries

    @property
    def planners(self) -> Mapping[str | None, Planner]:
        return self._planners

    def planner_for(self, tenant: str | None) -> Planner:
        """A tenant with reserved engines plans over them alone; everyone else shares the main pool."""
        return self._planners.get(tenant) or self._planners[None]

    async def handle(
        self,
        request: ClientRequest,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        *,
        principal: Principal = ANONYMOUS,
        on_finish: Callable[[], None] | None = None,
        arrived: float | None = None,
        queued: float = 0.0,
    ) -> Response:
        """Serve the request; `on_finish` runs once when it is over (after the last byte, if streamed).

        `arrived` (a perf_counter reading) and `queued` (seconds waited for admission) let TTFT
        count from the moment the request reached the router.
        """
        trace = RequestTrace(request_id=request_id, kind=request.kind, stream=request.stream)
        if arrived is not None:
            trace.started = arrived
        trace.queue_seconds = queued
        trace.tenant = principal.tenant
        done = Completion(trace, self._observer, self._metrics, on_finish)
        phase = "tokenize"
        try:
            planner = self.planner_for(principal.tenant)
            prompt = await self._tokenizer.tokenize(request)
            trace.prompt_tokens = prompt.num_tokens
            trace.tokenize_seconds = prompt.seconds
            self._metrics.tokenize.observe(prompt.seconds)
            self._check_context_length(request, prompt)
            self._take_prompt_tokens(principal, prompt)

            phase = "plan"
            session_key = planner.session_key(headers or {}, request.body)
            kv_hint = await planner.lookup_kv(prompt)
            plan = planner.plan(prompt, batch_size=request.batch_size, session_key=session_key, kv_hint=kv_hint)
            if plan.last_resort:
                self._metrics.last_resort_routes.inc()
                log.warning(
                    "request %s: no decoder passes its health probes; trying %s, which fails only those (%s)",
                    request_id,
                    plan.decoder.url,
                    plan.decoder.last_error,
                )
            trace.threshold = planner.threshold
            trace.uncached_tokens = plan.uncached_tokens
            trace.decoder_streams = plan.decoder_streams
            phase = "serve"
            strip_usage = ask_for_usage(request)
            return await self._serve(request, plan, planner, prompt, request_id, trace, done, strip_usage)
        except RouterError as exc:
            trace.fail("error", exc.message, status=exc.status_code)
            done()
            raise
        except asyncio.CancelledError:
            self._metrics.client_disconnects.labels(phase).inc()
            trace.fail("client_disconnect", f"the client went away during {phase}", status=499)
            done()
            raise
        except Exception as exc:
            trace.fail("error", f"internal error: {type(exc).__name__}: {exc}", status=500)
            done()
            raise

    def _check_context_length(self, request: ClientRequest, prompt: Prompt) -> None:
        """Refuse, before any engine is called, a prompt the model cannot hold (as vLLM would)."""
        limit = self._model.max_model_len
        if limit is None:
            return
        longest = prompt.num_tokens if request.batch_size == 1 else max(prompt.num_tokens // request.batch_size, 1)
        asked = request.body.get("max_completion_tokens") or request.body.get("max_tokens") or 0
        if longest >= limit or longest + asked > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{longest + asked} tokens ({longest} in the prompt, {asked} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                param="messages" if request.kind == "chat" else "prompt",
            )

    def _take_prompt_tokens(self, principal: Principal, prompt: Prompt) -> None:
        try:
            principal.limits.take_prompt_tokens(prompt.num_tokens)
        except RateLimited:
            self._metrics.rate_limited.labels("prompt_tokens").inc()
            raise

    async def _serve(
        self,
        request: ClientRequest,
        plan: Plan,
        planner: Planner,
        prompt: Prompt,
        request_id: str,
        trace: RequestTrace,
        done: Completion,
        strip_usage: bool,
    ) -> Response:
        """Stage KV if the plan says so, then decode; replace a decoder that fails before its first byte."""
        tried: list[Endpoint] = []
        staged: StagedKV | None = None
        for attempt in range(self._retries.decode_retries + 1):
            done.hold(plan.decoder)
            if plan.prefiller is not None and staged is None:
                staged, plan = await self._stage(request, plan, planner, prompt, request_id, trace)
                trace.staged_tokens = None if staged is None else staged.prompt_tokens
                if staged is not None and "remote_prefill_cached_tokens" in staged.params:
                    trace.usage_shows_transfer = False  # the decoder will echo the prefiller's count
            if attempt == 0:
                self._record_plan(trace, plan)
            trace.decoder = plan.decoder.url
            trace.decode_started = time.perf_counter()  # a failed attempt's time counts as the router's
            body = request.encoded() if staged is None else self._connector.decode_body(request, staged)
            try:
                return await self._decode(request, plan.decoder, body, request_id, trace, staged, done, strip_usage)
            except DecodeFailed as exc:
                tried.append(plan.decoder)
                log.warning("request %s: decoder %s failed before answering: %s", request_id, plan.decoder.url, exc)
                if exc.kv_consumed:
                    staged = None
                replacement = planner.alternative("decode", prompt, exclude=tried)
                if replacement is None and plan.decoder.available:
                    # The only decoder left: try it again (with fresh KV if it may have used the staged
                    # one). An unreachable one never saw the request, so resending it is safe.
                    replacement = plan.decoder
                if replacement is None or attempt == self._retries.decode_retries:
                    raise UpstreamError(f"The decoder failed before answering: {exc.detail}") from None
                self._metrics.retries.labels("decode").inc()
                if replacement is plan.decoder:
                    await asyncio.sleep(SAME_DECODER_BACKOFF * (attempt + 1))
                plan = replace(plan, decoder=replacement)
        raise AssertionError("unreachable")

    async def _stage(
        self,
        request: ClientRequest,
        plan: Plan,
        planner: Planner,
        prompt: Prompt,
        request_id: str,
        trace: RequestTrace,
    ) -> tuple[StagedKV | None, Plan]:
        """The prefill hop, retried on other prefillers; when it cannot stage KV, apply the policy."""
        prefiller = plan.prefiller
        tried: list[Endpoint] = []
        failure: PrefillFailed | None = None
        while prefiller is not None:
            try:
                staged = await self._prefill(request, prefiller, request_id, trace)
                return staged, replace(plan, prefiller=prefiller)
            except PrefillFailed as exc:
                failure = exc
                tried.append(prefiller)
                trace.prefill_error = str(exc)
                log.warning("request %s: prefill on %s failed: %s", request_id, prefiller.url, exc)
                if exc.reason == "status_4xx" or len(tried) > self._retries.prefill_retries:
                    break  # a 4xx is the request's own fault: another prefiller would say the same
                prefiller = planner.alternative("prefill", prompt, exclude=tried)
                if prefiller is not None:
                    self._metrics.retries.labels("prefill").inc()
        reason = failure.reason if failure is not None else "no_prefiller"
        if self._retries.prefill_failure_policy == "fail":
            raise PrefillUnavailable(f"The prefill pool could not serve this request ({reason}).")
        self._metrics.prefill_fallbacks.labels(reason).inc()
        return None, plan.direct(PREFILL_FAILED)

    async def _prefill(
        self, request: ClientRequest, prefiller: Endpoint, request_id: str, trace: RequestTrace
    ) -> StagedKV:
        trace.prefiller = prefiller.url
        started = trace.prefill_started = time.perf_counter()
        prefiller.start()
        tokens = trace.uncached_tokens or 0
        prefiller.queued_tokens += tokens
        outcome = "ok"
        try:
            async with asyncio.timeout(self._timeouts.prefill):
                staged = await self._connector.prefill(request, prefiller, request_id)
            prefiller.record_success()
            return staged
        except TimeoutError:
            outcome = "timeout"
            prefiller.record_failure("prefill timed out")
            raise PrefillFailed("timeout", f"{prefiller.url}: no answer in {self._timeouts.prefill:g} s") from None
        except PrefillFailed as exc:
            outcome = exc.reason
            if exc.reason != "status_4xx":
                prefiller.record_failure(str(exc))
            raise
        finally:
            prefiller.finish()
            prefiller.queued_tokens -= tokens
            trace.prefill_seconds = time.perf_counter() - started
            self._metrics.prefill.labels(outcome).observe(trace.prefill_seconds)

    def _record_plan(self, trace: RequestTrace, plan: Plan) -> None:
        trace.path = plan.path
        trace.reason = plan.reason
        trace.uncached_tokens = plan.uncached_tokens
        self._metrics.route_decisions.labels(plan.path, plan.reason).inc()

    async def _decode(
        self,
        request: ClientRequest,
        decoder: Endpoint,
        body: bytes,
        request_id: str,
        trace: RequestTrace,
        staged: StagedKV | None,
        done: Completion,
        strip_usage: bool,
    ) -> Response:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._timeouts.first_token if request.stream else self._timeouts.total)
        upstream = await self._open(request, decoder, body, request_id, deadline)
        headers = {"X-Request-Id": request_id}
        cached_tokens = None if staged is None else staged.cached_tokens
        if upstream.status_code != 200:
            return await self._engine_refusal(upstream, decoder, trace, headers, done)
        if not request.stream:
            return await self._whole_answer(upstream, decoder, trace, cached_tokens, deadline, headers, done)
        stream = EventStream(
            upstream,
            trace,
            cached_tokens=cached_tokens,
            on_close=done,
            idle_timeout=self._timeouts.idle,
            strip_usage=strip_usage,
        )
        primed = False
        try:
            await stream.prime(deadline)
            primed = True
        except DecodeFailedEarly as exc:
            decoder.record_failure(exc.detail)
            raise DecodeFailed(exc.detail, kv_consumed=True) from None
        except TimeoutError:
            decoder.record_failure("no first token in time")
            raise UpstreamTimeout(f"The decoder produced no token within {self._timeouts.first_token:g} s.") from None
        except httpx.HTTPError as exc:
            decoder.record_failure(type(exc).__name__)
            detail = f"the stream broke before the first token: {type(exc).__name__}"
            raise DecodeFailed(detail, kv_consumed=True) from None
        finally:
            if not primed:
                await stream.discard()  # not handed to the client: close it here, whatever happened
        decoder.record_success()
        media_type = upstream.headers.get("content-type", "text/event-stream")
        return RelayedStream(stream, media_type=media_type, headers=headers)

    async def _open(
        self, request: ClientRequest, decoder: Endpoint, body: bytes, request_id: str, deadline: float
    ) -> httpx.Response:
        """Send the decode call and wait for its status line (reads are timed by the caller)."""
        outgoing = self._client.build_request(
            "POST",
            f"{decoder.url}{ENGINE_PATHS[request.kind]}",
            content=body,
            headers={"X-Request-Id": request_id, "Content-Type": "application/json", "Accept-Encoding": "identity"},
            timeout=httpx.Timeout(None, connect=self._timeouts.connect, pool=self._timeouts.connect),
        )
        try:
            async with asyncio.timeout_at(deadline):
                return await self._client.send(outgoing, stream=True)
        except TimeoutError:
            decoder.record_failure("timeout")
            raise UpstreamTimeout("The decoder did not answer in time.") from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            decoder.record_failure(type(exc).__name__)
            raise DecodeFailed(f"{decoder.url} could not be reached: {type(exc).__name__}", kv_consumed=False) from None
        except httpx.HTTPError as exc:
            decoder.record_failure(type(exc).__name__)
            raise DecodeFailed(f"{decoder.url} broke the connection: {type(exc).__name__}", kv_consumed=True) from None

    async def _whole_answer(
        self,
        upstream: httpx.Response,
        decoder: Endpoint,
        trace: RequestTrace,
        cached_tokens: int | None,
        deadline: float,
        headers: dict[str, str],
        done: Completion,
    ) -> Response:
        try:
            async with asyncio.timeout_at(deadline):
                content = await upstream.aread()
        except TimeoutError:
            decoder.record_failure("timeout")
            raise UpstreamTimeout(f"The decoder did not finish within {self._timeouts.total:g} s.") from None
        except httpx.HTTPError as exc:
            decoder.record_failure(type(exc).__name__)
            raise DecodeFailed(f"the answer broke off: {type(exc).__name__}", kv_consumed=True) from None
        finally:
            await close_quietly(upstream)
        content = relay_body(content, trace, cached_tokens)
        if trace.outcome == "upstream_error" and trace.completion_tokens in (None, 0):
            decoder.record_failure(trace.error or "in-band error")
            trace.outcome, trace.error = "ok", None
            raise DecodeFailed("the decoder failed the request in-band", kv_consumed=True)
        decoder.record_success()
        done()
        return Response(content, media_type="application/json", headers=headers)

    async def _engine_refusal(
        self,
        upstream: httpx.Response,
        decoder: Endpoint,
        trace: RequestTrace,
        headers: dict[str, str],
        done: Completion,
    ) -> Response:
        """Pass an engine's 4xx through as it is (the request's fault); a 5xx is a decoder failure."""
        try:
            content = await upstream.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await close_quietly(upstream)
        status = upstream.status_code
        if status >= 500:
            decoder.record_failure(f"status {status}")
            raise DecodeFailed(
                f"{decoder.url} answered {status}: {content[:300].decode(errors='replace')}", kv_consumed=True
            )
        trace.fail("engine_rejected", f"decoder answered {status}", status=status)
        done()
        media_type = upstream.headers.get("content-type", "application/json")
        return Response(content, status_code=status, media_type=media_type, headers=headers)


def ask_for_usage(request: ClientRequest) -> bool:
    """Make a stream end with a usage chunk, which the metrics need (output and cached tokens).

    Returns True when the client did not ask for it: the relay then drops it before the client sees it.
    """
    if not request.stream:
        return False
    options = request.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return False
    request.body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    request.body_changed = True
    return True


async def close_quietly(response: httpx.Response) -> None:
    """Close an upstream response even while the request is being cancelled."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


class Completion:
    """Releases what a request holds, exactly once: its decoder slot, the in-flight gauge, its trace,
    and the caller's `on_finish` (the admission slot)."""

    def __init__(
        self,
        trace: RequestTrace,
        observer: Observer,
        metrics: RouterMetrics,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self._trace = trace
        self._observer = observer
        self._metrics = metrics
        self._on_finish = on_finish
        self._decoder: Endpoint | None = None
        self._done = False
        metrics.in_flight.inc()

    def hold(self, decoder: Endpoint) -> None:
        """Count the request against `decoder` (moving it off a decoder held before)."""
        if self._decoder is decoder:
            return
        if self._decoder is not None:
            self._decoder.finish()
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
        if self._on_finish is not None:
            self._on_finish()


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
