"""Gateway.handle(): the one place that knows a request's whole path.

prepare (tokenize, limits) -> plan (threshold, engines) -> execute (prefill hop, with retry and
fallback) -> relay (decoder, replaced if it fails before the first byte) -> observe.

The connector decides the shape of the two hops: a sequential one's decode call starts once the
prefill hop staged the KV; a concurrent one's starts with it, and a prefill that fails before the
decoder's first token cancels the decode call and counts as a failed prefill hop. A connector
whose prefill already produced the first token (LMCache) has it sent to the client at once; one
that holds staged KV until a decode call picks it up (NIXL on the prefiller, LMCache in the
chosen decoder) has it released when no decode call will, also when the client left while the
prefill call was answering. A connector whose decoders serve nothing alone (SGLang) gets every
request through a prefiller, or refuses it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dpd_router.api.auth import ANONYMOUS, Principal
from dpd_router.config import Settings
from dpd_router.context_window import check_context_length, prompt_too_long
from dpd_router.deadlines import DeadlinePolicy, HopDeadlines
from dpd_router.errors import (
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
from dpd_router.relay import DecodeFailedEarly, EventStream, error_event, failed_before_output, relay_body
from dpd_router.request import ClientRequest
from dpd_router.routing.planner import KV_REJECTED, PREFILL_FAILED, Plan, Planner
from dpd_router.tasks import cancel_and_wait
from dpd_router.tokenizer import Prompt, PromptTooLong, TokenCounter
from dpd_router.transfer.base import ENGINE_PATHS as ENGINE_PATHS  # the engine API paths, by request kind
from dpd_router.transfer.base import Connector, DecodeCall, Handoff, StagedKV

log = logging.getLogger("dpd_router.gateway")

# Seconds before the only decoder is tried again (times the attempt number).
SAME_DECODER_BACKOFF = 0.25
# Seconds a concurrent decode call that failed before its first token waits for its prefill's outcome.
HANDOFF_GRACE = 2.0
# The PrefillFailed reason of a hand-off whose decoder failed while its prefill call still ran.
HANDOFF_FAILED = "handoff_failed"
# Seconds a prefill call whose client left may still take to answer. An engine that finished it
# holds the KV for a decoder, and only the answer names it (it is then released); an engine still
# computing answers later, and cutting the call makes vLLM abort it, which frees its blocks at once.
# Cutting a call whose answer is already on its way strands its blocks for the whole lease, and on a
# loaded machine an answer can take more than a second to arrive: the grace errs long.
ORPHANED_PREFILL_GRACE = 10.0

T = TypeVar("T")


@dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds each phase of a request may take."""

    connect: float = 5.0
    prefill: float = 120.0
    first_token: float = 120.0
    idle: float = 120.0
    total: float = 600.0
    # Shorter, learned bounds on the prefill hop and on a decoder's first byte (deadlines.py).
    learned: DeadlinePolicy = field(default_factory=DeadlinePolicy)

    @classmethod
    def from_settings(cls, settings: Settings) -> PhaseTimeouts:
        return cls(
            connect=settings.connect_timeout,
            prefill=settings.prefill_timeout,
            first_token=settings.first_token_timeout,
            idle=settings.idle_timeout,
            total=settings.request_timeout,
            learned=DeadlinePolicy.from_settings(settings),
        )


