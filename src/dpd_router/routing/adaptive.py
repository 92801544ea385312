"""Adaptive, interference-aware disaggregation: the threshold that tunes itself.

Serving a prompt direct costs *every other stream on that decoder* a stall as long as the prompt's
prefill; disaggregating it costs *this* request the prefill hop (the prefiller's queue, its
prefill, the KV hand-off) instead of the direct prefill. So, for each request:

    stall      = direct_prefill(uncached) * streams running on the decoder
    extra_cost = prefill_hop(uncached) * (1 + prefiller queue) + handoff(uncached) - direct_prefill(uncached)
    disaggregate  when  interference_weight * stall > extra_cost

Each cost is a line (fixed overhead + seconds per token) learned online from what the router
measures: direct-path time to first token per decoder, prefill-call time per prefiller, and the
disaggregated path's decode-to-first-token time. The fits decay, so old observations fade, and
start from priors derived from `routing_threshold`, so an unlearned router behaves like the static
rule. Guard rails: `min_threshold` / `max_threshold` bound the decision in tokens, and a small
exploration share keeps measuring both paths near the boundary.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from dpd_router.observe import RequestTrace

# Endpoints whose fits are kept (a pool larger than this forgets the least recently used).
MAX_TRACKED_ENDPOINTS = 1024
# A direct request teaches the decoder's prefill speed only if at most this many streams ran beside it.
QUIET_DECODER_STREAMS = 2


@dataclass
class LinearCost:
    """seconds = overhead + per_token * tokens, fitted by exponentially decayed least squares.

    `half_life` is in observations: an observation that old weighs half as much as a new one.
    Memory is constant. Starts from a prior worth `prior_weight` observations.
    """

    overhead: float
    per_token: float
    half_life: float = 200.0
    prior_weight: float = 4.0
    # Observations also fade with time, so a fit follows the engine after the load changes.
    half_life_seconds: float = 60.0
    clock: Callable[[], float] = time.monotonic
    observations: int = 0
    _last: float | None = field(init=False, default=None)
    _w: float = field(init=False, default=0.0)
    _x: float = field(init=False, default=0.0)
    _y: float = field(init=False, default=0.0)
    _xx: float = field(init=False, default=0.0)
    _xy: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        # The prior: points on the prior line at two token counts, so slope and intercept are both set.
        for tokens in (0.0, 4096.0):
            self._add(tokens, self.overhead + self.per_token * tokens, self.prior_weight / 2)

    def _add(self, x: float, y: float, weight: float) -> None:
        self._w += weight
        self._x += weight * x
        self._y += weight * y
        self._xx += weight * x * x
        self._xy += weight * x * y

    def observe(self, tokens: float, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0 and tokens >= 0):
            return
        now = self.clock()
        elapsed = 0.0 if self._last is None else max(now - self._last, 0.0)
        self._last = now
        decay = 0.5 ** (1.0 / self.half_life + elapsed / self.half_life_seconds)
        self._w *= decay
        self._x *= decay
        self._y *= decay
        self._xx *= decay
        self._xy *= decay
        self._add(tokens, seconds, 1.0)
        self.observations += 1
        self._refit()

    def _refit(self) -> None:
        denominator = self._w * self._xx - self._x * self._x
        if self._w <= 0 or abs(denominator) < 1e-12:
            return
        slope = (self._w * self._xy - self._x * self._y) / denominator
        slope = max(slope, 0.0)  # more tokens never cost less time
        self.per_token = slope
        self.overhead = max((self._y - slope * self._x) / self._w, 0.0)

    def predict(self, tokens: float) -> float:
        return self.overhead + self.per_token * tokens


@dataclass(frozen=True)
class AdaptivePolicy:
    """The knobs of the adaptive decision (settings of the same names)."""

    interference_weight: float = 1.0
    min_threshold: int = 256
    max_threshold: int = 32768
    explore_share: float = 0.03
    ttft_slo: float | None = None
    # Priors, before anything is learned (see AdaptiveModel._prior_hop): the static threshold holds
    # at a load of one running stream.
    prior_prefill_per_token: float = 0.0001
    prior_overhead: float = 0.005


@dataclass(frozen=True)
class Estimate:
    """The numbers behind one adaptive decision, for logs, metrics and /admin/routing."""

    uncached_tokens: int
    running_streams: float
    direct_prefill: float
    stall: float
    hop: float
    extra_cost: float
    disaggregate: bool
    reason: str


class AdaptiveModel:
    """Learns the costs and makes the interference-aware decision."""

    def __init__(
        self,
        policy: AdaptivePolicy,
        routing_threshold: int,
        *,
        rng: Callable[[], float] | None = None,
    ) -> None:
        self.policy = policy
        self.routing_threshold = routing_threshold
        self._rng = rng or random.Random(0x5EED).random
        self._direct: OrderedDict[str, LinearCost] = OrderedDict()
        self._hop: OrderedDict[str, LinearCost] = OrderedDict()
        self.handoff = self._prior_handoff()

    # -- priors -------------------------------------------------------------------------------
    def _prior_direct(self) -> LinearCost:
        return LinearCost(self.policy.prior_overhead, self.policy.prior_prefill_per_token)

    def _prior_hop(self) -> LinearCost:
        # Prefillers as fast per token as decoders, plus a fixed cost of routing_threshold tokens' worth:
        # then, with one running stream, the decision flips exactly at routing_threshold, and with n
        # streams at about routing_threshold / n; an idle decoder keeps everything.
        per_token = self.policy.prior_prefill_per_token
        return LinearCost(self.policy.prior_overhead + self.routing_threshold * per_token, per_token)

    def _prior_handoff(self) -> LinearCost:
        return LinearCost(self.policy.prior_overhead, 0.0)

    def _fit(self, table: OrderedDict[str, LinearCost], key: str, prior: Callable[[], LinearCost]) -> LinearCost:
        fit = table.get(key)
        if fit is None:
            fit = table[key] = prior()
            if len(table) > MAX_TRACKED_ENDPOINTS:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        return fit

    def direct_cost(self, decoder: str) -> LinearCost:
        return self._fit(self._direct, decoder, self._prior_direct)

    def hop_cost(self, prefiller: str) -> LinearCost:
        return self._fit(self._hop, prefiller, self._prior_hop)

    def reprior(self, routing_threshold: int) -> None:
        """A new routing_threshold: prefillers not yet seen start from priors built on it."""
        self.routing_threshold = routing_threshold

    # -- learning -----------------------------------------------------------------------------
    def learn_direct(self, decoder: str, uncached_tokens: int, seconds: float) -> None:
        """A direct request's decode call: from its start to the first token (queue + prefill)."""
        self.direct_cost(decoder).observe(uncached_tokens, seconds)

    def learn_prefill(self, prefiller: str, uncached_tokens: int, seconds: float) -> None:
        """A prefill hop's whole call time."""
        self.hop_cost(prefiller).observe(uncached_tokens, seconds)

    def learn_handoff(self, tokens: int, seconds: float) -> None:
        """A disaggregated request's decode call: from its start to the first token (KV transfer)."""
        self.handoff.observe(tokens, seconds)

    def learn_from(self, trace: RequestTrace) -> None:
        """Learn from a finished streamed request (a whole answer says nothing about its first token)."""
        if trace.outcome != "ok" or not trace.stream or trace.uncached_tokens is None:
            return
        tokens = trace.uncached_tokens
        if trace.path == "disaggregated" and trace.prefiller and trace.prefill_seconds is not None:
            self.learn_prefill(trace.prefiller, tokens, trace.prefill_seconds)
        if trace.decode_started is None or trace.first_token_at is None or not trace.decoder:
            return
        first_token = trace.first_token_at - trace.decode_started
        if trace.path == "disaggregated":
            self.learn_handoff(tokens, first_token)
        elif trace.prefill_seconds is None and trace.decoder_streams <= QUIET_DECODER_STREAMS:
            # Only a quiet decoder's first token measures its prefill speed: on a busy one it also
            # counts the wait behind other work, which the stall estimate multiplies in already.
            self.learn_direct(trace.decoder, tokens, first_token)

    # -- deciding -----------------------------------------------------------------------------
    def estimate(
        self, decoder: str, prefiller: str, uncached_tokens: int, running_streams: float, prefiller_queue: float
    ) -> Estimate:
        """`prefiller_queue` is the prompt tokens already queued on the prefiller (their prefill comes first)."""
        direct = self.direct_cost(decoder).predict(uncached_tokens)
        hop_fit = self.hop_cost(prefiller)
        hop = hop_fit.predict(uncached_tokens) + hop_fit.per_token * max(prefiller_queue, 0.0)
        hop += self.handoff.predict(uncached_tokens)
        stall = direct * max(running_streams, 0.0)
        extra = hop - direct
        policy = self.policy
        if uncached_tokens < policy.min_threshold:
            return Estimate(uncached_tokens, running_streams, direct, stall, hop, extra, False, "below_min_threshold")
        if uncached_tokens >= policy.max_threshold:
            return Estimate(uncached_tokens, running_streams, direct, stall, hop, extra, True, "above_max_threshold")
        if policy.ttft_slo is not None:
            direct_late, hop_late = direct > policy.ttft_slo, hop > policy.ttft_slo
            if direct_late != hop_late:
                return Estimate(uncached_tokens, running_streams, direct, stall, hop, extra, direct_late, "ttft_slo")
        disaggregate = policy.interference_weight * stall > extra
        reason = "adaptive_interference" if disaggregate else "adaptive_cheaper_direct"
        if self._explores(stall * policy.interference_weight, extra):
            return Estimate(uncached_tokens, running_streams, direct, stall, hop, extra, not disaggregate, "explore")
        return Estimate(uncached_tokens, running_streams, direct, stall, hop, extra, disaggregate, reason)

    def _explores(self, weighted_stall: float, extra: float) -> bool:
        """Flip a small share of decisions, only near the boundary (the two costs within a factor of 2)."""
        share = self.policy.explore_share
        if share <= 0:
            return False
        low, high = sorted((max(weighted_stall, 1e-9), max(extra, 1e-9)))
        return high <= 2 * low and self._rng() < share

    def effective_threshold(
        self, decoder: str, prefiller: str, running_streams: float, prefiller_queue: float
    ) -> float:
        """The prompt length (uncached tokens) at which the decision flips, at this load; inf if never."""
        d = self.direct_cost(decoder)
        p = self.hop_cost(prefiller)
        queued = p.per_token * max(prefiller_queue, 0.0)
        w = self.policy.interference_weight * max(running_streams, 0.0)
        # w * (d0 + d1 x) > p0 + p1 x + queued + h0 + h1 x - (d0 + d1 x)
        slope = (w + 1) * d.per_token - p.per_token - self.handoff.per_token
        intercept = p.overhead + queued + self.handoff.overhead - (w + 1) * d.overhead
        if slope <= 0:
            return math.inf if intercept >= 0 else float(self.policy.min_threshold)
        crossing = max(intercept / slope, 0.0)
        return float(min(max(crossing, self.policy.min_threshold), self.policy.max_threshold))

    def cost_rows(self) -> list[tuple[str, str, str, float]]:
        """(model, endpoint, term, value) for every learned cost, for metrics."""
        rows: list[tuple[str, str, str, float]] = []
        tables = [("handoff", {"": self.handoff}), ("direct_prefill", self._direct), ("prefill_hop", self._hop)]
        for model, table in tables:
            for endpoint, fit in list(table.items()):
                rows += [(model, endpoint, term, value) for term, value in _coefficients(fit).items()]
        return rows

    def describe(self) -> dict[str, object]:
        return {
            "handoff": _coefficients(self.handoff),
            "direct_prefill": {url: _coefficients(fit) for url, fit in self._direct.items()},
            "prefill_hop": {url: _coefficients(fit) for url, fit in self._hop.items()},
        }


def _coefficients(fit: LinearCost) -> dict[str, float]:
    return {
        "overhead_seconds": fit.overhead,
        "seconds_per_token": fit.per_token,
        "observations": float(fit.observations),
    }
