"""The prefill hop: one prefiller after another until KV is staged, then the prefill failure policy.

Each call is bounded by a deadline learned from what prefills of its size have been taking (where
an abandoned hop has somewhere to go), else by `prefill_timeout`. A connector that holds staged KV
until a decode call takes it (NIXL) has a call whose client left finish, so that its KV is released.
How the hop runs beside the decode call is the connector's hop shape (shapes.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from dpd_router.gateway.completion import HeldKV
from dpd_router.gateway.errors import ANSWERED_PREFILL_FAILURES
from dpd_router.gateway.exchange import Exchange
from dpd_router.gateway.watch import Bound, EngineProbe, HopWatch, watch_hop
from dpd_router.pool.endpoint import Endpoint
from dpd_router.record.metrics import RouterMetrics, model_label
from dpd_router.request.errors import PrefillFailed, PrefillUnavailable
from dpd_router.request.frozen import evolve
from dpd_router.routing.planner import PREFILL_FAILED, Plan
from dpd_router.startup.tasks import cancel_and_wait
from dpd_router.transfer.base import Connector, Handoff, StagedKV

log = logging.getLogger("dpd_router.gateway")

# Seconds a prefill call whose client left may still take to answer. An engine that finished it
# holds the KV for a decoder, and only the answer names it (it is then released); an engine still
# computing answers later, and cutting the call makes vLLM abort it, which frees its blocks at once.
# Cutting a call whose answer is already on its way strands its blocks for the whole lease, and on a
# loaded machine an answer can take more than a second to arrive: the grace errs long.
ORPHANED_PREFILL_GRACE = 10.0

# What a request holds of the KV a prefill staged until a decode call picks it up (None: nothing).
Held = Callable[[StagedKV], HeldKV | None]


class PrefillHop:
    """Stages a request's KV on a prefiller, retried on others; built once, shared by all requests."""

    def __init__(self, connector: Connector, metrics: RouterMetrics, probe: EngineProbe) -> None:
        self._connector = connector
        # Whether the decoders may serve a request alone when the prefill pool cannot (SGLang's cannot).
        self._serves_direct = connector.serves_direct
        self._metrics = metrics
        self._probe = probe
        # Prefill calls whose client left, given a moment to answer so that what they staged is released.
        self._orphaned: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Stop prefill calls whose clients left (before the connector that would release their KV closes)."""
        await cancel_and_wait(self._orphaned)

    async def stage_on(
        self, handoff: Handoff, exchange: Exchange, tried: list[Endpoint], *, held: Held | None
    ) -> StagedKV:
        """Stage the KV on `handoff.prefiller` (raises PrefillFailed). `held`: what the request would hold of
        the staged KV (a connector that holds it until a decode call picks it up); a call whose client left
        then finishes, and what it staged is released."""
        hop = self.call(handoff, exchange, tried, watched=True)
        staged = await (hop if held is None else self._finished_even_if_left(hop, handoff, held))
        return evolve(staged, handoff=handoff)

    def after_failure(self, exchange: Exchange, failure: PrefillFailed, plan: Plan, tried: list[Endpoint]) -> Plan:
        """The plan after `plan.prefiller` failed: another prefiller, or the policy (fallback or 503)."""
        prefiller = plan.prefiller
        assert prefiller is not None
        tried.append(prefiller)
        exchange.staging.error = str(failure)
        log.warning("request %s: prefill on %s failed: %s", exchange.request_id, prefiller.url, failure)
        retries = exchange.retries
        # A 4xx is the request's own fault: another prefiller would say the same.
        if failure.reason != "status_4xx" and len(tried) <= retries.prefill_retries:
            alternative = exchange.planner.alternative("prefill", exchange.prompt, exclude=tried)
            if alternative is not None:
                self._metrics.retries.labels("prefill").inc()
                return replace(plan, prefiller=alternative)
        if retries.prefill_failure_policy == "fail" or not self._serves_direct:
            raise PrefillUnavailable(f"The prefill pool could not serve this request ({failure.reason}).")
        self._metrics.prefill_fallbacks.labels(model_label(exchange.asked.model), failure.reason).inc()
        return plan.direct(PREFILL_FAILED)

    async def _finished_even_if_left(
        self, hop: Coroutine[Any, Any, StagedKV], handoff: Handoff, held: Held
    ) -> StagedKV:
        """The prefill call; when its client leaves, the call gets `ORPHANED_PREFILL_GRACE` seconds to
        answer before it is cut (see there), and what it staged is released."""
        task = asyncio.create_task(hop, name=f"prefill {handoff.request_id}")
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            orphan = asyncio.create_task(
                self._release_orphaned(task, handoff, held), name=f"orphan {handoff.request_id}"
            )
            self._orphaned.add(orphan)
            orphan.add_done_callback(self._orphaned.discard)
            raise

    async def _release_orphaned(self, task: asyncio.Task[StagedKV], handoff: Handoff, held: Held) -> None:
        await asyncio.wait({task}, timeout=ORPHANED_PREFILL_GRACE)
        if not task.done():
            self._metrics.orphaned_prefills.labels("cut").inc()
            task.cancel()
            await asyncio.wait({task})
            return
        if task.cancelled() or task.exception() is not None:
            self._metrics.orphaned_prefills.labels("failed").inc()
            reason = "cancelled" if task.cancelled() else repr(task.exception())
            log.warning("request %s: its client left and its prefill failed: %s", handoff.request_id, reason)
            return
        self._metrics.orphaned_prefills.labels("released").inc()
        kv = held(replace(task.result(), handoff=handoff))
        if kv is not None:
            kv.release()

    def _watch(
        self, exchange: Exchange, prefiller: Endpoint, tried: list[Endpoint], queued_ahead: int
    ) -> HopWatch | None:
        """The watch of this request's prefill call (None: prefill_timeout alone applies).

        At the learned deadline, only where an abandoned hop has somewhere to go (the decoder alone,
        or another prefiller not tried yet): else a prefiller merely slower than usual would fail
        requests it would have served. A hop is judged as if the prefiller cached none of the prompt,
        behind the prompt tokens this router has queued there already, so a cold prompt or a burst
        is not taken for a hang. Before there is history (or with nowhere to go), a prior from the
        same size says when to look, and only a hung prefiller cuts the call short.
        """
        retries, timeouts = exchange.retries, exchange.timeouts
        size = queued_ahead + exchange.prompt.num_tokens  # the worst case: the prefiller caches nothing
        falls_back = retries.prefill_failure_policy == "fallback" and self._serves_direct
        learned = None
        if falls_back or (len(tried) < retries.prefill_retries and self._untried(exchange, prefiller, tried)):
            learned = exchange.deadlines.deadline_later("prefill", (size,), timeouts.learned, timeouts.prefill)
        model = exchange.request.body.get("model")
        return watch_hop(
            prefiller,
            tokens=size,
            learned=learned,
            cap=timeouts.prefill,
            floor=timeouts.learned.floor,
            probe=self._probe,
            model=model if isinstance(model, str) else None,
            probe_timeout=timeouts.hang_probe,
        )

    @staticmethod
    def _untried(exchange: Exchange, prefiller: Endpoint, tried: list[Endpoint]) -> bool:
        """Whether a healthy prefiller other than `prefiller` is not tried yet."""
        return any(other is not prefiller and other not in tried for other in exchange.planner.pool.healthy("prefill"))

    async def call(self, handoff: Handoff, exchange: Exchange, tried: list[Endpoint], *, watched: bool) -> StagedKV:
        """One prefill call. One past its learned deadline, far longer than prefills of its size have
        been taking, is abandoned as "slow"; the caller retries it elsewhere or falls back, so a
        request waits at most (1 + prefill_retries) learned deadlines for hung prefillers. Not `watched`:
        prefill_timeout alone bounds it (a concurrent call lasts as long as its decoder takes to fetch the
        KV, however long other prefills took)."""
        staging, judge = exchange.staging, exchange.prefill_judge
        prefiller = handoff.prefiller
        staging.prefiller = prefiller.url
        started = staging.started = time.perf_counter()
        tokens = exchange.uncached_tokens
        queued_ahead = prefiller.queued_tokens
        watch = self._watch(exchange, prefiller, tried, queued_ahead) if watched else None
        limit = exchange.timeouts.prefill
        outcome = "ok"
        # A call open on the prefiller, and its prompt tokens in the prefiller's queue, while it runs.
        with prefiller.calling(), prefiller.queue_prefill(tokens):
            try:
                async with Bound(watch, asyncio.get_running_loop().time() + limit):
                    staged = await self._connector.stage(handoff)
                prefiller.progressed(asyncio.get_running_loop().time())
                judge.succeeded(prefiller)
                # Learned by what the prefiller computed: a prefix-cache hit's speed would make cold prompts look hung.
                computed = (staged.prompt_tokens or exchange.prompt.num_tokens) - staged.cached_tokens
                exchange.deadlines.learn("prefill", (queued_ahead + max(computed, 1),), time.perf_counter() - started)
                return staged
            except TimeoutError:
                verdict = None if watch is None else watch.verdict
                if watch is None or verdict is None:
                    # No answer within the fixed timeout is the engine's failure whatever the request.
                    outcome = "timeout"
                    prefiller.record_failure("prefill timed out")
                    raise PrefillFailed("timeout", f"{prefiller.url}: no answer in {limit:g} s") from None
                if verdict == "hung":
                    outcome = "hung"
                    waited = time.perf_counter() - started
                    detail = (
                        f"{prefiller.url} is hung: nothing from it for {waited:.3g} s"
                        " and no answer to a one-token probe"
                    )
                    prefiller.record_hang(detail)
                    raise PrefillFailed("hung", detail) from None
                # Far slower than the worst case of its size, queue included, and the prefiller idle
                # meanwhile: taken for a hang, which must open the breaker of an engine that hangs while it
                # passes its health probes.
                outcome = "slow"
                prefiller.record_failure("prefill far slower than learned")
                detail = f"{prefiller.url}: no answer within its learned deadline of {watch.expected:.3g} s"
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
                if watch is not None:
                    watch.stop()
                seconds = staging.seconds = time.perf_counter() - started
                self._metrics.prefill.labels(model_label(exchange.asked.model), outcome).observe(seconds)