@dataclass(frozen=True)
class Deadline:
    """When a decode call must have answered (a loop time), and whether that is a learned deadline
    (missed: the decoder is replaced) or the phase's timeout (missed: the client gets 504)."""

    started: float
    at: float
    learned: float | None = None


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
    """The decoder failed before the client saw a byte: another decoder may serve the request.

    Not yet counted against the decoder (`failure` is what its breaker would record): a concurrent
    prefill's failure may explain it.
    """

    def __init__(
        self, detail: str, *, kv_consumed: bool, failure: str, answered: bool = False, in_band: bool = False
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        # Whether the decoder may have used (and so released) the staged KV: then it must be staged again.
        self.kv_consumed = kv_consumed
        self.failure = failure
        # The decoder answered with an error (a 5xx, or an error in-band before any output), which the
        # request itself may have caused; else it failed to answer (connection, stream broken).
        self.answered = answered
        # The error came in the answer, before any output: on a call carrying staged KV, the decoder
        # could not load it (vLLM ends such a request with finish_reason "error").
        self.in_band = in_band


# Prefill failures in which the prefiller answered, with an error the request itself may have caused.
ANSWERED_PREFILL_FAILURES = frozenset({"status_5xx", "in_band_error"})


class FailureJudge:
    """Tells an engine's failures from a request's own, for one role of one request.

    As Envoy's outlier detection keeps local-origin errors apart from the upstream's answers: an
    engine that cannot be reached, breaks the connection or does not answer in time has failed,
    and it counts against its breaker at once. An engine that answers with an error may have been
    handed a request no engine can serve, so that failure is held until another engine has the
    same request: served there, the held failure was the engine's and counts; failed there with an
    error answer too, it was the request's, and no engine is blamed for it. A failure no other
    engine could judge counts when the request ends (`close`).
    """

    def __init__(self) -> None:
        self._held: list[tuple[Endpoint, str]] = []
        self._request_at_fault = False

    def failed(self, endpoint: Endpoint, failure: str, *, answered: bool) -> None:
        if not answered:
            endpoint.record_failure(failure)
        elif self._request_at_fault:
            return
        elif any(held is not endpoint for held, _ in self._held):
            self._request_at_fault = True  # a second engine failed it with an answer too
            self._held.clear()
        else:
            self._held.append((endpoint, failure))

    def succeeded(self, endpoint: Endpoint) -> None:
        endpoint.record_success()
        self.close()

    def close(self) -> None:
        """Count the failures still held: no other engine could say they were the request's."""
        held, self._held = self._held, []
        for endpoint, failure in held:
            endpoint.record_failure(failure)


@dataclass(frozen=True)
class Exchange:
    """One client request on its way through the gateway: what every hop of it needs."""

    request: ClientRequest
    prompt: Prompt
    planner: Planner
    request_id: str
    trace: RequestTrace
    done: Completion
    # The router asked the stream for a usage chunk the client did not: drop it before the client.
    strip_usage: bool
    # What this pool's hops have been taking: the learned deadlines of this request's hops.
    deadlines: HopDeadlines
    prefill_judge: FailureJudge = field(default_factory=FailureJudge)
    decode_judge: FailureJudge = field(default_factory=FailureJudge)

    @property
    def headers(self) -> dict[str, str]:
        """The headers of the router's answer."""
        return {"X-Request-Id": self.request_id}


class Gateway:
    """Serves one request end to end; built once at startup with its collaborators."""

    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        tokenizers: Mapping[str | None, TokenCounter],
        planners: Mapping[str | None, Planner],
        connector: Connector,
        observer: Observer,
        metrics: RouterMetrics,
        model: ServedModel,
        timeouts: PhaseTimeouts,
        retries: RetryPolicy,
    ) -> None:
        self._client = client
        self._tokenizers = tokenizers
        self._planners = planners
        self._connector = connector
        self._observer = observer
        self._metrics = metrics
        self._model = model
        self._timeouts = timeouts
        self._retries = retries
        # Prefill calls whose client left, given a moment to answer so that what they staged is released.
        self._orphaned_prefills: set[asyncio.Task[None]] = set()
        # One per pool, as planners: a tenant's engines may be faster or slower than the shared ones.
        self._deadlines = {tenant: HopDeadlines() for tenant in planners}

    async def close(self) -> None:
        """Stop prefill calls whose clients left (before the connector that would release their KV closes)."""
        await cancel_and_wait(self._orphaned_prefills)

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

    def deadlines_for(self, tenant: str | None) -> HopDeadlines:
        return self._deadlines.get(tenant) or self._deadlines[None]

    def tokenizer_for(self, tenant: str | None) -> TokenCounter:
        """Without a local tokenizer, a tenant's prompts are counted by its own engines too."""
        return self._tokenizers.get(tenant) or self._tokenizers[None]

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
        trace.key_id = principal.key_id
        done = Completion(trace, self._observer, self._metrics, on_finish)
        phase = "tokenize"
        try:
            planner = self.planner_for(principal.tenant)
            prompt = await self._tokenize(request, principal.tenant)
            trace.prompt_tokens = prompt.num_tokens
            trace.tokenize_seconds = prompt.seconds
            self._metrics.tokenize.observe(prompt.seconds)
            self._check_context_length(request, prompt)
            self._take_prompt_tokens(principal, prompt)

            phase = "plan"
            session_key = planner.session_key(headers or {}, request.body)
            kv_hint = await planner.lookup_kv(prompt)
            plan = planner.plan(
                prompt,
                batch_size=request.batch_size,
                session_key=session_key,
                kv_hint=kv_hint,
                unsupported=self._connector.unsupported(request),
            )
            if plan.last_resort:
                self._metrics.last_resort_routes.inc()
                log.warning(
                    "request %s: no decoder passes its health probes; trying %s, which fails only those (%s)",
                    request_id,
                    plan.decoder.url,
                    plan.decoder.last_error,
                )
            self._check_servable(plan)
            trace.threshold = planner.threshold
            trace.uncached_tokens = plan.uncached_tokens
            trace.decoder_streams = plan.decoder_streams
            trace.decoder_queue = plan.decoder_queue
            trace.prefiller_queue = plan.prefiller_queue
            phase = "serve"
            exchange = Exchange(
                request,
                prompt,
                planner,
                request_id,
                trace,
                done,
                ask_for_usage(request),
                self.deadlines_for(principal.tenant),
            )
            done.defer(exchange.prefill_judge.close)
            done.defer(exchange.decode_judge.close)
            return await self._serve(exchange, plan)
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

    async def _tokenize(self, request: ClientRequest, tenant: str | None) -> Prompt:
        """The prompt's tokens; one whose size alone shows it cannot fit is refused untokenized, as vLLM
        refuses a text prompt it stopped counting one token past the limit."""
        limit = self._model.max_model_len
        try:
            return await self.tokenizer_for(tenant).tokenize(request, max_tokens=limit)
        except PromptTooLong:
            assert limit is not None
            raise prompt_too_long(limit, limit + 1, at_least=True) from None

    def _check_servable(self, plan: Plan) -> None:
        """A direct plan is refused when the connector's decoders serve nothing alone (SGLang)."""
        if plan.prefiller is None and not self._connector.serves_direct:
            raise PrefillUnavailable(
                f"No prefiller can take this request ({plan.reason}), and the {self._connector.name} "
                "connector's decoders cannot serve it alone."
            )

    def _check_context_length(self, request: ClientRequest, prompt: Prompt) -> None:
        """Refuse, before any engine is called, what vLLM would refuse for the context length."""
        limit = self._model.max_model_len
        if limit is not None:
            check_context_length(request, prompt, limit)

    def _take_prompt_tokens(self, principal: Principal, prompt: Prompt) -> None:
        try:
            principal.limits.take_prompt_tokens(prompt.num_tokens)
        except RateLimited:
            self._metrics.rate_limited.labels("prompt_tokens").inc()
            raise

    async def _serve(self, exchange: Exchange, plan: Plan) -> Response:
        """Stage KV if the plan says so, then decode; replace a decoder that fails before its first byte."""
        request, trace, done = exchange.request, exchange.trace, exchange.done
        tried: list[Endpoint] = []
        prefillers_tried: list[Endpoint] = []
        staged: StagedKV | None = None
        attempt = 0
        try:
            while True:
                done.hold(plan.decoder)
                if staged is not None and not self._serves(staged, plan.decoder):
                    # Pushed into another decoder's buffer (LMCache): released there, staged again here.
                    done.release_kv()
                    staged = None
                if plan.prefiller is not None and staged is None:
                    decoder = plan.decoder
                    decoder.staging += 1  # held here, but not running on it until the hop is done
                    try:
                        staged, plan = await self._stage(exchange, plan, prefillers_tried)
                    finally:
                        decoder.staging -= 1
                    self._note_staged(trace, staged, done)
                self._record_plan(trace, plan)
                trace.decoder = plan.decoder.url
                trace.decode_started = time.perf_counter()  # a failed attempt's time counts as the router's
                if staged is None and request.stream:
                    self._await_first_token(exchange, plan)
                call = self._decode_call(request, staged)
                if request.stream and call.head:
                    return self._stream_after_head(exchange, plan, call, staged)
                try:
                    replaceable = attempt < self._retries.decode_retries
                    return await self._decode(exchange, plan.decoder, call, staged, replaceable=replaceable)
                except PrefillFailed as exc:  # a concurrent prefill failed before the decoder's first token
                    if staged is not None:
                        abandon(staged)  # still running when the decoder failed first (a failed hand-off)
                    staged = None
                    trace.prefill_overlaps_decode = False  # what follows starts after it
                    plan = self._after_prefill_failure(exchange, exc, plan, prefillers_tried)
                except DecodeFailed as exc:
                    if staged is not None and exc.in_band and self._decodes_alone(staged):
                        abandon(staged)
                        staged = None
                        plan = self._after_kv_rejected(exchange, exc, plan)
                        continue
                    exchange.decode_judge.failed(plan.decoder, exc.failure, answered=exc.answered)
                    tried.append(plan.decoder)
                    log.warning(
                        "request %s: decoder %s failed before answering: %s", exchange.request_id, plan.decoder.url, exc
                    )
                    if exc.kv_consumed:
                        done.kv_taken_by(plan.decoder)
                    else:
                        done.kv_not_delivered()  # held for the next decoder, or released
                    if staged is not None and (exc.kv_consumed or staged.pending is not None):
                        # Used (and so released) by the failed decoder, or bound to its call: stage again.
                        abandon(staged)
                        staged = None
                    replacement = await self._next_decoder(exchange, exc, plan, tried, attempt)
                    plan = replace(plan, decoder=replacement)
                    attempt += 1
        finally:
            if trace.decode_started is not None:
                self._metrics.route_decisions.labels(trace.path, trace.reason).inc()

    @staticmethod
    def _await_first_token(exchange: Exchange, plan: Plan) -> None:
        """A streamed direct call's prompt counts in its decoder's queue until the first token (or the
        request's end): the prefill a new direct prompt there waits behind (adaptive mode reads it)."""
        trace = exchange.trace
        if trace.first_token_at is not None:
            return
        earlier = trace.on_first_token
        if earlier is not None:
            earlier()  # an earlier decoder failed before its first token: the prompt left its queue
        release = plan.decoder.queue_prefill(plan.uncached_tokens)
        trace.on_first_token = release
        exchange.done.defer(release)

    def _decodes_alone(self, staged: StagedKV) -> bool:
        """Whether a decoder that could not load `staged` may compute the prompt itself instead: a
        sequential hop's KV (not one still running beside the call, nor KV pushed into the decoder)."""
        return staged.pending is None and self._connector.serves_direct and not self._connector.pushes_to_decoder

    def _after_kv_rejected(self, exchange: Exchange, failure: DecodeFailed, plan: Plan) -> Plan:
        """The decoder failed to load the staged KV: it computes the prompt itself (the transfer was
        ineffective). Not its failure, nor a retry: the decoder answered, the transfer did not work."""
        self._metrics.kv_transfer_ineffective.inc()
        log.warning(
            "request %s: decoder %s could not load the staged KV (%s); it computes the prompt itself",
            exchange.request_id,
            plan.decoder.url,
            failure.detail,
        )
        return plan.direct(KV_REJECTED)

    def _decode_call(self, request: ClientRequest, staged: StagedKV | None) -> DecodeCall:
        if staged is None or staged.handoff is None:
            return DecodeCall.unchanged(request)
        return self._connector.decode_call(staged.handoff, staged)

    def _serves(self, staged: StagedKV, decoder: Endpoint) -> bool:
        """Whether `decoder` can pick up `staged`: any decoder can pull KV, pushed KV is in one decoder."""
        return not self._connector.pushes_to_decoder or staged.handoff is None or staged.handoff.decoder is decoder

    def _note_staged(self, trace: RequestTrace, staged: StagedKV | None, done: Completion) -> None:
        trace.staged_tokens = None if staged is None else staged.prompt_tokens
        if staged is None:
            return
        if "remote_prefill_cached_tokens" in staged.params:
            trace.usage_shows_transfer = False  # the decoder will echo the prefiller's count
        if staged.pending is not None:
            done.defer(staged.pending.cancel)  # the request is over: a prefill still running is not needed
        if self._connector.holds_kv and staged.handoff is not None:
            done.hold_kv(HeldKV(staged, self._connector, self._metrics))

    async def _next_decoder(
        self, exchange: Exchange, exc: DecodeFailed, plan: Plan, tried: list[Endpoint], attempt: int
    ) -> Endpoint:
        """The decoder to try after `plan.decoder` failed before answering; UpstreamError when none is left."""
        replacement = exchange.planner.alternative("decode", exchange.prompt, exclude=tried)
        if replacement is None and plan.decoder.available:
            # The only decoder left: try it again (with fresh KV if it may have used the staged
            # one). An unreachable one never saw the request, so resending it is safe.
            replacement = plan.decoder
        if replacement is None or attempt >= self._retries.decode_retries:
            raise UpstreamError(f"The decoder failed before answering: {exc.detail}") from None
        self._metrics.retries.labels("decode").inc()
        if replacement is plan.decoder:
            await asyncio.sleep(SAME_DECODER_BACKOFF * (attempt + 1))
        return replacement

    async def _stage(self, exchange: Exchange, plan: Plan, tried: list[Endpoint]) -> tuple[StagedKV | None, Plan]:
        """The prefill hop, retried on other prefillers; when it cannot stage KV, apply the policy.

        A concurrent connector's hop runs on beside the decode call: it comes back at once, pending.
        """
        request_id, trace = exchange.request_id, exchange.trace
        while plan.prefiller is not None:
            handoff = self._connector.handoff(
                exchange.request, exchange.prompt, plan.prefiller, plan.decoder, request_id
            )
            hop = self._prefill(handoff, exchange, tried)
            if self._connector.concurrent:
                trace.prefill_overlaps_decode = True
                pending = asyncio.create_task(hop, name=f"prefill {request_id}")
                pending.add_done_callback(lambda task: self._prefill_settled(task, trace))
                return StagedKV(params={}, prompt_tokens=None, cached_tokens=0, pending=pending, handoff=handoff), plan
            try:
                staged = await (self._finished_even_if_left(hop, handoff) if self._connector.holds_kv else hop)
                return replace(staged, handoff=handoff), plan
            except PrefillFailed as exc:
                plan = self._after_prefill_failure(exchange, exc, plan, tried)
        return None, plan

    async def _finished_even_if_left(self, hop: Coroutine[Any, Any, StagedKV], handoff: Handoff) -> StagedKV:
        """The prefill call; when its client leaves, the call gets `ORPHANED_PREFILL_GRACE` seconds to
        answer before it is cut (see there), and what it staged is released."""
        task = asyncio.create_task(hop, name=f"prefill {handoff.request_id}")
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            orphan = asyncio.create_task(self._release_orphaned(task, handoff), name=f"orphan {handoff.request_id}")
            self._orphaned_prefills.add(orphan)
            orphan.add_done_callback(self._orphaned_prefills.discard)
            raise

    async def _release_orphaned(self, task: asyncio.Task[StagedKV], handoff: Handoff) -> None:
        await asyncio.wait({task}, timeout=ORPHANED_PREFILL_GRACE)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            return
        if task.cancelled() or task.exception() is not None:
            return
        HeldKV(replace(task.result(), handoff=handoff), self._connector, self._metrics).release()

    def _after_prefill_failure(
        self, exchange: Exchange, failure: PrefillFailed, plan: Plan, tried: list[Endpoint]
    ) -> Plan:
        """The plan after `plan.prefiller` failed: another prefiller, or the policy (fallback or 503)."""
        prefiller = plan.prefiller
        assert prefiller is not None
        tried.append(prefiller)
        exchange.trace.prefill_error = str(failure)
        log.warning("request %s: prefill on %s failed: %s", exchange.request_id, prefiller.url, failure)
        # A 4xx is the request's own fault: another prefiller would say the same.
        if failure.reason != "status_4xx" and len(tried) <= self._retries.prefill_retries:
            alternative = exchange.planner.alternative("prefill", exchange.prompt, exclude=tried)
            if alternative is not None:
                self._metrics.retries.labels("prefill").inc()
                return replace(plan, prefiller=alternative)
        if self._retries.prefill_failure_policy == "fail" or not self._connector.serves_direct:
            raise PrefillUnavailable(f"The prefill pool could not serve this request ({failure.reason}).")
        self._metrics.prefill_fallbacks.labels(failure.reason).inc()
        return plan.direct(PREFILL_FAILED)

    def _prefill_settled(self, task: asyncio.Task[StagedKV], trace: RequestTrace) -> None:
        """A concurrent prefill ended: keep its token counts; a failure after the first token is only logged."""
        if task.cancelled():
            return
        failure = task.exception()
        if failure is None:
            trace.staged_tokens = task.result().prompt_tokens
        elif trace.first_token_at is not None:
            log.warning("request %s: the prefill call failed after the decoder answered: %s", trace.request_id, failure)

    def _prefill_deadline(
        self, exchange: Exchange, prefiller: Endpoint, tried: list[Endpoint], queued_ahead: int
    ) -> float | None:
        """The learned deadline of this request's prefill hop (None: prefill_timeout alone applies).

        Only where an abandoned hop has somewhere to go (the decoder alone, or another prefiller not
        tried yet): else a prefiller merely slower than usual would fail requests it would have served.
        A hop is judged as if the prefiller cached none of the prompt, behind the prompt tokens this
        router has queued there already, so a cold prompt or a burst is not taken for a hang. And not
        for a concurrent connector, whose prefill call lasts as long as its decoder takes to fetch
        the KV, however long other prefills took.
        """
        if self._connector.concurrent:
            return None
        falls_back = self._retries.prefill_failure_policy == "fallback" and self._connector.serves_direct
        untried = [other for other in exchange.planner.pool.healthy("prefill") if other not in (*tried, prefiller)]
        if not falls_back and not (untried and len(tried) < self._retries.prefill_retries):
            return None
        timeouts = self._timeouts
        size = (queued_ahead + exchange.prompt.num_tokens,)  # the worst case: the prefiller caches nothing
        return exchange.deadlines.deadline("prefill", size, timeouts.learned, timeouts.prefill)

    async def _prefill(self, handoff: Handoff, exchange: Exchange, tried: list[Endpoint]) -> StagedKV:
        """One prefill hop. One past its learned deadline, far longer than prefills of its size have
        been taking, is abandoned as "slow"; the caller retries it elsewhere or falls back, so a
        request waits at most (1 + prefill_retries) learned deadlines for hung prefillers."""
        trace, judge = exchange.trace, exchange.prefill_judge
        prefiller = handoff.prefiller
        trace.prefiller = prefiller.url
        started = trace.prefill_started = time.perf_counter()
        tokens = trace.uncached_tokens or 0
        queued_ahead = prefiller.queued_tokens
        learned = self._prefill_deadline(exchange, prefiller, tried, queued_ahead)
        limit = self._timeouts.prefill if learned is None else learned
        prefiller.start()
        dequeue = prefiller.queue_prefill(tokens)
        outcome = "ok"
        try:
            async with asyncio.timeout(limit):
                staged = await self._connector.stage(handoff)
            judge.succeeded(prefiller)
            # Learned by what the prefiller computed: a prefix-cache hit's speed would make cold prompts look hung.
            computed = (staged.prompt_tokens or exchange.prompt.num_tokens) - staged.cached_tokens
            exchange.deadlines.learn("prefill", (queued_ahead + max(computed, 1),), time.perf_counter() - started)
            return staged
        except TimeoutError:
            if learned is None:
                # No answer within the fixed timeout is the engine's failure whatever the request.
                outcome = "timeout"
                prefiller.record_failure("prefill timed out")
                raise PrefillFailed("timeout", f"{prefiller.url}: no answer in {limit:g} s") from None
            # Far slower than the worst case of its size, queue included: taken for a hang, which
            # must open the breaker of an engine that hangs while it passes its health probes.
            outcome = "slow"
            prefiller.record_failure("prefill far slower than learned")
            detail = f"{prefiller.url}: no answer within its learned deadline of {limit:.3g} s"
            raise PrefillFailed("slow", detail) from None
        except PrefillFailed as exc:
            outcome = exc.reason
            if exc.reason != "status_4xx":
                judge.failed(prefiller, str(exc), answered=exc.reason in ANSWERED_PREFILL_FAILURES)
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"  # the client left, or a concurrent prefill was no longer needed
            raise
        finally:
            prefiller.finish()
            dequeue()
            trace.prefill_seconds = time.perf_counter() - started
            self._metrics.prefill.labels(outcome).observe(trace.prefill_seconds)

    def _record_plan(self, trace: RequestTrace, plan: Plan) -> None:
        """Put the plan being served on the trace; the decision is counted once, when serving ends."""
        trace.path = plan.path
        trace.reason = plan.reason
        trace.uncached_tokens = plan.uncached_tokens

    async def _decode(
        self, exchange: Exchange, decoder: Endpoint, call: DecodeCall, staged: StagedKV | None, *, replaceable: bool
    ) -> Response:
        """The decode call, until its first token (or whole answer); while a concurrent prefill still
        runs, that prefill failing first cancels the call and raises its PrefillFailed, and a decode
        call failing while the prefill cannot be shown to have done its part is a failed hand-off,
        counted against the prefiller."""
        if staged is None or staged.pending is None:
            return await self._decode_answer(exchange, decoder, call, staged, replaceable=replaceable)
        # Its first token waits for the prefill running beside it: a slow one is that prefill's, and
        # no learned deadline judges the decoder for it.
        answer = self._decode_answer(exchange, decoder, call, staged, replaceable=False)
        try:
            return await unless_prefill_fails(answer, staged.pending)
        except PrefillFailed as exc:
            if exc.reason == HANDOFF_FAILED and staged.handoff is not None:
                staged.handoff.prefiller.record_failure(str(exc))
            raise

    async def _decode_answer(
        self, exchange: Exchange, decoder: Endpoint, call: DecodeCall, staged: StagedKV | None, *, replaceable: bool
    ) -> Response:
        request = exchange.request
        if call.answered is not None:
            return await self._answer_from_prefill(exchange, call, staged)
        deadline = self._decode_deadline(exchange, decoder, with_kv=staged is not None, replaceable=replaceable)
        exchange.done.kv_sent_to(decoder)
        upstream = await self._open(decoder, call, exchange.request_id, deadline)
        if upstream.status_code != 200:
            return await self._engine_refusal(exchange, upstream, decoder)
        if not request.stream:
            return await self._whole_answer(exchange, upstream, decoder, staged, call, deadline)
        stream = await self._primed_stream(exchange, upstream, decoder, staged, call, deadline)
        exchange.done.kv_taken_by(decoder)
        return RelayedStream(stream, media_type=stream.media_type, headers=exchange.headers)

    def _decode_deadline(self, exchange: Exchange, decoder: Endpoint, *, with_kv: bool, replaceable: bool) -> Deadline:
        """When the decoder must have answered: its first token (streams) or its whole answer.

        The learned deadline, where one is known and shorter than the phase's timeout, judges a
        non-streamed answer by its `max_tokens` (vLLM sends nothing before the whole answer), so a
        long answer still has the time an answer that long takes. It applies only while another
        decoder could take the request (a retry left, a decoder to take it): the last attempt, or
        the only decoder, merely slower than usual, keeps the timeout rather than fail for nothing.
        """
        request, timeouts = exchange.request, self._timeouts
        started = asyncio.get_running_loop().time()
        # Judged as if the decoder held none of the prompt it is to compute (it may have evicted what
        # the router believes it caches); learned by the router's estimate of what it computed.
        tokens = exchange.prompt.num_tokens if not with_kv else (exchange.trace.uncached_tokens or 0)
        others = exchange.planner.pool.healthy("decode")
        if not replaceable or not any(other is not decoder for other in others):
            return Deadline(started, started + (timeouts.first_token if request.stream else timeouts.total))
        if request.stream:
            cap = timeouts.first_token
            learned = exchange.deadlines.deadline("first_token", (tokens,), timeouts.learned, cap, with_kv=with_kv)
        else:
            cap = timeouts.total
            output = self._most_output(exchange)
            learned = (
                None
                if output is None
                else exchange.deadlines.deadline("answer", (tokens, output), timeouts.learned, cap, with_kv=with_kv)
            )
        return Deadline(started, started + (cap if learned is None else learned), learned)

    def _most_output(self, exchange: Exchange) -> int | None:
        """The most output tokens the answer may have (None: not known, so no learned deadline)."""
        body, prompt = exchange.request.body, exchange.prompt
        limit = body.get("max_completion_tokens")
        if not isinstance(limit, int):
            limit = body.get("max_tokens")
        if not isinstance(limit, int):
            # Unset, vLLM lets the answer run to the end of the context window.
            if self._model.max_model_len is None:
                return None
            limit = self._model.max_model_len - prompt.num_tokens
        choices = body.get("n")
        sequences = (choices if isinstance(choices, int) and choices > 1 else 1) * exchange.request.batch_size
        return max(limit, 1) * sequences

    def _learn_decode(self, exchange: Exchange, deadline: Deadline, staged: StagedKV | None) -> None:
        """Learn from a decoder that answered in time: its first token, or its whole answer."""
        seconds = asyncio.get_running_loop().time() - deadline.started
        tokens = exchange.trace.uncached_tokens or 0
        with_kv = staged is not None
        if exchange.request.stream:
            exchange.deadlines.learn("first_token", (tokens,), seconds, with_kv=with_kv)
        elif exchange.trace.completion_tokens is not None:
            size = (tokens, exchange.trace.completion_tokens)
            exchange.deadlines.learn("answer", size, seconds, with_kv=with_kv)

    async def _primed_stream(
        self,
        exchange: Exchange,
        upstream: httpx.Response,
        decoder: Endpoint,
        staged: StagedKV | None,
        call: DecodeCall,
        deadline: Deadline,
    ) -> EventStream:
        """The decoder's stream, read up to its first token (so a failing decoder can still be replaced)."""
        stream = self._event_stream(exchange, upstream, call, staged)
        if staged is not None and staged.pending is not None:
            # The prefiller's cache hit is known once its call ends, usually before the decoder's usage.
            staged.pending.add_done_callback(
                lambda _: setattr(stream, "cached_tokens", prefiller_cached_tokens(staged))
            )
        primed = False
        try:
            await stream.prime(deadline.at)
            primed = True
        except DecodeFailedEarly as exc:
            raise DecodeFailed(exc.detail, kv_consumed=True, failure=exc.detail, answered=True, in_band=True) from None
        except TimeoutError:
            if deadline.learned is not None:
                raise missed_learned_deadline(deadline.learned) from None
            decoder.record_failure("no first token in time")
            raise UpstreamTimeout(f"The decoder produced no token within {self._timeouts.first_token:g} s.") from None
        except httpx.HTTPError as exc:
            detail = f"the stream broke before the first token: {type(exc).__name__}"
            raise DecodeFailed(detail, kv_consumed=True, failure=type(exc).__name__) from None
        finally:
            if not primed:
                await stream.discard()  # not handed to the client: close it here, whatever happened
        exchange.decode_judge.succeeded(decoder)
        self._learn_decode(exchange, deadline, staged)
        return stream

    async def _answer_from_prefill(self, exchange: Exchange, call: DecodeCall, staged: StagedKV | None) -> Response:
        """The prefill produced the whole answer (one token): relay it as a decoder's, without a decoder."""
        assert call.answered is not None
        exchange.trace.decoder = None
        if not exchange.request.stream:
            rewrite = None if call.answer is None else call.answer.body
            content = relay_body(call.answered, exchange.trace, prefiller_cached_tokens(staged), rewrite)
            exchange.done()
            return Response(content, media_type="application/json", headers=exchange.headers)
        stream = self._answered_stream(exchange, call, staged)
        return RelayedStream(stream, media_type="text/event-stream", headers=exchange.headers)

    def _answered_stream(self, exchange: Exchange, call: DecodeCall, staged: StagedKV | None) -> EventStream:
        assert call.answered is not None
        upstream = httpx.Response(
            200, stream=httpx.ByteStream(call.answered), headers={"content-type": "text/event-stream"}
        )
        return self._event_stream(exchange, upstream, call, staged)

    def _event_stream(
        self, exchange: Exchange, upstream: httpx.Response, call: DecodeCall, staged: StagedKV | None
    ) -> EventStream:
        """The relay of a decoder's stream (or of the prefill's answer) to this client."""
        return EventStream(
            upstream,
            exchange.trace,
            cached_tokens=prefiller_cached_tokens(staged),
            on_close=exchange.done,
            idle_timeout=self._timeouts.idle,
            strip_usage=exchange.strip_usage,
            rewrite=None if call.answer is None else call.answer.chunk,
            on_disconnect=self._metrics.client_disconnects.labels("stream").inc,
        )

    def _stream_after_head(self, exchange: Exchange, plan: Plan, call: DecodeCall, staged: StagedKV | None) -> Response:
        """Send the client the head (the prefiller's first token) now, the decoder's continuation after.

        The client has seen bytes from here on: a decoder that fails before its first token is
        replaced within the stream (the continuation is a plain request any decoder can compute),
        and what cannot be served ends the stream with an in-band error.
        """
        trace, done = exchange.trace, exchange.done

        async def events() -> AsyncGenerator[bytes, None]:
            stream: EventStream | None = None
            try:
                trace.mark_token_chunk(time.perf_counter())
                yield call.head
                try:
                    stream = await self._continuation(exchange, plan, call, staged)
                except RouterError as exc:
                    trace.fail("upstream_error", exc.message)
                    yield error_event(exc.message)
                    return
                except Exception as exc:  # a bug, not the client: the stream still ends, in-band
                    log.exception("request %s: the continuation after the first token failed", exchange.request_id)
                    trace.fail("error", f"internal error: {type(exc).__name__}: {exc}")
                    yield error_event("The router failed to continue this answer.")
                    return
                async for chunk in stream:
                    yield chunk
            finally:
                if stream is not None:
                    await stream.close()
                else:
                    release()

        def release() -> None:
            """The stream ended without a decoder's stream to close (or never began): record it."""
            if not trace.finished and trace.outcome == "ok":
                self._metrics.client_disconnects.labels("serve").inc()
                trace.fail("client_disconnect", "the client left before the decoder answered", status=499)
            done()

        return HeadFirstStream(events(), release, media_type="text/event-stream", headers=exchange.headers)

    async def _continuation(
        self, exchange: Exchange, plan: Plan, call: DecodeCall, staged: StagedKV | None
    ) -> EventStream:
        """The decoder's stream after the head, primed; decoders failing before their first token are replaced."""
        trace, done, request_id = exchange.trace, exchange.done, exchange.request_id
        if call.answered is not None:
            trace.decoder = None
            return self._answered_stream(exchange, call, staged)
        tried: list[Endpoint] = []
        attempt = 0
        while True:
            decoder = plan.decoder
            done.hold(decoder)
            trace.decoder = decoder.url
            now = asyncio.get_running_loop().time()
            # The client already has the head: the continuation keeps the phase's timeout.
            deadline = Deadline(now, now + self._timeouts.first_token)
            try:
                upstream = await self._open(decoder, call, request_id, deadline)
                if upstream.status_code != 200:
                    await self._refused_after_head(upstream, decoder)
                stream = await self._primed_stream(exchange, upstream, decoder, staged, call, deadline)
            except DecodeFailed as exc:
                exchange.decode_judge.failed(decoder, exc.failure, answered=exc.answered)
                tried.append(decoder)
                log.warning("request %s: decoder %s failed before answering: %s", request_id, decoder.url, exc)
                if exc.kv_consumed:
                    done.kv_taken_by(decoder)
                plan = replace(plan, decoder=await self._next_decoder(exchange, exc, plan, tried, attempt))
                if plan.decoder is not decoder:
                    done.release_kv()  # the continuation is computed whole elsewhere: nobody takes it here
                attempt += 1
            else:
                done.kv_taken_by(decoder)
                return stream

    async def _refused_after_head(self, upstream: httpx.Response, decoder: Endpoint) -> None:
        """A decoder's refusal once the client has the head: a 5xx may be retried elsewhere, a 4xx not."""
        content = await read_refusal(upstream, decoder)
        detail = f"{decoder.url} answered {upstream.status_code}: {content[:300].decode(errors='replace')}"
        raise UpstreamError(f"The decoder refused the continuation: {detail}")

    async def _open(self, decoder: Endpoint, call: DecodeCall, request_id: str, deadline: Deadline) -> httpx.Response:
        """Send the decode call and wait for its status line (reads are timed by the caller)."""
        outgoing = self._client.build_request(
            "POST",
            f"{decoder.url}{call.path}",
            content=call.body,
            headers={"X-Request-Id": request_id, "Content-Type": "application/json", "Accept-Encoding": "identity"},
            timeout=httpx.Timeout(None, connect=self._timeouts.connect, pool=self._timeouts.connect),
        )
        try:
            async with asyncio.timeout_at(deadline.at):
                return await self._client.send(outgoing, stream=True)
        except TimeoutError:
            if deadline.learned is not None:
                raise missed_learned_deadline(deadline.learned) from None
            decoder.record_failure("timeout")
            raise UpstreamTimeout("The decoder did not answer in time.") from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            failure = type(exc).__name__
            detail = f"{decoder.url} could not be reached: {failure}"
            raise DecodeFailed(detail, kv_consumed=False, failure=failure) from None
        except httpx.HTTPError as exc:
            failure = type(exc).__name__
            detail = f"{decoder.url} broke the connection: {failure}"
            raise DecodeFailed(detail, kv_consumed=True, failure=failure) from None

    async def _whole_answer(
        self,
        exchange: Exchange,
        upstream: httpx.Response,
        decoder: Endpoint,
        staged: StagedKV | None,
        call: DecodeCall,
        deadline: Deadline,
    ) -> Response:
        try:
            async with asyncio.timeout_at(deadline.at):
                content = await upstream.aread()
        except TimeoutError:
            if deadline.learned is not None:
                raise missed_learned_deadline(deadline.learned) from None
            decoder.record_failure("timeout")
            raise UpstreamTimeout(f"The decoder did not finish within {self._timeouts.total:g} s.") from None
        except httpx.HTTPError as exc:
            failure = type(exc).__name__
            raise DecodeFailed(f"the answer broke off: {failure}", kv_consumed=True, failure=failure) from None
        finally:
            await close_quietly(upstream)
        exchange.done.kv_taken_by(decoder)
        # Judged on the decoder's own answer: a rewrite (LMCache's) counts the prefiller's token as output.
        failure = failed_before_output(content)
        if failure is not None:
            raise DecodeFailed(
                f"the decoder failed the request in-band: {failure}",
                kv_consumed=True,
                failure=failure,
                answered=True,
                in_band=True,
            )
        rewrite = None if call.answer is None else call.answer.body
        content = relay_body(content, exchange.trace, prefiller_cached_tokens(staged), rewrite)
        exchange.decode_judge.succeeded(decoder)
        self._learn_decode(exchange, deadline, staged)
        exchange.done()
        return Response(content, media_type="application/json", headers=exchange.headers)

    async def _engine_refusal(self, exchange: Exchange, upstream: httpx.Response, decoder: Endpoint) -> Response:
        """Pass an engine's 4xx through as it is (the request's fault); a 5xx is a decoder failure."""
        content = await read_refusal(upstream, decoder)
        status = upstream.status_code
        exchange.trace.fail("engine_rejected", f"decoder answered {status}", status=status)
        exchange.done()
        media_type = upstream.headers.get("content-type", "application/json")
        return Response(content, status_code=status, media_type=media_type, headers=exchange.headers)


