"""Adaptive, interference-aware disaggregation: the threshold that tunes itself.

Serving a prompt direct costs *every other stream on that decoder* a stall as long as the prompt's
prefill; disaggregating it costs *this* request the prefill hop (the wait behind the prefiller's
queue, its prefill, the KV hand-off) instead of the direct prefill. So, for each request:

    stall      = direct_prefill(uncached) * streams running on the decoder
    hop_ttft   = prefill_hop(queued + uncached) + handoff(uncached)
    direct_ttft = direct_wait + direct_prefill(decoder_queued + uncached)
    extra_cost = hop_ttft - direct_ttft
    disaggregate  when  interference_weight * stall > extra_cost

Each cost is a line (fixed overhead + seconds per token) learned online from what the router
measures, each against the work it measures:

- direct_prefill: a direct request's decode call until its first token, per decoder, only when
  the decoder had nothing else running or waiting (otherwise that time includes other prompts'
  prefills and decode steps, and would not be this prompt's prefill time);
- prefill_hop: a prefill call's whole time, per prefiller, against its own prompt tokens, from
  calls planned while the prefiller had nothing else from this router: that is its service time,
  and a queue ahead of a new call is costed at the same time per token. A call planned behind a
  queue also measures the queue's remaining work, which the router cannot tell (the call in
  service is partly done), so counting the queue whole makes the prefiller look faster per token
  than it is (58-72 us learned against the simulator's 83); a line fitted to every call, against
  the queue plus its own tokens, serves until IDLE_HOPS_TO_TRUST calls found the prefiller idle;
- handoff: a disaggregated request's decode call until its first token (the KV transfer);
- direct_wait: how much longer than direct_prefill the decoder's recent direct requests took to
  their first token, at whatever load, beyond the prefill of the prompts queued ahead of them (the
  wait behind decode steps and prompts the router cannot see), a fast-fading mean per decoder.

Both paths' first-token times count their queues as they are when the request is planned: the
prompt tokens the router has open on the prefiller, and those of its streamed direct requests on
the decoder still waiting for their first token. A burst of direct decisions then makes the next
direct prompt wait behind the burst's prefills, not behind a mean of what earlier ones waited.

The fits fade (per observation and per second) so they follow the engines, and start from priors
derived from `routing_threshold` that fade faster still: an unlearned router behaves like the
static rule, a learned one like what it measured, whatever threshold it started from. The hop's
prior is a stand-in for the static rule, not a time, so the SLOs judge the hop by a second line
learned from the same calls on a neutral prior, and until a prefiller has served LEARNED_HOPS calls
exploration near the boundary is wider: a router started at 32768 would otherwise never take the
hop that would teach it.
Guard rails: `min_threshold` / `max_threshold` bound the decision in tokens; known SLOs win when only
one path meets them: the TTFT SLO by each path's first-token time (for the direct path, only while
the stall it inflicts on the decoder's streams stays within the SLO), the ITL SLO by the pause the
prompt's own prefill would put in its decoder's running streams (prompts queued ahead of it pause them
whichever path it takes, and sending a short prompt into the prefill pool's queue for them would buy
nothing); and a small exploration share keeps measuring the hop near the boundary.

The ITL SLO is what tells a long prompt's stall from a short one's: the linear cost counts ten
streams stalled 0.1 s the same as one stalled 1 s, but a 0.1 s gap hides among a busy decoder's
ordinary ones while a 1 s gap is a visible freeze, the kind a stream's ITL p99 (and its reader) notices.

An ITL SLO is a percentile, not a maximum: with `itl_slo_share` the router may spend that share of a
decoder's inter-token gaps on pauses longer than the SLO. Each direct prefill longer than the SLO
spends one gap per stream it pauses; the gaps are counted from the decoder's finished streams; both
fade with time (GapBudget). A prompt that finds the decoder with few streams then goes direct on the
model's word (a 4k prompt pausing 3 streams spends 3 of, at c=32, hundreds of gaps a second), while
one that would pause a full decoder, or a decoder whose budget is spent, still takes the hop.

A TTFT SLO may hold only for prompts up to `ttft_slo_max_tokens` uncached tokens: interactive prompts
have one, long documents often none. A long prompt then weighs only the ITL SLO (when set), which
sends it to the hop whatever the prefill queue, while a deployment whose every prompt has the TTFT
SLO leaves the choice to the model once neither path meets both SLOs.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from dpd_router.record.outcome import Outcome

_T = TypeVar("_T")

# Endpoints whose fits are kept (a pool larger than this forgets the least recently used).
MAX_TRACKED_ENDPOINTS = 1024
# Prefill calls that must have found their prefiller idle before its line is learned from those alone.
IDLE_HOPS_TO_TRUST = 8
# A direct request teaches the decoder's prefill speed only if at most this many streams ran or waited
# on the decoder when it was planned: with any, its first token also waits for their prefills and
# decode steps, which is queueing, not this prompt's prefill.
QUIET_DECODER_STREAMS = 0
# The hop's prior is built on routing_threshold, a stand-in that reproduces the static rule rather than a
# measured time (a router started at 32768 prices the hop at 3.3 s), and it fades over a few prior
# half-lives of calls. So the SLOs never judge the hop by it: they read a second line per prefiller,
# learned from the same calls on the neutral prior (the decoders' prior speed per token and overhead,
# no threshold-made fixed cost). And until a prefiller has served LEARNED_HOPS calls, exploration near
# the boundary sends at least LEARNING_EXPLORE_SHARE of the prompts the model keeps direct to it.
# Otherwise a router started high could keep every prompt direct for good: the SLO would call the hop
# late on the prior's word and a few percent of exploration would take hundreds of requests to teach it.
LEARNED_HOPS = 8
LEARNING_EXPLORE_SHARE = 0.25


@dataclass
class LinearCost:
    """seconds = overhead + per_token * tokens, fitted by exponentially decayed least squares.

    `half_life` is in observations (an observation that many observations old weighs half as much
    as a new one) and `half_life_seconds` in time; fading never takes the observations' total
    weight below `prior_weight`, so after a quiet spell one odd observation cannot replace the line.
    The prior line is a warm-up default: it counts as `prior_weight` observations at first, halving
    every `prior_half_life` observations, so it steers an unlearned fit but not a learned one (even
    where the observations say little, as about the overhead when every call waited behind a queue).
    Memory is constant.
    """

    overhead: float
    per_token: float
    half_life: float = 200.0
    prior_weight: float = 4.0
    prior_half_life: float = 8.0
    # Observations also fade with time, so a fit follows the engine after its speed changes.
    half_life_seconds: float = 60.0
    clock: Callable[[], float] = time.monotonic
    observations: int = 0
    _last: float | None = field(init=False, default=None)
    # Sums (weight, x, y, xx, xy) of the decayed observations, and of the prior at full weight.
    _sums: list[float] = field(init=False, default_factory=lambda: [0.0] * 5)
    _prior: list[float] = field(init=False, default_factory=lambda: [0.0] * 5)

    def __post_init__(self) -> None:
        # The prior: points on the prior line at two token counts, so slope and intercept are both set.
        for tokens in (0.0, 4096.0):
            _add(self._prior, tokens, self.overhead + self.per_token * tokens, self.prior_weight / 2)

    def observe(self, tokens: float, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0 and math.isfinite(tokens) and tokens >= 0):
            return
        now = self.clock()
        elapsed = 0.0 if self._last is None else max(now - self._last, 0.0)
        self._last = now
        decay = 0.5 ** (1.0 / self.half_life + elapsed / self.half_life_seconds)
        weight = self._sums[0]
        if weight > 0:
            decay = max(decay, min(1.0, self.prior_weight / weight))
        self._sums = [value * decay for value in self._sums]
        _add(self._sums, tokens, seconds, 1.0)
        self.observations += 1
        self._refit()

    def _refit(self) -> None:
        prior = 0.5 ** (self.observations / self.prior_half_life)
        w, x, y, xx, xy = (a + prior * b for a, b in zip(self._sums, self._prior, strict=True))
        denominator = w * xx - x * x
        if w <= 0 or abs(denominator) < 1e-12:
            return
        slope = (w * xy - x * y) / denominator
        slope = max(slope, 0.0)  # more tokens never cost less time
        self.per_token = slope
        self.overhead = max((y - slope * x) / w, 0.0)

    def predict(self, tokens: float) -> float:
        return self.overhead + self.per_token * tokens


class HopCost:
    """A prefiller's line: from the calls that found it idle once IDLE_HOPS_TO_TRUST did (their time
    is its service time), until then from every call against the queue ahead of it plus its own
    tokens. The idle line starts from what the other had learned, as a prior halving with each idle
    call: at the first idle call that line may still be mostly the threshold's prior (a router
    started at 32768 believes in a 3.3 s hop), which a slowly fading prior would keep alive across
    the few idle calls of a busy prefiller."""

    def __init__(self, prior: LinearCost) -> None:
        self.any_call = prior
        self.idle: LinearCost | None = None

    def observe(self, queued_tokens: float, tokens: float, seconds: float) -> None:
        self.any_call.observe(max(queued_tokens, 0.0) + tokens, seconds)
        if queued_tokens <= 0:
            if self.idle is None:
                line = self.any_call
                self.idle = LinearCost(line.overhead, line.per_token, prior_half_life=1.0, clock=line.clock)
            self.idle.observe(tokens, seconds)

    @property
    def line(self) -> LinearCost:
        idle = self.idle
        return idle if idle is not None and idle.observations >= IDLE_HOPS_TO_TRUST else self.any_call

    @property
    def overhead(self) -> float:
        return self.line.overhead

    @property
    def per_token(self) -> float:
        return self.line.per_token

    @property
    def observations(self) -> int:
        return self.any_call.observations

    @property
    def idle_observations(self) -> int:
        return 0 if self.idle is None else self.idle.observations

    def predict(self, tokens: float) -> float:
        return self.line.predict(tokens)


@dataclass
class GapBudget:
    """A decoder's recent inter-token gaps and the pauses longer than the ITL SLO the router chose to put
    in them, both fading with time (`half_life_seconds`), so their ratio is the share of late gaps it
    caused lately. Gaps are counted when their stream finishes, pauses when the prefill is decided."""

    half_life_seconds: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _gaps: float = field(init=False, default=0.0)
    _spent: float = field(init=False, default=0.0)
    _last: float | None = field(init=False, default=None)

    def _fade(self) -> None:
        now = self.clock()
        if self._last is not None:
            decay = 0.5 ** (max(now - self._last, 0.0) / self.half_life_seconds)
            self._gaps *= decay
            self._spent *= decay
        self._last = now

    def count_gaps(self, gaps: int) -> None:
        self._fade()
        self._gaps += max(gaps, 0)

    def allows(self, pauses: float, share: float) -> bool:
        """Whether `pauses` more late gaps keep the late share within `share` of the recent gaps."""
        self._fade()
        return share > 0 and self._spent + pauses <= share * self._gaps

    def spend(self, pauses: float) -> None:
        self._fade()
        self._spent += max(pauses, 0.0)

    @property
    def gaps(self) -> float:
        """The decoder's recent inter-token gaps, faded to now."""
        self._fade()
        return self._gaps

    @property
    def spent(self) -> float:
        """The late gaps the router's direct prefills put in them, faded to now."""
        self._fade()
        return self._spent

    @property
    def share(self) -> float:
        self._fade()
        return self._spent / self._gaps if self._gaps > 0 else 0.0


