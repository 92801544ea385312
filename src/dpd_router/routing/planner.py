"""The routing decision: direct to a decoder, or prefiller first, and why.

`Planner.plan` is pure decision-making over in-memory state (health, in-flight counts, scraped
load, cache indexes): no I/O, so it is cheap on the request path. The one optional I/O step,
`Planner.lookup_kv` (an LMCache controller lookup bounded by `kv_lookup_timeout`), runs before it
and hands its answer in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from dpd_router.config import Settings, ThresholdMode
from dpd_router.pool.endpoint import Endpoint, Role
from dpd_router.pool.pool import Pool
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.errors import NoHealthyDecoder
from dpd_router.request.frozen import evolve
from dpd_router.routing.adaptive import AdaptiveModel, AdaptivePolicy
from dpd_router.routing.cache import CacheLocator, CacheSource, KVHintSource
from dpd_router.routing.load import Balance
from dpd_router.routing.prefix_index import PrefixIndex
from dpd_router.routing.request import KVHint, RoutingRequest, session_key
from dpd_router.routing.strategies import KVAware, LeastLoaded, PrefixAware, RoundRobin, Session, Strategy
from dpd_router.routing.threshold import PrefillBusyGate, Threshold

log = logging.getLogger("dpd_router.planner")

RoutePath = Literal["direct", "disaggregated"]

# Why a request took its path; these are the `reason` label values on route_decisions_total.
BELOW_THRESHOLD = "below_threshold"
CACHED_ON_DECODER = "cached_on_decoder"
LONG_PROMPT = "long_prompt"
PREFILL_POOL_DOWN = "prefill_pool_down"
PREFILL_POOL_BUSY = "prefill_pool_busy"
BATCHED_PROMPT = "batched_prompt"
PREFILL_FAILED = "prefill_failed"
# The decoder could not load the staged KV, so it computes the prompt itself.
KV_REJECTED = "kv_rejected"
# The KV connector cannot disaggregate this request exactly (LMCache: tools, logprobs, n > 1, ...).
CONNECTOR_UNSUPPORTED = "connector_unsupported"
# The KV connector's decoders serve nothing alone (SGLang): every request takes the prefill hop.
CONNECTOR_REQUIRES_PREFILL = "connector_requires_prefill"
# A prompt shown long by its words is read first this many blocks far: enough for the cached prefixes of
# most prompts to end inside it (a prefix running on past it has the prompt read on, doubling).
REACH_HEAD_BLOCKS = 4


@dataclass(frozen=True)
class Plan:
    """A decision, as data: the path, the engines, the reason (for metrics and logs), and the
    prompt tokens the serving engines still have to compute (all of them, in `static` mode)."""

    path: RoutePath
    reason: str
    decoder: Endpoint
    prefiller: Endpoint | None = None
    uncached_tokens: int = 0
    # Streams running on the decoder when the plan was made (what a direct prefill would stall).
    decoder_streams: float = 0.0
    # Prompt tokens queued on the prefiller when an adaptive plan chose it (what its prefill waits for).
    prefiller_queue: float | None = None
    # Prompt tokens of streamed direct requests on the decoder before their first token (what a direct
    # prefill waits for).
    decoder_queue: float = 0.0
    # The decoder fails its health probes but nothing else, and no decoder passes them (Pool.last_resort).
    last_resort: bool = False

    def direct(self, reason: str) -> Plan:
        """The same plan served by the decoder alone (for example after the prefill hop failed)."""
        return replace(self, path="direct", reason=reason, prefiller=None)


class KVLookup(Protocol):
    async def lookup(self, token_ids: Sequence[int]) -> KVHint | None: ...


class Planner:
    """Chooses the decoder, applies the threshold and the prefill-busy gate, then chooses the prefiller.

    With a `cache`, every plan records where the prompt went (decoder, and prefiller when
    disaggregated), so the next request sharing the prefix finds it. Without one, and in `static`
    mode, the plan depends on prompt length, health and load alone.
    """

    def __init__(
        self,
        pool: Pool,
        *,
        threshold: int,
        prefill: Strategy,
        decode: Strategy,
        threshold_mode: ThresholdMode = "static",
        cache: CacheLocator | None = None,
        busy_gate: PrefillBusyGate | None = None,
        kv_lookup: KVLookup | None = None,
        session_header: str | None = None,
        adaptive: AdaptiveModel | None = None,
        batches: bool = False,
        serves_direct: bool = True,
    ) -> None:
        self.pool = pool
        # Whether the KV connector can disaggregate a batched prompt (SGLang: one bootstrap room each).
        self.batches = batches
        # Whether a decoder serves a request without the prefill hop (SGLang's cannot: no threshold then).
        self.serves_direct = serves_direct
        self.threshold = threshold
        self.prefill_strategy = prefill
        self.decode_strategy = decode
        self.cache = cache
        self._threshold = Threshold(threshold, threshold_mode)
        self._busy_gate = busy_gate
        self._kv_lookup = kv_lookup
        self._session_header = session_header
        self.adaptive = adaptive

    def reconfigure(self, settings: Settings) -> None:
        """Apply live routing settings (threshold, mode, strategy, balance, busy gate, session header),
        built by the same factory as at startup (`routing_rules`).

        The prefix index and KV sources are kept, so affinity survives the change.
        """
        self._follow(routing_rules(settings, self.cache))
        if self.adaptive is not None:
            self.adaptive.policy = adaptive_policy(settings)
            self.adaptive.reprior(settings.routing_threshold)

    def variant(self, settings: Settings, adaptive: AdaptiveModel | None) -> Planner:
        """A planner with other routing settings (an experiment arm's) over this one's pool, prefix index
        and KV sources: it shares where prompts went and opens no connection of its own. It asks the
        external KV index only for `kvaware`, as `build_planner` does."""
        rules = routing_rules(settings, self.cache)
        return Planner(
            self.pool,
            threshold=rules.threshold,
            prefill=rules.prefill or self.prefill_strategy,
            decode=rules.decode or self.decode_strategy,
            threshold_mode=rules.threshold_mode,
            cache=self.cache,
            busy_gate=rules.busy_gate,
            kv_lookup=self._kv_lookup if settings.prefill_strategy == "kvaware" else None,
            session_header=rules.session_header,
            adaptive=adaptive,
            batches=self.batches,
            serves_direct=self.serves_direct,
        )

    def for_adapter(self, adapter: str, settings: Settings) -> Planner:
        """A planner with `settings` over the engines of this pool that list the LoRA adapter `adapter` (as
        each health round finds them), on both hops, with a prefix index of its own: an adapter's KV is not
        the base model's (vLLM's block hashes carry the adapter), so no base-model prefix decides for it, nor
        the engines' KV events, whose hashes for an adapter this router does not compute."""
        index = PrefixIndex(block_size=settings.block_size, capacity=adapter_index_capacity(settings))
        cache = CacheLocator(index, [])
        return planner_with_cache(
            settings,
            Pool.where(self.pool, lambda endpoint: adapter in endpoint.adapters, name=f"{self.pool.name}/{adapter}"),
            cache,
            adaptive=self.adaptive,
            batches=self.batches,
            serves_direct=self.serves_direct,
        )

    def _follow(self, rules: RoutingRules) -> None:
        self.threshold = rules.threshold
        self._threshold = Threshold(rules.threshold, rules.threshold_mode)
        self._busy_gate = rules.busy_gate
        self._session_header = rules.session_header
        if rules.prefill is not None and rules.decode is not None:
            self.prefill_strategy = rules.prefill
            self.decode_strategy = rules.decode

    @property
    def threshold_mode(self) -> ThresholdMode:
        return self._threshold.mode

    @property
    def weighs_whole_prefixes(self) -> bool:
        """Whether this planner's next decisions weigh how far a prompt's prefix is cached (a cache-aware
        threshold over the prefix index): the index must hold every block of the prompts it places, not
        only those a plan read, or a conversation's next turn would find only its head cached."""
        return self.cache is not None and self._threshold.cache_aware

    def session_key(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
        """The request's session key: the `session_header` header, else the body's `user` field."""
        return session_key(headers, body, header=self._session_header)

    async def lookup_kv(self, prompt: Prompt) -> KVHint | None:
        """Ask the external KV index where the prompt's KV is; None at once when none is configured."""
        if self._kv_lookup is None:
            return None
        return await self._kv_lookup.lookup(prompt.token_ids)

    def tokens_to_settle(self, prompt: Prompt) -> int | None:
        """For a prompt known in part (its first ids, and at most `at_most` tokens in all): 0 when its
        plan is the plan of every prompt it may turn out to be; else about how many of its first tokens
        would settle the plan, or None when only the whole prompt will do.

        Settled: a prompt below the threshold whatever its count, when the cached prefixes of every
        endpoint (by every cache source) end inside its known ids, or only one decoder could take it;
        a prompt a cache-aware threshold serves direct, known past the threshold, once its bound less what
        every decoder it may go to holds of it is below the threshold (what a decoder computes of it is);
        a long prompt once its known tokens (or its bytes or words: Prompt.at_least), less the longest such cached
        prefix, reach the threshold (and the busy gate's ceiling, while the gate is closed), and its
        prefiller's strategy reads no further (`tokens_read`; nothing while one prefiller is up: it takes
        the prompt whatever the strategy would read). Nothing awaits between this and `plan`, so the state
        it saw is the plan's.
        Adaptive mode weighs the exact count, an external KV lookup asks with every id, and decoders
        that serve nothing alone take every prompt through a prefiller: they read the whole prompt.
        """
        if prompt.at_most is None:
            return 0
        if not self.serves_direct or self._kv_lookup is not None or self._threshold.mode == "adaptive":
            return None
        known = len(prompt.token_ids)
        reach = self._cached_reach(prompt)
        block_size = self.cache.block_size if self.cache is not None else 16
        if prompt.at_most < self.threshold:
            return 0 if reach is not None or len(self.pool.decoders) == 1 else max(2 * known, 16 * block_size)
        strategy = self.prefill_strategy
        # A prefix-aware choice among several prefillers reads its key; with one, nothing is chosen.
        reads = strategy.tokens_read() if isinstance(strategy, PrefixAware) else 0
        ids_needed = reads if len(self.pool.healthy("prefill")) > 1 else 0
        # Its count may be shown by its bytes or words alone (Prompt.at_least), not its ids by anything but reading.
        shown = prompt.at_least or (lambda count: False)
        if reach is None:
            # A cached prefix runs on past the known blocks: a few blocks more may show where it ends (the
            # reader reads at least twice as far as it encoded before, so the steps stay few).
            step = known + REACH_HEAD_BLOCKS * block_size
            if shown(self.threshold):
                # Long by its words: read only as far as the cached prefixes need to be known, from a few blocks.
                return max(step, ids_needed)
            return max(step, max(self.threshold, ids_needed) + block_size)
        cached = reach if self._threshold.cache_aware else 0
        if cached and (known >= self.threshold or shown(self.threshold)) and self._computed_below(prompt):
            return 0
        count_needed = self.threshold + cached
        gate = self._busy_gate
        if gate is not None and gate.diverts(self.pool.healthy("prefill"), 0):
            # Closed now: it diverts prompts below its ceiling.
            count_needed = max(count_needed, gate.max_tokens + cached)
        if known >= ids_needed and (known >= count_needed or shown(count_needed)):
            return 0
        return max(ids_needed, count_needed)

    def _computed_below(self, prompt: Prompt) -> bool:
        """Whether every decoder the prompt may go to would compute fewer than the threshold's tokens of it,
        however many it holds (a cache-aware threshold, the cached prefixes known): direct, `cached_on_decoder`.
        Asked of every decoder the decoders' rule may choose now (PrefixAware.may_choose; any, for another
        rule), so no choice can take it to one that holds less."""
        assert self.cache is not None and prompt.at_most is not None
        decoders = self._decoder_candidates()
        if not decoders:
            return False
        request = RoutingRequest(prompt)
        strategy = self.decode_strategy
        possible = strategy.may_choose(decoders, request) if isinstance(strategy, PrefixAware) else decoders
        least = min(self.cache.cached_tokens(request, decoder) for decoder in possible)
        return prompt.at_most - least < self.threshold

    def _cached_reach(self, prompt: Prompt) -> int | None:
        """The longest prefix of the prompt any endpoint holds by any cache source, when reading on could
        not change a plan that weighs it; None when it could.

        A cache-aware threshold weighs its length: every such prefix must end inside the prompt's known
        full blocks (so the whole prompt's are the same). The strategies only rank the endpoints of a
        role by it: one endpoint whose prefix runs on past the known blocks is the longest however far it
        runs (the others' end inside them), so only two or more of a role running on leave it open.
        """
        if self.cache is None:
            return 0
        if not self._threshold.cache_aware and len(self.pool.decoders) <= 1 and len(self.pool.healthy("prefill")) <= 1:
            return 0  # nothing weighs a cached prefix, and no role has endpoints to rank by one
        block_size = self.cache.block_size
        assert prompt.at_most is not None
        if prompt.at_most < block_size:
            return 0  # no full block: nothing can be matched
        known = len(prompt.token_ids) // block_size * block_size
        if known == 0:
            return None
        request = RoutingRequest(prompt)
        longest = 0
        for endpoints in (self.pool.prefillers, self.pool.decoders):
            role_longest, reaching = self.cache.reaching(request, endpoints, known)
            if reaching > 1:
                return None
            longest = max(longest, role_longest)
        if self._threshold.cache_aware and longest >= known:
            return None
        return longest

    def record_whole(self, prompt: Prompt, plan: Plan) -> None:
        """Record where a prompt planned on its first tokens went, now that its whole encoding is known."""
        if self.cache is not None:
            request = RoutingRequest(prompt)
            self.cache.record(request, (plan.decoder,) if plan.prefiller is None else (plan.decoder, plan.prefiller))

    def plan(
        self,
        prompt: Prompt,
        *,
        batch_size: int = 1,
        session_key: str | None = None,
        kv_hint: KVHint | None = None,
        unsupported: str | None = None,
    ) -> Plan:
        """The plan for `prompt`. `unsupported` says why the KV connector cannot disaggregate this
        request (None: it can): it is served direct, and recorded as cached on its decoder only."""
        request = RoutingRequest(prompt, session_key=session_key, kv_hint=kv_hint, unsupported=unsupported)
        decoder = self.choose_decoder(request)
        cached = self.cache.cached_tokens(request, decoder) if self.cache and self._threshold.cache_aware else 0
        uncached = self._threshold.uncached_tokens(prompt.num_tokens, cached)
        plan = evolve(
            self._decide(request, decoder, uncached, batch_size),
            decoder_streams=running_streams(decoder, time.monotonic()),
            decoder_queue=float(decoder.queued_tokens),
            last_resort=not decoder.healthy,
        )
        if self.cache is not None:
            self.cache.record(request, (decoder,) if plan.prefiller is None else (decoder, plan.prefiller))
        return plan

    def alternative(
        self, role: Role, prompt: Prompt, *, exclude: Collection[Endpoint], session_key: str | None = None
    ) -> Endpoint | None:
        """Another endpoint of `role` for a retry, chosen by the same strategy; None if none is left.
        With no decoder available, recovering ones count, then those failing only their probes, as in
        choose_decoder."""
        available = self._decoder_candidates() if role == "decode" else self.pool.healthy(role)
        candidates = [endpoint for endpoint in available if endpoint not in exclude]
        if not candidates:
            return None
        strategy = self.prefill_strategy if role == "prefill" else self.decode_strategy
        return strategy.select(candidates, RoutingRequest(prompt, session_key=session_key))

    def _decoder_candidates(self) -> Sequence[Endpoint]:
        """The decoders a plan chooses among: the healthy ones, else the recovering, else those failing only
        their probes."""
        pool = self.pool
        return pool.healthy("decode") or pool.recovering("decode") or pool.last_resort("decode")

    def choose_decoder(self, request: RoutingRequest) -> Endpoint:
        decoders = self._decoder_candidates()
        if not decoders:
            raise NoHealthyDecoder("No decoder is available to serve this request; try again shortly.")
        return self.decode_strategy.select(decoders, request)

    def _decide(self, request: RoutingRequest, decoder: Endpoint, uncached: int, batch_size: int) -> Plan:
        if not self.serves_direct:
            return self._prefill_always(request, decoder, uncached)
        if self.adaptive is not None and self._threshold.mode == "adaptive":
            return self._decide_adaptively(request, decoder, uncached, batch_size, self.adaptive)
        if request.prompt.num_tokens < self.threshold:
            return Plan("direct", BELOW_THRESHOLD, decoder, uncached_tokens=uncached)
        if uncached < self.threshold:
            return Plan("direct", CACHED_ON_DECODER, decoder, uncached_tokens=uncached)
        prefiller = self._available_prefiller(request, decoder, uncached, batch_size)
        if isinstance(prefiller, Plan):
            return prefiller
        return Plan("disaggregated", LONG_PROMPT, decoder, prefiller, uncached_tokens=uncached)

    def _prefill_always(self, request: RoutingRequest, decoder: Endpoint, uncached: int) -> Plan:
        """Every prompt takes the prefill hop, whatever its length or the prefillers' queues: the
        decoders serve nothing alone. With no prefiller up, the direct plan (which the gateway refuses)."""
        if request.unsupported is not None:
            return Plan("direct", CONNECTOR_UNSUPPORTED, decoder, uncached_tokens=uncached)
        prefillers = self.pool.healthy("prefill")
        if not prefillers:
            return Plan("direct", PREFILL_POOL_DOWN, decoder, uncached_tokens=uncached)
        prefiller = self.prefill_strategy.select(prefillers, request)
        return Plan("disaggregated", CONNECTOR_REQUIRES_PREFILL, decoder, prefiller, uncached_tokens=uncached)

    def _available_prefiller(
        self, request: RoutingRequest, decoder: Endpoint, uncached: int, batch_size: int
    ) -> Endpoint | Plan:
        """The prefiller for a prompt worth disaggregating, or the direct plan when none can take it."""
        if batch_size > 1 and not self.batches:
            # An engine answers a batched prompt with one kv_transfer_params: it cannot hand over several.
            return Plan("direct", BATCHED_PROMPT, decoder, uncached_tokens=uncached)
        if request.unsupported is not None:
            return Plan("direct", CONNECTOR_UNSUPPORTED, decoder, uncached_tokens=uncached)
        prefillers = self.pool.healthy("prefill")
        if not prefillers:
            return Plan("direct", PREFILL_POOL_DOWN, decoder, uncached_tokens=uncached)
        gate = self._busy_gate
        if gate is not None and self._pool_is_busy(gate, prefillers, decoder, uncached):
            return Plan("direct", PREFILL_POOL_BUSY, decoder, uncached_tokens=uncached)
        return self.prefill_strategy.select(prefillers, request)

    def _pool_is_busy(
        self, gate: PrefillBusyGate, prefillers: Sequence[Endpoint], decoder: Endpoint, uncached: int
    ) -> bool:
        """The prefill-busy gate: by waiting requests, or in adaptive mode by queued prompt tokens, for
        the prompts `decoder` can take without stalling its streams for long."""
        if self.adaptive is not None and self._threshold.mode == "adaptive":
            now = time.monotonic()
            return gate.diverts_by_tokens(
                prefillers, uncached, lambda prefiller: queued_prefills(prefiller, now), running_streams(decoder, now)
            )
        return gate.diverts(prefillers, uncached)

    def _decide_adaptively(
        self, request: RoutingRequest, decoder: Endpoint, uncached: int, batch_size: int, model: AdaptiveModel
    ) -> Plan:
        """Weigh the stall a direct prefill inflicts on the decoder's streams against the hop's cost."""
        if uncached < model.policy.min_threshold:
            return Plan("direct", BELOW_THRESHOLD, decoder, uncached_tokens=uncached)
        prefiller = self._available_prefiller(request, decoder, uncached, batch_size)
        if isinstance(prefiller, Plan):
            return prefiller
        now = time.monotonic()
        queue = queued_prefills(prefiller, now)
        estimate = model.estimate(
            decoder.url, prefiller.url, uncached, running_streams(decoder, now), queue, decoder.queued_tokens
        )
        if estimate.disaggregate:
            return Plan(
                "disaggregated", estimate.reason, decoder, prefiller, uncached_tokens=uncached, prefiller_queue=queue
            )
        return Plan("direct", estimate.reason, decoder, uncached_tokens=uncached)

    def adaptive_view(self) -> list[dict[str, Any]]:
        """Per healthy decoder: its load now and the prompt length at which adaptive mode would
        disaggregate, with the least-queued prefiller. Empty unless threshold_mode is adaptive."""
        if self.adaptive is None or self._threshold.mode != "adaptive":
            return []
        now = time.monotonic()
        prefillers = self.pool.healthy("prefill")
        view: list[dict[str, Any]] = []
        for decoder in self.pool.healthy("decode"):
            streams = running_streams(decoder, now)
            pending = float(decoder.queued_tokens)
            entry: dict[str, Any] = {
                "decoder": decoder.url,
                "running_streams": streams,
                "decoder_queue": pending,
                "threshold_tokens": None,
                "late_gap_share": self.adaptive.gap_budget(decoder.url).share,
            }
            if prefillers:
                prefiller = min(prefillers, key=lambda p: queued_prefills(p, now))
                queue = queued_prefills(prefiller, now)
                entry |= {
                    "prefiller": prefiller.url,
                    "prefiller_queue": queue,
                    "threshold_tokens": self.adaptive.effective_threshold(
                        decoder.url, prefiller.url, streams, queue, pending
                    ),
                }
            view.append(entry)
        return view


def running_streams(decoder: Endpoint, now: float) -> float:
    """Streams a direct prefill would stall: the engine's running requests, or the router's own calls
    to it, less those still in their prefill hop (they are not on the decoder yet)."""
    load = decoder.fresh_load(now)
    return max(float(decoder.in_flight - decoder.staging), load.running if load is not None else 0.0)


def queued_prefills(prefiller: Endpoint, now: float) -> float:
    """Prompt tokens ahead of a new prefill on this prefiller: the router's own open calls, or the
    engine's scraped queue at the mean size of those calls when the engine reports more."""
    load = prefiller.fresh_load(now)
    scraped = (load.waiting + load.running) if load is not None else 0.0
    if scraped <= prefiller.in_flight or prefiller.in_flight == 0:
        return float(prefiller.queued_tokens)
    return prefiller.queued_tokens / prefiller.in_flight * scraped


def build_planner(
    settings: Settings,
    pool: Pool,
    metrics: RouterMetrics,
    *,
    kv_sources: Sequence[CacheSource] = (),
    kv_lookup: KVLookup | None = None,
    adaptive: AdaptiveModel | None = None,
    batches: bool = False,
    serves_direct: bool = True,
) -> Planner:
    """The planner the settings describe. `kv_sources` and `kv_lookup` feed `kvaware` routing only.

    What is built here once (the prefix index, the KV sources) lives as long as the process; the live
    part comes from `routing_rules`, which `Planner.reconfigure` calls again on a change.
    """
    index = PrefixIndex(block_size=settings.block_size, capacity=settings.prefix_index_capacity)
    metrics.watch_cache_index(index.name, lambda: len(index))
    kvaware = settings.prefill_strategy == "kvaware"
    if kvaware and not kv_sources and kv_lookup is None:
        log.warning("prefill_strategy kvaware has no KV source configured: it routes as prefixaware")
    sources: list[CacheSource] = [KVHintSource(), *kv_sources] if kvaware else []
    return planner_with_cache(
        settings,
        pool,
        CacheLocator(index, sources),
        kv_lookup=kv_lookup if kvaware else None,
        adaptive=adaptive,
        batches=batches,
        serves_direct=serves_direct,
    )


def planner_with_cache(
    settings: Settings,
    pool: Pool,
    cache: CacheLocator,
    *,
    kv_lookup: KVLookup | None = None,
    adaptive: AdaptiveModel | None = None,
    batches: bool = False,
    serves_direct: bool = True,
) -> Planner:
    """The planner `settings` describe over `pool`, its strategies following `cache`."""
    rules = routing_rules(settings, cache)
    assert rules.prefill is not None and rules.decode is not None  # a cache gives every strategy
    return Planner(
        pool,
        threshold=rules.threshold,
        prefill=rules.prefill,
        decode=rules.decode,
        threshold_mode=rules.threshold_mode,
        cache=cache,
        busy_gate=rules.busy_gate,
        kv_lookup=kv_lookup,
        session_header=rules.session_header,
        adaptive=adaptive,
        batches=batches,
        serves_direct=serves_direct,
    )


@dataclass(frozen=True)
class RoutingRules:
    """The part of a planner that live settings change. No strategies (None) for a planner without a
    cache: the cache-following ones need one, so it keeps those it was built with."""

    threshold: int
    threshold_mode: ThresholdMode
    busy_gate: PrefillBusyGate
    session_header: str | None
    prefill: Strategy | None
    decode: Strategy | None


def routing_rules(settings: Settings, cache: CacheLocator | None) -> RoutingRules:
    """The planner's live part, at startup (`build_planner`) and on every change (`Planner.reconfigure`)."""
    prefill: Strategy | None = None
    decode: Strategy | None = None
    if cache is not None:
        balance = Balance(settings.balance_abs_threshold, settings.balance_rel_threshold)
        prefill = prefill_strategy(settings.prefill_strategy, cache=cache, balance=balance)
        # Decoders always follow prefix affinity; with `kvaware`, as the engines report it. A new prefix
        # goes to the least loaded decoder: a stream holds its decoder for the whole answer.
        strategy = KVAware if settings.prefill_strategy == "kvaware" else PrefixAware
        decode = strategy(cache, balance, hash_new_prefixes=False)
    return RoutingRules(
        threshold=settings.routing_threshold,
        threshold_mode=settings.threshold_mode,
        busy_gate=busy_gate(settings),
        session_header=settings.session_header,
        prefill=prefill,
        decode=decode,
    )


# An adapter's prefix index holds this share of the model's (`prefix_index_capacity`): adapters are many, and
# each sees a part of the traffic.
ADAPTER_INDEX_SHARE = 16


def adapter_index_capacity(settings: Settings) -> int:
    return max(settings.prefix_index_capacity // ADAPTER_INDEX_SHARE, 1)


def busy_gate(settings: Settings) -> PrefillBusyGate:
    return PrefillBusyGate(
        settings.prefill_busy_queue_depth, settings.prefill_busy_max_tokens, settings.prefill_busy_queue_tokens
    )


def adaptive_policy(settings: Settings) -> AdaptivePolicy:
    return AdaptivePolicy(
        interference_weight=settings.interference_weight,
        min_threshold=settings.min_threshold,
        max_threshold=settings.max_threshold,
        explore_share=settings.explore_share,
        ttft_slo=settings.ttft_slo,
        ttft_slo_max_tokens=settings.ttft_slo_max_tokens,
        itl_slo=settings.itl_slo,
        itl_slo_share=settings.itl_slo_share,
    )


def prefill_strategy(name: str, *, cache: CacheLocator, balance: Balance) -> Strategy:
    """The prefiller selection policy named by the `prefill_strategy` setting."""
    if name == "roundrobin":
        return RoundRobin()
    if name == "leastloaded":
        return LeastLoaded()
    if name == "session":
        return Session()
    if name == "prefixaware":
        return PrefixAware(cache, balance)
    if name == "kvaware":
        return KVAware(cache, balance)
    raise ValueError(f"unknown prefill_strategy {name!r}")