def missed_learned_deadline(seconds: float) -> DecodeFailed:
    """A decoder silent far longer than decoders have been for calls of this size: taken for a hang,
    so it counts against the decoder at once (a hung engine may still pass its health probes), and
    another decoder takes the request. It may have begun pulling the staged KV, so that is staged
    again for the next one."""
    detail = f"no answer within its learned deadline of {seconds:.3g} s"
    return DecodeFailed(detail, kv_consumed=True, failure="timeout")


async def read_refusal(upstream: httpx.Response, decoder: Endpoint) -> bytes:
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


async def unless_prefill_fails(
    work: Coroutine[Any, Any, T], pending: asyncio.Task[StagedKV], *, grace: float = HANDOFF_GRACE
) -> T:
    """Run `work` (a decode call up to its first token) beside `pending`, its concurrent prefill call.

    A prefill that fails first cancels `work` and raises its PrefillFailed; one that succeeds
    changes nothing. `work` failing (DecodeFailed) while the prefill still runs may be the
    prefill's doing (the decoder waits on it for the KV), so the prefill gets `grace` seconds to
    show it: failed, its PrefillFailed; still running, PrefillFailed("handoff_failed") (the caller
    cancels it); done, the decoder's own DecodeFailed. A cancellation of the caller propagates.
    """
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, pending}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() or not prefill_failed(pending):
            return await task
    except DecodeFailed as exc:
        raise await _failure_to_blame(exc, pending, grace) from None
    finally:
        if not task.done():
            task.cancel()
            # Wait for it to end without taking its CancelledError for one aimed at the caller.
            await asyncio.wait({task})
    failure = pending.exception()
    assert failure is not None
    raise failure


