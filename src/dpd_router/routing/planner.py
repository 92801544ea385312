"""The routing decision: direct to a decoder, or prefiller first, and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dpd_router.errors import NoHealthyDecoder
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.routing.strategies import Strategy
from dpd_router.tokenizer import Prompt

RoutePath = Literal["direct", "disaggregated"]

# Why a request took its path; these are the `reason` label values on route_decisions_total.
BELOW_THRESHOLD = "below_threshold"
LONG_PROMPT = "long_prompt"
PREFILL_POOL_DOWN = "prefill_pool_down"
BATCHED_PROMPT = "batched_prompt"
PREFILL_FAILED = "prefill_failed"


@dataclass(frozen=True)
class Plan:
    """A decision, as data: the path, the engines, and the reason (for metrics and logs)."""

    path: RoutePath
    reason: str
    decoder: Endpoint
    prefiller: Endpoint | None = None


class Planner:
    """Applies the token threshold and the selection strategies to the pool's current state.

    Pure decision-making over in-memory state: it does no I/O, so it is cheap on the request path.
    """

    def __init__(self, pool: Pool, *, threshold: int, prefill: Strategy, decode: Strategy) -> None:
        self.pool = pool
        self.threshold = threshold
        self.prefill_strategy = prefill
        self.decode_strategy = decode

    def plan(self, prompt: Prompt, *, batch_size: int = 1) -> Plan:
        decoder = self.choose_decoder(prompt)
        if prompt.num_tokens < self.threshold:
            return Plan("direct", BELOW_THRESHOLD, decoder)
        if batch_size > 1:
            # An engine answers a batched prompt with one kv_transfer_params: it cannot hand over several.
            return Plan("direct", BATCHED_PROMPT, decoder)
        prefillers = self.pool.healthy("prefill")
        if not prefillers:
            return Plan("direct", PREFILL_POOL_DOWN, decoder)
        prefiller = self.prefill_strategy.select(prefillers, prompt)
        return Plan("disaggregated", LONG_PROMPT, decoder, prefiller)

    def choose_decoder(self, prompt: Prompt) -> Endpoint:
        decoders = self.pool.healthy("decode")
        if not decoders:
            raise NoHealthyDecoder("No decoder is available to serve this request; try again shortly.")
        return self.decode_strategy.select(decoders, prompt)
