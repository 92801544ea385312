"""Gateway.handle(): a request's whole path, read top to bottom.

prepare (tokenize, context window, prompt-token limit) -> plan (threshold, engines) -> serve:
prefill hop (prefill.py: retries, then the fallback policy) -> decode hop (decode.py: decoder
replaced while the client has seen nothing) -> relay (relay.py) -> finish (completion.py).

The connector decides the shape of the two hops (shapes.py), over one decode-and-relay core: a
sequential one's decode call starts once the prefill hop staged the KV; a concurrent one's starts
with it (concurrent.py), and its decoders serve nothing alone (SGLang: every request goes through a
prefiller, or is refused); one whose prefill produced the first token (LMCache) has it sent to the
client at once (head_first.py). Staged KV a connector holds until a decode call picks it up (NIXL on
the prefiller, LMCache in the chosen decoder) is released when no decode call will.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from dpd_router.api.auth import ANONYMOUS, Principal
from dpd_router.config import Settings
from dpd_router.gateway.answer import Answer
from dpd_router.gateway.completion import Completion
from dpd_router.gateway.concurrent import abandon
from dpd_router.gateway.deadlines import HopDeadlines
from dpd_router.gateway.decode import DecodeHop, DecoderReplacement
from dpd_router.gateway.errors import DecodeFailed
from dpd_router.gateway.exchange import Exchange, ask_for_usage
from dpd_router.gateway.head_first import HeadFirst
from dpd_router.gateway.policy import PhaseTimeouts, RetryPolicy
from dpd_router.gateway.prefill import PrefillHop
from dpd_router.gateway.resume import ResumePolicy
from dpd_router.gateway.resume_text import by_ids, said_text
from dpd_router.gateway.shapes import shape_of
from dpd_router.gateway.watch import EngineProbe
from dpd_router.pool.adapters import AdapterLoader
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.served_model import ServedModel
from dpd_router.pool.transport import EngineCalls
from dpd_router.prompt.context_window import check_context_length, prompt_too_long
from dpd_router.prompt.tokenizer import LocalTokenizer, Prompt, PromptTooLong, TokenCounter, read_prompt
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Asked, Observer, RequestTrace
from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import PrefillFailed, PrefillUnavailable, RouterError
from dpd_router.request.frozen import evolve
from dpd_router.routing.adapters import AdapterPlanners
from dpd_router.routing.experiments import ExperimentArms
from dpd_router.routing.planner import KV_REJECTED, Plan, Planner
from dpd_router.shadow import LiveShadow, Shadow
from dpd_router.transfer.base import Connector, DecodeCall, StagedKV

log = logging.getLogger("dpd_router.gateway")


class Gateway:
    """Serves one request end to end; built once at startup with its collaborators."""

    def __init__(
        self,
        *,
        engines: EngineCalls,
        tokenizers: Mapping[str | None, TokenCounter],
        planners: Mapping[str | None, Planner],
        connector: Connector,
        observer: Observer,
        metrics: RouterMetrics,
        model: ServedModel,
        timeouts: PhaseTimeouts,
        retries: RetryPolicy,
        experiments: ExperimentArms | None = None,
        shadow: LiveShadow | None = None,
        adapters: AdapterPlanners | None = None,
        adapter_loader: AdapterLoader | None = None,
    ) -> None:
        self._tokenizers = tokenizers
        self._planners = planners
        self._experiments = experiments
        self._adapters = adapters
        self._adapter_loader = adapter_loader
        self._connector = connector
        self._observer = observer
        self._metrics = metrics
        self._model = model
        self._timeouts = timeouts
        self._retries = retries
        self._shadow = shadow
        probe = EngineProbe(engines)
        self._prefill = PrefillHop(connector, metrics, probe)
        decode = DecodeHop(engines, connector, metrics, model, probe)
        self._shape = shape_of(connector, self._prefill, decode, HeadFirst(decode, metrics), metrics)
        # One per pool, as planners: a tenant's engines may be faster or slower than the shared ones.
        self._deadlines = {tenant: HopDeadlines() for tenant in planners}

    async def close(self) -> None:
        """Stop prefill calls whose clients left (before the connector that would release their KV closes)."""
        await self._prefill.close()

    def reconfigure(self, settings: Settings) -> None:
        """Apply live timeout and retry settings to the requests that start from now on."""
        self._timeouts = PhaseTimeouts.from_settings(settings)
        self._retries = RetryPolicy.from_settings(settings)

    @property
    def planners(self) -> Mapping[str | None, Planner]:
        return self._planners

    @property
    def experiments(self) -> ExperimentArms | None:
        return self._experiments

    def planner_for(self, tenant: str | None) -> Planner:
        """A tenant with reserved engines plans over them alone; everyone else shares the main pool."""
        return self._planners.get(tenant) or self._planners[None]

    def _planner_of(
        self,
        request: ClientRequest,
        principal: Principal,
        headers: Mapping[str, str],
        request_id: str,
        adapter: str | None,
    ) -> tuple[Planner, str | None]:
        """The tenant's planner; for a LoRA adapter, the one over the tenant's engines that list it; on the
        shared pool, the planner of the experiment arm the request falls in, if any, and the arm's name.
        Arms split the shared pool's base-model traffic only: a tenant's reserved engines keep their own
        settings."""
        planner = self.planner_for(principal.tenant)
        if adapter is not None and self._adapters is not None:
            return self._adapters.planner_for(planner, adapter), None
        experiments = self._experiments
        if experiments is None or not experiments.active or planner is not self._planners[None]:
            return planner, None
        session_key = planner.session_key(headers, request.body) if experiments.sticky_by == "session" else None
        api_key = None if principal.key_id == ANONYMOUS.key_id else principal.key_id
        arm = experiments.assign(session_key=session_key, api_key=api_key, request_id=request_id)
        if arm is None:
            return planner, None
        return arm.planner, arm.name

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
        adapter: str | None = None,
    ) -> Answer:
        """Serve the request; `on_finish` runs once when it is over (after the last byte, if streamed).

        `arrived` (a perf_counter reading) and `queued` (seconds waited for admission) let TTFT
        count from the moment the request reached the router. `adapter`: the LoRA adapter the request
        names, served only by engines that list it.
        """
        asked = Asked(
            request_id,
            request.kind,
            request.stream,
            started=time.perf_counter() if arrived is None else arrived,
            queue_seconds=queued,
            tenant=principal.tenant,
            model=self._model.name,
            adapter=adapter,
            key_id=principal.key_id,
        )
        done = Completion(asked, self._observer, self._metrics, on_finish)
        phase = "tokenize"
        try:
            if adapter is not None and self._adapter_loader is not None:
                # Loaded where no engine of a role lists it yet, before its planner looks for engines that do.
                await self._adapter_loader.ensure(self.planner_for(principal.tenant).pool, adapter)
            planner, arm = self._planner_of(request, principal, headers or {}, request_id, adapter)
            if arm is not None:
                done.asked_by(asked := evolve(asked, arm=arm))
            prompt = await self._prepare(request, principal, done, planner)
            if prompt.later is not None:
                # However the request ends (a plan refused, a prefill answer without ids), the whole count comes.
                done.defer(prompt.later.start)
            if prompt.rest is not None:
                self._count_whole_later(prompt, prompt.rest, done)
            if self._shadow is not None and self._shadow.current is not None:  # chosen: copied, never waited for
                self._offer_shadow(self._shadow.current, request, request_id, prompt, headers or {})
            phase = "plan"
            plan = await self._plan(request, request_id, prompt, planner, headers or {}, done)
            if prompt.later is not None and plan.prefiller is None:
                prompt.later.start()
            if prompt.rest is not None:
                self._index_whole_later(prompt.rest, plan, planner)
            phase = "serve"
            exchange = Exchange(
                request,
                prompt,
                plan.uncached_tokens,
                planner,
                request_id,
                asked,
                done,
                ask_for_usage(request),
                self.deadlines_for(principal.tenant),
                self._timeouts,
                self._retries,
                resume=self._resume_policy(request),
                continue_with=self._continue,
            )
            return await self._serve(exchange, plan)
        except RouterError as exc:
            done.ending.fail("error", exc.message, status=exc.status_code)
            done()
            raise
        except asyncio.CancelledError:
            self._metrics.client_disconnects.labels(phase).inc()
            done.ending.fail("client_disconnect", f"the client went away during {phase}", status=499)
            done()
            raise
        except Exception as exc:
            done.ending.fail("error", f"internal error: {type(exc).__name__}: {exc}", status=500)
            done()
            raise

    def _resume_policy(self, request: ClientRequest) -> ResumePolicy | None:
        """How a stream of `request` is continued if its decoder fails after output (None: not a stream)."""
        if not request.stream:
            return None
        retries = self._retries
        # LMCache's decoders answer a continuation in another API, which the router rebuilds: not resumed.
        blocked = None if self._shape.resumable else "connector"
        return ResumePolicy.arm(
            request, left=retries.stream_continuations, max_tokens=retries.continuation_max_tokens, blocked=blocked
        )

    async def _continue(
        self, exchange: Exchange, request: ClientRequest, failed: Endpoint | None, left: int
    ) -> tuple[Answer, str]:
        """Serve the continuation of `exchange`'s stream (a text completion of token ids, or a chat call that
        continues the text said) as a request of its own, planned like any (a long one is prefilled again),
        away from the `failed` decoder. It is part of the first request, which reports it: its own trace
        is not reported."""
        first = exchange.asked
        asked = evolve(
            first,
            request_id=f"{exchange.request_id}-c{exchange.ending.continuations + 1}",
            kind=request.kind,
            stream=True,
            started=time.perf_counter(),
        )
        done = Completion(asked, None, self._metrics)
        try:
            if request.kind == "chat" and exchange.request.kind in ("messages", "responses"):
                request = await self._by_ids(exchange, request) or request
            if request.kind == "completion":
                ids = request.body["prompt"]  # the prompt's and the output's token ids
                prompt = Prompt(token_ids=ids, num_tokens=len(ids), seconds=0.0)
            else:  # a Messages or Responses stream's: its conversation and the text said, counted whole
                prompt = await self._tokenize(request, first.tenant)
            planner = exchange.planner
            plan = await self._plan(request, asked.request_id, prompt, planner, {}, done)
            if failed is not None and plan.decoder is failed:
                other = planner.alternative("decode", prompt, exclude=[failed])
                plan = plan if other is None else replace(plan, decoder=other)
            retries = exchange.retries
            resume = ResumePolicy.arm(
                request,
                left=left,
                max_tokens=retries.continuation_max_tokens,
                api=first.kind,
                blocked=None if left > 0 else "limit",
            )
            sub = Exchange(
                request,
                prompt,
                plan.uncached_tokens,
                planner,
                asked.request_id,
                asked,
                done,
                False,  # the first request's relay reads the usage, and drops it where its client did not ask
                exchange.deadlines,
                exchange.timeouts,
                retries,
                resume=resume,
                continue_with=self._continue,
            )
            answer = await self._serve(sub, plan)
        except BaseException:
            done()
            raise
        served = done.served or plan
        return answer, f"{done.output.decoder} ({served.path})"

    async def _by_ids(self, exchange: Exchange, chat: ClientRequest) -> ClientRequest | None:
        """A Messages or Responses stream's continuation as a text completion of ids: its prompt as the
        router renders it (as the engine does) followed by the text said, encoded as one text. Without a local
        tokenizer, None: the chat call continues the text."""
        tokenizer = self.tokenizer_for(exchange.asked.tenant)
        if not isinstance(tokenizer, LocalTokenizer):
            return None
        return by_ids(chat, await tokenizer.continued(exchange.request, said_text(chat)))

    async def _prepare(
        self, request: ClientRequest, principal: Principal, done: Completion, planner: Planner
    ) -> Prompt:
        """The prompt's tokens, once the request is known to fit the context window and the key's budget."""
        prompt = await self._read(request, principal, planner)
        done.read(prompt.num_tokens, prompt.seconds)
        self._metrics.tokenize.observe(prompt.seconds)
        self._check_context_length(request, prompt)
        await principal.limits.take_prompt_tokens(prompt.num_tokens)
        return prompt

    async def _read(self, request: ClientRequest, principal: Principal, planner: Planner) -> Prompt:
        """The prompt read from its start only as far as the plan and the context window need (the rest
        encoded in the background only for a cache-aware threshold's prefix index, see PromptReader.rest);
        whole where no local tokenizer's bytes bound its tokens (prompt/bounds.py), or the key's prompt-token
        budget needs the exact count."""
        tokenizer = self.tokenizer_for(principal.tenant)
        if not isinstance(tokenizer, LocalTokenizer) or principal.limits.prompt_tokens is not None:
            return await self._tokenize(request, principal.tenant)
        limit = self._model.max_model_len
        try:
            reader = await tokenizer.reader(request, max_tokens=limit)
        except PromptTooLong:
            assert limit is not None
            raise prompt_too_long(limit, limit + 1, at_least=True) from None
        if reader is None:
            return await self._tokenize(request, principal.tenant)
        # A prompt that may take the prefill hop is not encoded whole yet: the prefill answer brings its ids.
        return await read_prompt(
            reader,
            planner.tokens_to_settle,
            limit,
            later=lambda prompt: prompt.at_most is not None and prompt.at_most >= planner.threshold,
            whole=planner.weighs_whole_prefixes,
            below=planner.threshold,
        )

    @staticmethod
    def _offer_shadow(
        shadow: Shadow, request: ClientRequest, request_id: str, prompt: Prompt, headers: Mapping[str, str]
    ) -> None:
        """Offer the shadow a copy with the prompt's exact length: at once, or once a prompt read in part is
        encoded whole (the copy's metrics go in the same prompt-length bucket as the live request's)."""
        if prompt.rest is None:
            shadow.offer(request, request_id, prompt.num_tokens, headers)
            return

        def offer(whole: asyncio.Future[Prompt | None]) -> None:
            if not whole.cancelled() and whole.exception() is None:
                encoded = whole.result()  # None: not encoded whole, the estimate will do
                shadow.offer(request, request_id, prompt.num_tokens if encoded is None else encoded.num_tokens, headers)

        prompt.rest.add_done_callback(offer)

    @staticmethod
    def _count_whole_later(prompt: Prompt, whole: asyncio.Future[Prompt | None], done: Completion) -> None:
        """The request of a prompt planned on its first tokens is reported (metrics, log line) with its
        exact count: the engine's, from the answer's usage, or else the whole encoding's once it is done."""
        estimate = prompt.num_tokens
        done.read(None, prompt.seconds)  # not known yet
        output = done.output

        def settle(trace: RequestTrace) -> None:
            tokens = output.prompt_tokens
            if tokens is None and whole.done() and not whole.cancelled() and whole.exception() is None:
                encoded = whole.result()
                tokens = None if encoded is None else encoded.num_tokens
            if tokens is None:
                return  # neither the engine nor the encoder counted it: reported without a count
            trace.prompt_tokens = tokens
            if trace.uncached_tokens is not None:  # planned: the cached prefix it counted stays the same
                trace.uncached_tokens = max(tokens - (estimate - trace.uncached_tokens), 0)

        done.report_after(whole, settle, unless=lambda: output.prompt_tokens is not None)

    @staticmethod
    def _index_whole_later(whole: asyncio.Future[Prompt | None], plan: Plan, planner: Planner) -> None:
        """The blocks of a prompt planned on its first tokens go into the prefix index once it is encoded
        whole, for the next prompts that share them (a prompt the encoder had no room for keeps the
        blocks its plan recorded)."""

        def recorded(task: asyncio.Future[Prompt | None]) -> None:
            if not task.cancelled() and task.exception() is None:
                encoded = task.result()
                if encoded is not None:
                    planner.record_whole(encoded, plan)

        whole.add_done_callback(recorded)

    async def _plan(
        self,
        request: ClientRequest,
        request_id: str,
        prompt: Prompt,
        planner: Planner,
        headers: Mapping[str, str],
        done: Completion,
    ) -> Plan:
        """The planner's decision for this prompt, refused when the connector cannot serve it; the request's
        record is told the plan (`done.planned`)."""
        session_key = planner.session_key(headers, request.body)
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
        done.planned(plan, planner.threshold)
        return plan

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
        if plan.prefiller is None and not self._shape.serves_direct:
            raise PrefillUnavailable(
                f"No prefiller can take this request ({plan.reason}), and the {self._connector.name} "
                "connector's decoders cannot serve it alone."
            )

    def _check_context_length(self, request: ClientRequest, prompt: Prompt) -> None:
        """Refuse, before any engine is called, what vLLM would refuse for the context length. A prompt read
        in part is judged by the bound on its count; one whose bound is not inside the window (read_prompt
        left it to the engines: its estimate is far inside) by its estimate, so it passes here and the
        engines judge it exactly."""
        limit = self._model.max_model_len
        if limit is None:
            return
        at_most = prompt.at_most
        counted = at_most if at_most is not None and at_most < limit else None
        check_context_length(request, prompt, limit, counted=counted)

    async def _serve(self, exchange: Exchange, plan: Plan) -> Answer:
        """Stage KV if the plan says so, then decode; replace a decoder that fails before its first byte.

        Each turn of the loop serves `plan` with `staged` (the KV staged for it, if any): a failed
        concurrent prefill turns the plan direct or to another prefiller, a decoder that cannot load
        the KV computes the prompt itself, and a failed decoder is replaced.
        """
        request, asked, done, shape = exchange.request, exchange.asked, exchange.done, self._shape
        output = exchange.output
        replacement = DecoderReplacement(exchange, self._metrics)
        prefillers_tried: list[Endpoint] = []
        staged: StagedKV | None = None
        decoding = False  # a decode call was made: the routing decision is counted
        try:
            while True:
                done.hold(plan.decoder)
                if staged is not None and not shape.serves(staged, plan.decoder):
                    # Pushed into another decoder's buffer (LMCache): released there, staged again here.
                    done.release_kv()
                    staged = None
                if plan.prefiller is not None and staged is None:
                    staged, plan = await self._stage(exchange, plan, prefillers_tried)
                done.serving(plan)
                output.decoder = plan.decoder.url
                output.decode_started = time.perf_counter()  # a failed attempt's time counts as the router's
                decoding = True
                if staged is None and request.stream:
                    self._await_first_token(exchange, plan)
                call = self._decode_call(request, staged)
                try:
                    return await shape.answer(exchange, plan, call, staged, replaceable=replacement.replaceable)
                except PrefillFailed as exc:  # a concurrent prefill failed before the decoder's first token
                    if staged is not None:
                        abandon(staged)  # still running when the decoder failed first (a failed hand-off)
                    staged = None
                    exchange.staging.overlaps_decode = False  # what follows starts after it
                    plan = self._prefill.after_failure(exchange, exc, plan, prefillers_tried)
                except DecodeFailed as exc:
                    if staged is not None and exc.in_band and shape.decodes_alone(staged):
                        abandon(staged)
                        staged = None
                        plan = self._after_kv_rejected(exchange, exc, plan)
                        continue
                    replacement.failed(plan.decoder, exc)
                    if staged is not None and (exc.kv_consumed or staged.pending is not None):
                        # Maybe used by the failed decoder (held KV it may not have read is released once the
                        # next is staged), or bound to its call: stage again.
                        abandon(staged)
                        staged = None
                    plan = replace(plan, decoder=await replacement.next(plan.decoder, exc))
        finally:
            if decoding:
                self._metrics.route_decision(asked.model, asked.arm, plan.path, plan.reason).inc()

    async def _stage(
        self, exchange: Exchange, plan: Plan, prefillers_tried: list[Endpoint]
    ) -> tuple[StagedKV | None, Plan]:
        """The prefill hop, its decoder held meanwhile (but not yet running anything on it)."""
        with plan.decoder.staging_for():
            staged, plan = await self._shape.stage(exchange, plan, prefillers_tried)
        self._note_staged(exchange, staged)
        return staged, plan

    @staticmethod
    def _await_first_token(exchange: Exchange, plan: Plan) -> None:
        """A streamed direct call's prompt counts in its decoder's queue until the first token (or the
        request's end): the prefill a new direct prompt there waits behind (adaptive mode reads it). An
        earlier decoder's count (it failed before its first token) is released as this one's is taken."""
        first = exchange.first_token
        if not first.reached:  # (a head the router sent itself is the client's first token)
            first.hold(plan.decoder.queue_prefill(plan.uncached_tokens))

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

    def _note_staged(self, exchange: Exchange, staged: StagedKV | None) -> None:
        done = exchange.done
        prompt = exchange.prompt
        if prompt.later is not None:
            ids = None if staged is None else staged.prompt_ids
            known = prompt.token_ids
            if ids is not None and ids[: len(known)] == list(known):
                prompt.later.supply(ids)  # counted and indexed by the prefiller's own encoding
            else:
                # No ids came back (a connector whose answer has none, the plan fell back), or ids that do not
                # start as the router's own encoding of the prompt does (another tokenizer or template): the
                # prefix index must hold what later heads will match.
                prompt.later.start()
        staging = exchange.staging
        staging.staged_tokens = None if staged is None else staged.prompt_tokens
        if staged is None:
            return
        if "remote_prefill_cached_tokens" in staged.params:
            staging.usage_shows_transfer = False  # the decoder will echo the prefiller's count
        if staged.pending is not None:
            done.defer(staged.pending.cancel)  # the request is over: a prefill still running is not needed
        held = self._shape.held(staged)
        if held is not None:
            done.hold_kv(held)