async def _failure_to_blame(failure: DecodeFailed, pending: asyncio.Task[StagedKV], grace: float) -> Exception:
    """The decode call failed before its first token: the prefill's failure if it has one (or has
    not finished within `grace` seconds: a failed hand-off), else the decoder's."""
    if not pending.done():
        await asyncio.wait({pending}, timeout=grace)
    if prefill_failed(pending):
        prefill_failure = pending.exception()
        assert prefill_failure is not None
        return prefill_failure
    if not pending.done():
        return PrefillFailed(
            HANDOFF_FAILED, f"the decoder failed ({failure.detail}) while the prefill call was still running"
        )
    return failure


def prefill_failed(pending: asyncio.Task[StagedKV]) -> bool:
    return pending.done() and not pending.cancelled() and pending.exception() is not None


def prefiller_cached_tokens(staged: StagedKV | None) -> int | None:
    """The prefiller's cache hit, reported to the client (None: not known, the decoder's view stands)."""
    if staged is None:
        return None
    pending = staged.pending
    if pending is None:
        return staged.cached_tokens
    if pending.done() and not prefill_failed(pending) and not pending.cancelled():
        return pending.result().cached_tokens
    return None


def abandon(staged: StagedKV) -> None:
    """Give up staged KV: a concurrent prefill still running for it is cancelled."""
    if staged.pending is not None:
        staged.pending.cancel()


