"""The shapes of a request's two hops, one per kind of KV connector, over one decode-and-relay core (decode.py).

- `Sequential` (NIXL, shared storage): the decode call starts once the prefill hop staged the KV; a decoder that
  cannot load it computes the prompt itself.
- `Concurrent` (SGLang): the decode call starts with the prefill call, which only has to succeed before the
  decoder's first token (concurrent.py); its decoders serve nothing alone.
- `FirstTokenFromPrefill` (LMCache): sequential, the KV pushed into the chosen decoder (which alone can pick it
  up), and a stream's first token, the prefill's own, sent to the client at once (head_first.py).

A connector's flags say what its protocol does; they are read here, once, when the gateway is built
(`shape_of`), and the gateway asks its shape the questions they answer.
"""

from __future__ import annotations

import asyncio
import logging

from dpd_router.gateway.answer import Answer
from dpd_router.gateway.completion import HeldKV
from dpd_router.gateway.concurrent import unless_prefill_fails
from dpd_router.gateway.decode import DecodeHop
from dpd_router.gateway.errors import HANDOFF_FAILED
from dpd_router.gateway.exchange import Exchange
from dpd_router.gateway.head_first import HeadFirst
from dpd_router.gateway.prefill import PrefillHop
from dpd_router.pool.endpoint import Endpoint
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.errors import PrefillFailed
from dpd_router.routing.planner import Plan
from dpd_router.transfer.base import Connector, DecodeCall, Handoff, StagedKV

log = logging.getLogger("dpd_router.gateway")


class Sequential:
    """The decode call starts once the prefill hop staged the KV, on any decoder (it pulls the KV). With
    `holds_kv` (NIXL), staged KV waits on the prefiller until a decode call picks it up: the request holds
    it, and a prefill call whose client left is let finish, so that what it staged is released."""

    name = "sequential"
    # Whether a stream whose decoder fails after output may be continued on another decoder.
    resumable = True
    # Whether the prefill pushes the KV into the decoder the plan chose, rather than holding it for any to pull.
    pushes = False

    def __init__(
        self, connector: Connector, prefill: PrefillHop, decode: DecodeHop, metrics: RouterMetrics, *, holds_kv: bool
    ) -> None:
        self._connector = connector
        self._prefill = prefill
        self._decode = decode
        self._metrics = metrics
        self._holds_kv = holds_kv
        # Whether a decoder serves a prompt with no prefill hop (a short prompt, a failed prefill's fallback).
        self.serves_direct = connector.serves_direct

    async def stage(self, exchange: Exchange, plan: Plan, tried: list[Endpoint]) -> tuple[StagedKV | None, Plan]:
        """Stage the KV on `plan.prefiller`, or another; when none can, the plan the failure policy leaves."""
        held = self.held if self._holds_kv else None
        while plan.prefiller is not None:
            try:
                return await self._prefill.stage_on(self._handoff(exchange, plan), exchange, tried, held=held), plan
            except PrefillFailed as exc:
                plan = self._prefill.after_failure(exchange, exc, plan, tried)
        return None, plan

    def _handoff(self, exchange: Exchange, plan: Plan) -> Handoff:
        """The connector's ids for moving this prompt's KV from `plan.prefiller` to `plan.decoder`."""
        assert plan.prefiller is not None
        return self._connector.handoff(
            exchange.request, exchange.prompt, plan.prefiller, plan.decoder, exchange.request_id
        )

    async def answer(
        self, exchange: Exchange, plan: Plan, call: DecodeCall, staged: StagedKV | None, *, replaceable: bool
    ) -> Answer:
        """The decode call on `plan.decoder`, up to its first token (or its whole answer)."""
        return await self._decode.answer(exchange, plan.decoder, call, staged, replaceable=replaceable)

    def serves(self, staged: StagedKV, decoder: Endpoint) -> bool:
        """Whether `decoder` can pick up `staged`."""
        return True

    def decodes_alone(self, staged: StagedKV) -> bool:
        """Whether a decoder that could not load `staged` may compute the prompt itself instead."""
        return self.serves_direct

    def held(self, staged: StagedKV) -> HeldKV | None:
        """What the request holds of `staged` until a decode call picks it up (None: nothing)."""
        if not self._holds_kv or staged.handoff is None:
            return None
        return HeldKV(staged, self._connector, self._metrics, pushed=self.pushes)