@dataclass
class DecayedMean:
    """The mean of recent observations, fading per observation and with time (no prior: starts at 0)."""

    half_life: float = 16.0
    half_life_seconds: float = 10.0
    clock: Callable[[], float] = time.monotonic
    observations: int = 0
    mean: float = 0.0
    _weight: float = field(init=False, default=0.0)
    _last: float | None = field(init=False, default=None)

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        now = self.clock()
        elapsed = 0.0 if self._last is None else max(now - self._last, 0.0)
        self._last = now
        self._weight = self._weight * 0.5 ** (1.0 / self.half_life + elapsed / self.half_life_seconds) + 1.0
        self.mean += (value - self.mean) / self._weight
        self.observations += 1


def _add(sums: list[float], x: float, y: float, weight: float) -> None:
    sums[0] += weight
    sums[1] += weight * x
    sums[2] += weight * y
    sums[3] += weight * x * x
    sums[4] += weight * x * y


@dataclass(frozen=True)
class AdaptivePolicy:
    """The knobs of the adaptive decision (settings of the same names)."""

    interference_weight: float = 1.0
    min_threshold: int = 256
    max_threshold: int = 32768
    explore_share: float = 0.03
    ttft_slo: float | None = None
    # ttft_slo holds for prompts of at most this many uncached tokens (0: every prompt).
    ttft_slo_max_tokens: int = 0
    itl_slo: float | None = None
    # The share of a decoder's inter-token gaps the router may spend on pauses longer than itl_slo (0: none).
    itl_slo_share: float = 0.0
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
        self._wait: OrderedDict[str, DecayedMean] = OrderedDict()
        self._hop: OrderedDict[str, HopCost] = OrderedDict()
        self._slo_hop: OrderedDict[str, HopCost] = OrderedDict()
        self._gaps: OrderedDict[str, GapBudget] = OrderedDict()
        self.handoff = self._prior_handoff()

    # -- priors -------------------------------------------------------------------------------
    def _prior_direct(self) -> LinearCost:
        return LinearCost(self.policy.prior_overhead, self.policy.prior_prefill_per_token)

    def _prior_hop(self) -> HopCost:
        # Prefillers as fast per token as decoders, plus a fixed cost of routing_threshold tokens' worth:
        # then, with one running stream, the decision flips exactly at routing_threshold, and with n
        # streams at about routing_threshold / n; an idle decoder keeps everything.
        per_token = self.policy.prior_prefill_per_token
        return HopCost(LinearCost(self.policy.prior_overhead + self.routing_threshold * per_token, per_token))

    def _neutral_hop(self) -> HopCost:
        # What the SLOs judge the hop by: the same calls learned on a prior that is not the static rule's,
        # a prefiller as fast as the decoders' prior.
        return HopCost(self._prior_direct())

    def _prior_handoff(self) -> LinearCost:
        return LinearCost(self.policy.prior_overhead, 0.0)

    def _fit(self, table: OrderedDict[str, _T], key: str, prior: Callable[[], _T]) -> _T:
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

    def direct_wait(self, decoder: str) -> DecayedMean:
        return self._fit(self._wait, decoder, DecayedMean)

    def hop_cost(self, prefiller: str) -> HopCost:
        return self._fit(self._hop, prefiller, self._prior_hop)

    def slo_hop_cost(self, prefiller: str) -> HopCost:
        """The prefiller's hop line on the neutral prior, which the SLOs judge the hop by."""
        return self._fit(self._slo_hop, prefiller, self._neutral_hop)

    def gap_budget(self, decoder: str) -> GapBudget:
        return self._fit(self._gaps, decoder, GapBudget)

    def reprior(self, routing_threshold: int) -> None:
        """A new routing_threshold: prefillers not yet seen start from priors built on it."""
        self.routing_threshold = routing_threshold

    # -- learning -----------------------------------------------------------------------------
    def learn_direct(self, decoder: str, uncached_tokens: int, seconds: float) -> None:
        """A direct request's decode call on a quiet decoder: from its start to the first token."""
        self.direct_cost(decoder).observe(uncached_tokens, seconds)

    def learn_prefill(self, prefiller: str, uncached_tokens: int, seconds: float, queued_tokens: float = 0.0) -> None:
        """A prefill hop's whole call time, with the prompt tokens queued ahead of it when it was planned."""
        self.hop_cost(prefiller).observe(queued_tokens, uncached_tokens, seconds)
        self.slo_hop_cost(prefiller).observe(queued_tokens, uncached_tokens, seconds)

    def learn_handoff(self, tokens: int, seconds: float) -> None:
        """A disaggregated request's decode call: from its start to the first token (KV transfer)."""
        self.handoff.observe(tokens, seconds)

    def learn_from(self, outcome: Outcome) -> None:
        """Learn from a finished request: its prefill call streamed or not, its first token only when
        streamed (a whole answer says nothing about its first token)."""
        if outcome.stream and outcome.decoder and outcome.token_gaps > 0:
            self.gap_budget(outcome.decoder).count_gaps(outcome.token_gaps)
        if not outcome.ok or outcome.uncached_tokens is None:
            return
        tokens = outcome.uncached_tokens
        if (
            outcome.path == "disaggregated"
            and outcome.prefiller
            and outcome.prefill_seconds is not None
            and not outcome.prefill_retried  # a retried hop's time and queue belong to two prefillers
            and outcome.prefiller_queue is not None
        ):
            self.learn_prefill(outcome.prefiller, tokens, outcome.prefill_seconds, outcome.prefiller_queue)
        first_token = outcome.first_token_seconds
        if not outcome.stream or first_token is None or not outcome.decoder:
            return
        if outcome.path == "disaggregated":
            if not outcome.prefill_overlaps_decode:  # a concurrent hop's decode call also waited for the prefill
                self.learn_handoff(tokens, first_token)
        elif outcome.prefill_seconds is None:
            if outcome.decoder_streams <= QUIET_DECODER_STREAMS:
                # Only a quiet decoder's first token measures its prefill speed: on a busy one it also
                # counts the wait behind other prompts' prefills and the running streams' decode steps.
                self.learn_direct(outcome.decoder, tokens, first_token)
            line = self.direct_cost(outcome.decoder)
            prefill = line.predict(tokens) + line.per_token * max(outcome.decoder_queue, 0.0)
            self.direct_wait(outcome.decoder).observe(max(first_token - prefill, 0.0))

    # -- deciding -----------------------------------------------------------------------------
    def estimate(
        self,
        decoder: str,
        prefiller: str,
        uncached_tokens: int,
        running_streams: float,
        prefiller_queue: float,
        decoder_queue: float = 0.0,
    ) -> Estimate:
        """`running_streams`: what a direct prefill would stall; `prefiller_queue` / `decoder_queue`: the
        prompt tokens already queued on the prefiller / the decoder (their prefill comes first, at that
        engine's speed per token). A direct decision whose prefill pauses the streams longer than
        itl_slo spends that many gaps of the decoder's ITL budget."""
        direct = self.direct_cost(decoder).predict(uncached_tokens)
        direct_ttft = self._wait_before_prefill(decoder, decoder_queue) + direct
        hop = self._hop_ttft(prefiller, prefiller_queue, uncached_tokens)
        stall = direct * max(running_streams, 0.0)
        extra = hop - direct_ttft
        policy = self.policy
        if uncached_tokens < policy.min_threshold:
            return Estimate(uncached_tokens, running_streams, direct, stall, hop, extra, False, "below_min_threshold")
        if uncached_tokens >= policy.max_threshold:
            return Estimate(uncached_tokens, running_streams, direct, stall, hop, extra, True, "above_max_threshold")
        late = policy.itl_slo is not None and running_streams > 0 and direct > policy.itl_slo
        budgeted = late and self.gap_budget(decoder).allows(running_streams, policy.itl_slo_share)
        hop_for_slo = self._slo_hop_ttft(prefiller, prefiller_queue, uncached_tokens)
        ttft_slo = self._ttft_slo(uncached_tokens)
        slo = self._slo_path(direct_ttft, hop_for_slo, stall, ttft_slo, smooth=not late or budgeted)
        if slo is not None:
            disaggregate, reason = slo
        else:
            disaggregate = policy.interference_weight * stall > extra
            reason = "adaptive_interference" if disaggregate else "adaptive_cheaper_direct"
            learning = not self.hop_learned(prefiller)
            if self._explores(stall * policy.interference_weight, extra, disaggregate, learning=learning):
                disaggregate, reason = True, "explore"
        if late and not disaggregate:
            self.gap_budget(decoder).spend(running_streams)
        return Estimate(uncached_tokens, running_streams, direct, stall, hop, extra, disaggregate, reason)

    def _hop_ttft(self, prefiller: str, prefiller_queue: float, uncached_tokens: float) -> float:
        """The disaggregated path's first-token time: the prefiller's queue and this prompt's prefill at
        its learned line, plus the KV hand-off."""
        hop = self.hop_cost(prefiller).predict(max(prefiller_queue, 0.0) + uncached_tokens)
        return hop + self.handoff.predict(uncached_tokens)

    def hop_observations(self, prefiller: str) -> int:
        """The prefill calls the prefiller's hop line has learned from."""
        return self.hop_cost(prefiller).observations

    def hop_learned(self, prefiller: str) -> bool:
        """Whether the prefiller has served LEARNED_HOPS observed calls (exploration is wider before)."""
        return self.hop_observations(prefiller) >= LEARNED_HOPS

    def _slo_hop_ttft(self, prefiller: str, prefiller_queue: float, uncached_tokens: float) -> float:
        """The hop's first-token time the SLOs judge: the queue and this prompt at the line learned on the
        neutral prior, plus the KV hand-off."""
        hop = self.slo_hop_cost(prefiller).predict(max(prefiller_queue, 0.0) + uncached_tokens)
        return hop + self.handoff.predict(uncached_tokens)

    def _wait_before_prefill(self, decoder: str, decoder_queue: float) -> float:
        """A direct prompt's wait on `decoder` before its own prefill: the queued prompts' prefill at the
        decoder's speed per token, plus the learned wait they do not explain."""
        return self.direct_cost(decoder).per_token * max(decoder_queue, 0.0) + self.direct_wait(decoder).mean

    def _ttft_slo(self, uncached_tokens: float) -> float | None:
        """The TTFT SLO of a prompt this long: none beyond ttft_slo_max_tokens (when set)."""
        limit = self.policy.ttft_slo_max_tokens
        return None if limit and uncached_tokens > limit else self.policy.ttft_slo

    def _slo_path(
        self, direct_ttft: float, hop_ttft: float, stall: float, ttft_slo: float | None, *, smooth: bool
    ) -> tuple[bool, str] | None:
        """(disaggregate, reason) when the known SLOs pick the path: only one path meets all of them.
        The hop meets this prompt's TTFT SLO (`ttft_slo`) by its first-token time; the direct path meets
        it by its own, and the ITL SLO when `smooth`: its prefill would not pause the running streams
        longer than the SLO, or the decoder's ITL budget has room for those late gaps. When the direct
        path is the one on time for the TTFT SLO it is taken only while its weighted stall summed over
        the streams stays within that SLO: keeping one long prompt on time must not make a decoder full
        of streams late, and that stall also delays the first token of every request behind it.
        None: the model decides."""
        policy = self.policy
        if ttft_slo is None and policy.itl_slo is None:
            return None
        hop_on_time = ttft_slo is None or hop_ttft <= ttft_slo
        direct_on_time = ttft_slo is None or direct_ttft <= ttft_slo
        if hop_on_time and not (direct_on_time and smooth):
            return True, "ttft_slo" if not direct_on_time else "itl_slo"
        on_time_alone = direct_on_time and smooth and not hop_on_time
        if on_time_alone and ttft_slo is not None and policy.interference_weight * stall <= ttft_slo:
            return False, "ttft_slo"
        return None

    def _explores(self, weighted_stall: float, extra: float, disaggregate: bool, *, learning: bool = False) -> bool:
        """Send a small share of the prompts the model keeps direct to the prefill pool instead, only
        near the boundary (the two costs within a factor of 2), so the hop keeps being measured; at least
        LEARNING_EXPLORE_SHARE while the prefiller's hop is not learned (`learning`), so a prior that keeps
        prompts direct is tested within a few requests (explore_share 0 still turns exploration off).

        Never the other way: the direct path is learned on quiet decoders, which keep prompts anyway,
        and a busy decoder's first tokens teach nothing, so its streams would pay a stall for no lesson.
        """
        share = self.policy.explore_share
        if share <= 0 or disaggregate:
            return False
        if learning:
            share = max(share, LEARNING_EXPLORE_SHARE)
        low, high = sorted((max(weighted_stall, 1e-9), max(extra, 1e-9)))
        return high <= 2 * low and self._rng() < share

    def effective_threshold(
        self, decoder: str, prefiller: str, running_streams: float, prefiller_queue: float, decoder_queue: float = 0.0
    ) -> float:
        """The prompt length (uncached tokens) at which the decision flips, at this load; inf if never."""
        d = self.direct_cost(decoder)
        p = self.hop_cost(prefiller)
        queued = p.per_token * max(prefiller_queue, 0.0)
        w = self.policy.interference_weight * max(running_streams, 0.0)
        waiting = self._wait_before_prefill(decoder, decoder_queue)
        # w * (d0 + d1 x) > p0 + p1 (queue + x) + h0 + h1 x - (wait + d1 dqueue + d0 + d1 x)
        slope = (w + 1) * d.per_token - p.per_token - self.handoff.per_token
        intercept = p.overhead + queued + self.handoff.overhead - (w + 1) * d.overhead - waiting
        crossing = (math.inf if intercept >= 0 else 0.0) if slope <= 0 else max(intercept / slope, 0.0)
        crossing = min(crossing, self._itl_slo_tokens(decoder, prefiller, running_streams, prefiller_queue))
        if math.isinf(crossing):
            return math.inf
        return float(min(max(crossing, self.policy.min_threshold), self.policy.max_threshold))

    def _itl_slo_tokens(self, decoder: str, prefiller: str, running_streams: float, prefiller_queue: float) -> float:
        """The prompt length from which the ITL SLO sends prompts to the hop at this load: where their
        own prefill would pause the running streams longer than the SLO, unless the hop of a prompt that
        long would miss the TTFT SLO (then the model decides, for the prompts the TTFT SLO holds for), or
        the decoder's ITL budget has room for the pause (then the model decides); inf when it sends none."""
        itl_slo = self.policy.itl_slo
        d = self.direct_cost(decoder)
        if itl_slo is None or running_streams <= 0 or d.per_token <= 0:
            return math.inf
        if self.gap_budget(decoder).allows(running_streams, self.policy.itl_slo_share):
            return math.inf
        tokens = max((itl_slo - d.overhead) / d.per_token, 0.0)
        ttft_slo = self._ttft_slo(tokens)
        if ttft_slo is None or self._slo_hop_ttft(prefiller, prefiller_queue, tokens) <= ttft_slo:
            return tokens
        # Late for the TTFT SLO: the model decides up to ttft_slo_max_tokens, the ITL SLO beyond it.
        limit = self.policy.ttft_slo_max_tokens
        return float(limit + 1) if limit else math.inf

    def cost_rows(self) -> list[tuple[str, str, str, float]]:
        """(model, endpoint, term, value) for every learned cost, for metrics."""
        rows: list[tuple[str, str, str, float]] = []
        tables: list[tuple[str, Mapping[str, LinearCost | HopCost | DecayedMean]]] = [
            ("handoff", {"": self.handoff}),
            ("direct_prefill", self._direct),
            ("direct_wait", self._wait),
            ("prefill_hop", self._hop),
            ("prefill_hop_slo", self._slo_hop),
        ]
        for model, table in tables:
            for endpoint, fit in list(table.items()):
                rows += [(model, endpoint, term, value) for term, value in _coefficients(fit).items()]
        for decoder, budget in list(self._gaps.items()):
            rows += [
                ("itl_budget", decoder, "recent_gaps", budget.gaps),
                ("itl_budget", decoder, "late_gaps", budget.spent),
                ("itl_budget", decoder, "late_share", budget.share),
            ]
        return rows

    def describe(self) -> dict[str, object]:
        return {
            "handoff": _coefficients(self.handoff),
            "direct_prefill": {url: _coefficients(fit) for url, fit in self._direct.items()},
            "direct_wait": {url: _coefficients(fit) for url, fit in self._wait.items()},
            "prefill_hop": {url: _coefficients(fit) for url, fit in self._hop.items()},
            "prefill_hop_slo": {url: _coefficients(fit) for url, fit in self._slo_hop.items()},
            "itl_budget": {
                url: {"recent_gaps": budget.gaps, "late_gaps": budget.spent, "late_share": budget.share}
                for url, budget in self._gaps.items()
            },
        }


def _coefficients(fit: LinearCost | HopCost | DecayedMean) -> dict[str, float]:
    if isinstance(fit, DecayedMean):
        return {"overhead_seconds": fit.mean, "seconds_per_token": 0.0, "observations": float(fit.observations)}
    return {
        "overhead_seconds": fit.overhead,
        "seconds_per_token": fit.per_token,
        "observations": float(fit.observations),
    }