class HeldKV:
    """KV a prefill staged, held until a decode call picks it up; else released (once).

    Pushed into one decoder (LMCache): taken once that decoder answered a decode call for it.
    Held on the prefiller (NIXL): the decoder's from the moment a decode call for it is sent to
    one, since vLLM's decoder frees the prefiller's blocks itself when it refuses or aborts it.
    """

    def __init__(self, staged: StagedKV, connector: Connector, metrics: RouterMetrics) -> None:
        assert staged.handoff is not None
        self.staged = staged
        self.decoder = staged.handoff.decoder
        self._connector = connector
        self._metrics = metrics
        self._settled = False

    def sent_to(self, decoder: Endpoint) -> None:
        """A decode call for this KV is being sent to `decoder`."""
        if not self._connector.pushes_to_decoder:
            self._settled = True

    def not_delivered(self) -> None:
        """The decode call never reached its decoder (it could not be reached)."""
        if not self._connector.pushes_to_decoder:
            self._settled = False

    def taken_by(self, decoder: Endpoint) -> None:
        """`decoder` answered a decode call for this KV (a token, a whole answer or an error)."""
        if decoder is self.decoder or not self._connector.pushes_to_decoder:
            self._settled = True

    def release(self) -> None:
        if not self._settled:
            self._settled = True
            self._metrics.kv_released.labels(self._connector.name).inc()
            self._connector.release_unused(self.staged)