class FirstTokenFromPrefill(Sequential):
    """Sequential, the KV pushed into the decoder the plan chose (only a decode call there picks it up, and it
    stays in that decoder's buffer until one does), and a stream's first token, which the prefill produced,
    sent to the client at once with the decoder's continuation after it. The decoder answers in another API
    than the client asked (the router rewrites it), so a failed stream is not continued elsewhere."""

    name = "first token from prefill"
    resumable = False
    pushes = True

    def __init__(
        self,
        connector: Connector,
        prefill: PrefillHop,
        decode: DecodeHop,
        head_first: HeadFirst,
        metrics: RouterMetrics,
    ) -> None:
        super().__init__(connector, prefill, decode, metrics, holds_kv=True)
        self._head_first = head_first

    async def answer(
        self, exchange: Exchange, plan: Plan, call: DecodeCall, staged: StagedKV | None, *, replaceable: bool
    ) -> Answer:
        if exchange.request.stream and call.head:
            return self._head_first.stream(exchange, plan, call, staged)
        return await super().answer(exchange, plan, call, staged, replaceable=replaceable)

    def serves(self, staged: StagedKV, decoder: Endpoint) -> bool:
        return staged.handoff is None or staged.handoff.decoder is decoder

    def decodes_alone(self, staged: StagedKV) -> bool:
        # Pushed KV a decoder could not load is in its buffer still: staged again, not computed there.
        return False


class Concurrent(Sequential):
    """The decode call starts with the prefill call (SGLang's bootstrap: the decoder waits on the prefiller
    for the KV); the prefill only has to succeed before the decoder's first token. Its decoders serve
    nothing alone: every request is disaggregated, and one no prefiller can take is refused."""

    name = "concurrent"

    def __init__(self, connector: Connector, prefill: PrefillHop, decode: DecodeHop, metrics: RouterMetrics) -> None:
        super().__init__(connector, prefill, decode, metrics, holds_kv=False)

    async def stage(self, exchange: Exchange, plan: Plan, tried: list[Endpoint]) -> tuple[StagedKV | None, Plan]:
        """The prefill call, started and left running: it comes back at once, pending."""
        if plan.prefiller is None:
            return None, plan
        handoff = self._handoff(exchange, plan)
        exchange.staging.overlaps_decode = True
        # No watch: the call lasts as long as its decoder takes to fetch the KV, however long prefills take.
        pending = asyncio.create_task(
            self._prefill.call(handoff, exchange, tried, watched=False), name=f"prefill {exchange.request_id}"
        )
        pending.add_done_callback(lambda task: _settled(task, exchange))
        return StagedKV(params={}, prompt_tokens=None, cached_tokens=0, pending=pending, handoff=handoff), plan

    async def answer(
        self, exchange: Exchange, plan: Plan, call: DecodeCall, staged: StagedKV | None, *, replaceable: bool
    ) -> Answer:
        """While the prefill still runs, its failing first cancels the decode call and raises its PrefillFailed,
        and a decode call failing while the prefill cannot be shown to have done its part is a failed hand-off,
        counted against the prefiller."""
        if staged is None or staged.pending is None:
            return await super().answer(exchange, plan, call, staged, replaceable=replaceable)
        # Its first token waits for the prefill running beside it: a slow one is that prefill's, and no learned
        # deadline judges the decoder for it.
        answer = self._decode.answer(exchange, plan.decoder, call, staged, replaceable=False)
        try:
            return await unless_prefill_fails(answer, staged.pending)
        except PrefillFailed as exc:
            if exc.reason == HANDOFF_FAILED and staged.handoff is not None:
                staged.handoff.prefiller.record_failure(str(exc))
            raise

    def decodes_alone(self, staged: StagedKV) -> bool:
        return False


HopShape = Sequential | FirstTokenFromPrefill | Concurrent


def shape_of(
    connector: Connector, prefill: PrefillHop, decode: DecodeHop, head_first: HeadFirst, metrics: RouterMetrics
) -> HopShape:
    """The hops' shape for `connector`, from what its protocol does."""
    if connector.concurrent:
        return Concurrent(connector, prefill, decode, metrics)
    if connector.pushes_to_decoder:
        return FirstTokenFromPrefill(connector, prefill, decode, head_first, metrics)
    return Sequential(connector, prefill, decode, metrics, holds_kv=connector.holds_kv)


def _settled(task: asyncio.Task[StagedKV], exchange: Exchange) -> None:
    """A concurrent prefill ended: keep its token counts; a failure after the first token is only logged."""
    if task.cancelled():
        return
    failure = task.exception()
    if failure is None:
        exchange.staging.staged_tokens = task.result().prompt_tokens
    elif exchange.first_token.reached:
        log.warning("request %s: the prefill call failed after the decoder answered: %s", exchange.request_id, failure)