class Completion:
    """Releases what a request holds, exactly once: its decoder slot, KV staged for it that no
    decode call took, the in-flight gauge, its trace, and the caller's `on_finish` (the admission slot)."""

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
        self._kv: HeldKV | None = None
        self._deferred: list[Callable[[], object]] = []
        self._done = False
        metrics.in_flight.inc()

    def defer(self, cleanup: Callable[[], object]) -> None:
        """Run `cleanup` when the request is over (for example: cancel a prefill still running)."""
        self._deferred.append(cleanup)

    def hold(self, decoder: Endpoint) -> None:
        """Count the request against `decoder` (moving it off a decoder held before)."""
        if self._decoder is decoder:
            return
        if self._decoder is not None:
            self._decoder.finish()
        decoder.start()
        self._decoder = decoder

    def hold_kv(self, kv: HeldKV) -> None:
        """Hold KV staged for this request until a decode call takes it (KV held before is released)."""
        self.release_kv()
        self._kv = kv

    def kv_sent_to(self, decoder: Endpoint) -> None:
        if self._kv is not None:
            self._kv.sent_to(decoder)

    def kv_not_delivered(self) -> None:
        if self._kv is not None:
            self._kv.not_delivered()

    def kv_taken_by(self, decoder: Endpoint) -> None:
        if self._kv is not None:
            self._kv.taken_by(decoder)

    def release_kv(self) -> None:
        """Release the staged KV unless a decode call took it."""
        kv, self._kv = self._kv, None
        if kv is not None:
            kv.release()

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        for cleanup in self._deferred:
            cleanup()
        self.release_kv()
        if self._decoder is not None:
            self._decoder.finish()
        self._metrics.in_flight.dec()
        self._observer.finish(self._trace)
        if self._on_finish is not None:
            self._on_finish()


class ClosingStream(StreamingResponse):
    """A streaming response that releases what it holds (`discard()`) once sent, also when the client
    left before its body began; the caller discards it when it is never sent at all."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.discard()

    async def discard(self) -> None:
        raise NotImplementedError


class HeadFirstStream(ClosingStream):
    """A stream the router starts itself (with the prefiller's first token) before the decoder
    answers; its events close what they opened, and `release` runs even if they never began."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        release: Callable[[], None],
        *,
        media_type: str,
        headers: dict[str, str],
    ) -> None:
        super().__init__(events, media_type=media_type, headers=headers)
        self._events = events
        self._release = release

    async def discard(self) -> None:
        """Close what the events opened and release the request (also when it was never sent)."""
        with anyio.CancelScope(shield=True):
            await self._events.aclose()
        self._release()


class RelayedStream(ClosingStream):
    """A streaming response that closes its upstream even if the client left before the body began."""

    def __init__(self, stream: EventStream, *, media_type: str, headers: dict[str, str]) -> None:
        super().__init__(stream, media_type=media_type, headers=headers)
        self._stream = stream

    async def discard(self) -> None:
        """Close the upstream and record the request (also when it was never sent)."""
        await self._stream.close()
