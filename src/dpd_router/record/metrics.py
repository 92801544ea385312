"""Every Prometheus metric the router exports, defined once, in a registry of its own.

Under `dpd-router serve --workers N` (supervisor.py) every worker writes its values to the files of
prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the supervisor before the
workers start), and a scrape, whichever worker answers it, reads them all: counters and histograms
sum every worker's (dead ones' included, so they never go backwards); each gauge says how its
workers' values combine (`multiprocess_mode`, ignored by a single process). Gauges read from the
process's own state at scrape time (endpoint in-flight, health, load, cache index sizes) cannot be
read across processes, so each worker copies them into its files every PUBLISH_INTERVAL seconds.
The adaptive model's gauges stay the answering worker's own: each worker learns its own.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from dpd_router.pool.endpoint import Endpoint, EngineLoad

PREFIX = "dpd_router"


def observe_each(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(value)` for each of `values` (a labelled child): a stream's inter-token gaps.

    Counted into buckets here and added once a bucket touched, rather than a lock and a walk of the
    bounds per value, which for a long stream's hundreds of gaps was a large part of the router's CPU
    per streamed token. Reads prometheus-client's own fields of a histogram (stable across its
    versions); a histogram without them is observed value by value.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1  # the first bound >= value, as observe() picks
    for index, count in enumerate(counts):
        if count:
            buckets[index].inc(count)
    total.inc(math.fsum(values))


# Request metrics carry an `arm` label first: the experiment arm whose routing settings served the request
# ("live" without experiments), or "shadow" for the copies sent to a shadow endpoint. Dashboards that sum
# over it see the whole router; `dpd-router advise` compares the arms.

# From a millisecond to ten minutes: relay overhead, TTFT and whole generations share these.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# Per-token gaps: from a tenth of a millisecond to a few seconds.
TOKEN_GAP_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
# Token counts, powers of two from 16 to a million: the audit operators run before choosing a threshold.
TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 21))
# Prompt-length buckets for TTFT by prompt length: powers of two from 128 to 128k tokens.
PROMPT_LENGTH_BOUNDS = tuple(2**k for k in range(7, 18))
# Seconds between a worker's copies of its scrape-time gauges into the shared files (multiprocess mode).
PUBLISH_INTERVAL = 1.0
# The environment variable prometheus-client reads, at import, to write values to files.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def model_label(model: str | None) -> str:
    """The `model` label of a request: its served model's name (configured, or learnt from the engines: never a
    name a client sent), empty while a lone model's name is not known yet."""
    return model or ""


# The `prompt_tokens` label of a request whose prompt nobody counted (the engine's usage did not say).
UNKNOWN_LENGTH = ""


def prompt_length_bucket(tokens: int | None) -> str:
    """The `prompt_tokens` label of a prompt: the smallest bound it fits under, or +Inf (UNKNOWN_LENGTH: None)."""
    if tokens is None:
        return UNKNOWN_LENGTH
    for bound in PROMPT_LENGTH_BOUNDS:
        if tokens <= bound:
            return str(bound)
    return "+Inf"


class RouterMetrics:
    """The router's metrics; one instance per app, passed to whoever records.

    `multiprocess`: this process is one of several workers (see the module's docstring); it takes
    effect only when prometheus-client writes to files (MULTIPROC_DIR_ENV set before it was imported).
    """

    def __init__(self, *, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess and MULTIPROC_DIR_ENV in os.environ
        # Scrape-time gauges a worker copies to its files: (gauge, labels) -> (series, reader).
        self._published: dict[tuple[int, tuple[str, ...]], tuple[Gauge, Callable[[], float]]] = {}
        self._publishers: list[Callable[[], None]] = []
        self._local_collectors: list[Collector] = []  # scraped from the answering worker alone
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests finished, by model, arm, API (chat, completion, messages, responses), path and outcome.",
            ["model", "arm", "api", "path", "outcome"],
            registry=r,
        )
        self.route_decisions = Counter(
            f"{PREFIX}_route_decisions",
            "Routing decisions by model, arm, the path taken and the reason for it.",
            ["model", "arm", "path", "reason"],
            registry=r,
        )
        # Its children by label values, built once: labels() checks, converts and looks each up under a lock.
        self._route_decisions: dict[tuple[str, str, str, str], Counter] = {}
        self.prefill_fallbacks = Counter(
            f"{PREFIX}_prefill_fallbacks",
            "Disaggregated requests served on the decoder alone because the prefill hop failed, by model and reason.",
            ["model", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from a streamed request's arrival to its first token relayed, by model, arm, path and prompt length.",
            ["model", "arm", "path", "prompt_tokens"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Gaps between output chunks relayed to streaming clients, by model, arm, path and prompt length.",
            ["model", "arm", "path", "prompt_tokens"],
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            f"{PREFIX}_phase_seconds",
            "Where the time to first token went, by model, arm, path and phase; a request's phases add up to its TTFT.",
            ["model", "arm", "path", "phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.uncached_prompt_tokens = Counter(
            f"{PREFIX}_uncached_prompt_tokens",
            "Prompt tokens the serving engines computed (not cached on the chosen decoder), by model, arm and path.",
            ["model", "arm", "path"],
            registry=r,
        )
        self.kv_transfer_ineffective = Counter(
            f"{PREFIX}_kv_transfer_ineffective",
            "Disaggregated requests whose decoder computed the prompt anyway: a KV connector misconfiguration.",
            registry=r,
        )
        self.orphaned_prefills = Counter(
            f"{PREFIX}_orphaned_prefills",
            "Prefill calls whose client left while they ran, by outcome (released, cut, failed).",
            ["outcome"],
            registry=r,
        )
        self.kv_released = Counter(
            f"{PREFIX}_kv_released",
            "Staged KV no decoder answered a call for, released by the router, by connector.",
            ["connector"],
            registry=r,
        )
        self.config_reloads = Counter(
            f"{PREFIX}_config_reloads",
            "Live configuration changes, by source (file, sighup, admin, peer) and outcome.",
            ["source", "outcome"],
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_latency_seconds",
            "Time from the request's arrival to its last byte, by model, arm, path and prompt length.",
            ["model", "arm", "path", "prompt_tokens"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenize = Histogram(
            f"{PREFIX}_tokenize_seconds",
            "Time spent counting the prompt's tokens.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            f"{PREFIX}_prefill_seconds",
            "Duration of the prefill hop (the KV-staging call to a prefiller), by model and outcome.",
            ["model", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            f"{PREFIX}_prompt_tokens",
            "Prompt tokens per request, by model, arm and path.",
            ["model", "arm", "path"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            f"{PREFIX}_output_tokens",
            "Output tokens per request as the decoder reported them, by model, arm and path.",
            ["model", "arm", "path"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_in_flight_requests", "Requests being served now.", registry=r, multiprocess_mode="livesum"
        )
        self.routing_threshold = Gauge(
            f"{PREFIX}_routing_threshold_tokens",
            "Prompt tokens at or above which a request of the model is disaggregated.",
            ["model"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.endpoint_healthy = Gauge(
            f"{PREFIX}_endpoint_healthy",
            "1 when the endpoint may receive traffic, 0 when it is marked unhealthy.",
            ["endpoint", "role"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.endpoint_breaker_open = Gauge(
            f"{PREFIX}_endpoint_circuit_open",
            "1 while the endpoint's circuit breaker refuses new calls (open), else 0.",
            ["endpoint", "role"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.endpoint_breaker_opened = Gauge(
            f"{PREFIX}_endpoint_circuit_opened",
            "How many times the endpoint's circuit breaker has opened since the router started.",
            ["endpoint", "role"],
            registry=r,
            multiprocess_mode="sum",
        )
        self.stream_continuations = Counter(
            f"{PREFIX}_stream_continuations",
            "Streams whose decoder failed after output, by API and outcome (continued, failed, not_tried) and reason.",
            ["api", "outcome", "reason"],
            registry=r,
        )
        self.retries = Counter(
            f"{PREFIX}_retries",
            "Calls retried on another engine, by hop (prefill, decode).",
            ["hop"],
            registry=r,
        )
        self.background_encodes_skipped = Counter(
            f"{PREFIX}_background_encodes_skipped",
            "Prompts read in part not encoded whole: the background encoder's backlog was full.",
            registry=r,
        )
        self.last_resort_routes = Counter(
            f"{PREFIX}_last_resort_routes",
            "Requests sent to a decoder failing its health probes (and nothing else) because no decoder passed them.",
            registry=r,
        )
        self.client_disconnects = Counter(
            f"{PREFIX}_client_disconnects",
            "Clients that went away before their answer ended, by the phase they left in.",
            ["phase"],
            registry=r,
        )
        self.queue_depth = Gauge(
            f"{PREFIX}_admission_queue_depth",
            "Requests waiting for an in-flight slot, by admission budget (pool: shared, or a tenant's).",
            ["pool"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queue_wait = Histogram(
            f"{PREFIX}_admission_queue_wait_seconds",
            "Time requests waited in the admission queue (admitted or not).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.admission_rejected = Counter(
            f"{PREFIX}_admission_rejected",
            "Requests refused for capacity, by reason and the admission budget that refused them.",
            ["reason", "pool"],
            registry=r,
        )
        self.rate_limited = Counter(
            f"{PREFIX}_rate_limited",
            "Requests refused by per-key rate limits, by limit (requests, prompt_tokens).",
            ["limit"],
            registry=r,
        )
        self.limits_store_errors = Counter(
            f"{PREFIX}_limits_store_errors",
            "Per-key limit checks the shared limits store failed or answered too slowly.",
            registry=r,
        )
        self.responses_store_errors = Counter(
            f"{PREFIX}_responses_store_errors",
            "Calls to the Responses store that failed, by operation.",
            registry=r,
        )
        self.auth_failures = Counter(
            f"{PREFIX}_auth_failures", "Requests refused for a missing, unknown or insufficient API key.", registry=r
        )
        self.auth_throttled = Counter(
            f"{PREFIX}_auth_throttled",
            "Requests refused with 429, unchecked, from addresses that failed to authenticate too often.",
            registry=r,
        )
        self.endpoint_in_flight = Gauge(
            f"{PREFIX}_endpoint_in_flight_requests",
            "Calls the router has open to the endpoint now.",
            ["endpoint", "role"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.endpoint_load = Gauge(
            f"{PREFIX}_endpoint_load",
            "Engine load from the endpoint's last good /metrics scrape, by signal.",
            ["endpoint", "role", "signal"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.load_scrapes = Counter(
            f"{PREFIX}_load_scrapes",
            "Scrapes of engine /metrics, by outcome (ok, timeout, error, unreadable, status_Nxx).",
            ["endpoint", "role", "outcome"],
            registry=r,
        )
        self.cache_index_blocks = Gauge(
            f"{PREFIX}_cache_index_blocks",
            "Blocks held in the router's cache indexes (prefix: its own placements; kv_events: engines' reports).",
            ["index"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.kv_events = Counter(
            f"{PREFIX}_kv_events",
            "KV-cache events from engines, by kind (stored, removed, cleared, skipped, undecodable, gap, restart).",
            ["endpoint", "kind"],
            registry=r,
        )
        self.kv_lookups = Counter(
            f"{PREFIX}_kv_lookups",
            "LMCache controller lookups on the request path, by outcome (hit, miss, timeout, error).",
            ["outcome"],
            registry=r,
        )

        self.discovery_events = Counter(
            f"{PREFIX}_discovery_events",
            "Kubernetes discovery events, by role and event.",
            ["role", "event"],
            registry=r,
        )
        self.adapter_loads = Counter(
            f"{PREFIX}_adapter_loads",
            "LoRA adapters the router loaded on engines (lora_adapters), by engine role and outcome.",
            ["role", "outcome"],
            registry=r,
        )
        self.shadow_requests = Counter(
            f"{PREFIX}_shadow_requests",
            'Shadow copies sent, by outcome; their latencies are in the request metrics under arm="shadow".',
            ["outcome"],
            registry=r,
        )
        self.shadow_dropped = Counter(
            f"{PREFIX}_shadow_dropped",
            "Shadow copies dropped unsent, by reason (queue_full, closed).",
            ["reason"],
            registry=r,
        )

    def watch_endpoint(self, endpoint: Endpoint) -> None:
        """Export the endpoint's live state; in-flight, health and load are read at scrape time, O(1)."""
        labels = (endpoint.url, endpoint.role)
        self._watch(self.endpoint_in_flight, labels, lambda: endpoint.in_flight)
        self._watch(self.endpoint_healthy, labels, lambda: 1 if endpoint.available else 0)
        self._watch(self.endpoint_breaker_open, labels, lambda: 0 if endpoint.breaker.allows() else 1)
        self._watch(self.endpoint_breaker_opened, labels, lambda: endpoint.breaker.times_opened)
        for signal, read in _LOAD_SIGNALS.items():
            self._watch(self.endpoint_load, (*labels, signal), _load_reader(endpoint, read))

    def _watch(self, gauge: Gauge, labels: tuple[str, ...], read: Callable[[], float]) -> None:
        """Export `read()` as the gauge's series: at scrape time, or (a worker) copied every PUBLISH_INTERVAL."""
        series = gauge.labels(*labels)
        if self.multiprocess:
            self._published[(id(gauge), labels)] = (series, read)
        else:
            series.set_function(read)

    def route_decision(self, model: str | None, arm: str, path: str, reason: str) -> Counter:
        """The counter of one routing decision (`route_decisions`' child, built once)."""
        key = (model_label(model), arm, path, reason)
        child = self._route_decisions.get(key)
        if child is None:
            child = self._route_decisions[key] = self.route_decisions.labels(*key)
        return child

    def forget_endpoint(self, endpoint: Endpoint) -> None:
        """Stop exporting an endpoint that left the pool, so series of departed engines do not pile up."""
        labels = (endpoint.url, endpoint.role)
        series: list[tuple[Gauge | Counter, tuple[str, ...]]] = [
            (gauge, labels)
            for gauge in (
                self.endpoint_in_flight,
                self.endpoint_healthy,
                self.endpoint_breaker_open,
                self.endpoint_breaker_opened,
            )
        ]
        series += [(self.endpoint_load, (*labels, signal)) for signal in _LOAD_SIGNALS]
        series += [(self.load_scrapes, (*labels, outcome)) for outcome in _SCRAPE_OUTCOMES]
        for metric, values in series:
            # A worker's files keep the series' last value (they cannot drop one) until the worker ends.
            self._published.pop((id(metric), values), None)
            with contextlib.suppress(KeyError):  # prometheus-client before 0.21 raises for an absent series
                metric.remove(*values)

    def watch_cache_index(self, name: str, size: Callable[[], int]) -> None:
        self._watch(self.cache_index_blocks, (name,), size)

    def watch_adaptive(
        self,
        thresholds: Callable[[], Iterable[tuple[str, float]]],
        costs: Callable[[], Iterable[tuple[str, str, str, float]]],
    ) -> None:
        """Export the adaptive model, read at scrape time: the effective threshold per decoder at its
        present load, and the learned costs (model, endpoint, term -> value)."""
        collector = _AdaptiveCollector(thresholds, costs)
        self.registry.register(collector)
        self._local_collectors.append(collector)

    def watch_refused_connections(self, counts: Mapping[str, int], reasons: Iterable[str]) -> None:
        """Export the listener's count of connections it closed, by reason (read at scrape time; a
        worker adds what it closed since its last copy to a counter every worker's add up in)."""
        if not self.multiprocess:
            self.registry.register(_RefusedConnectionsCollector(counts, tuple(reasons)))
            return
        counter = Counter(f"{PREFIX}_connections_refused", REFUSED_HELP, ["reason"], registry=self.registry)
        copied: collections.Counter[str] = collections.Counter()
        reasons = tuple(reasons)
        for reason in reasons:
            counter.labels(reason)

        def publish() -> None:
            for reason in reasons:
                now = counts.get(reason, 0)
                if now > copied[reason]:
                    counter.labels(reason).inc(now - copied[reason])
                    copied[reason] = now

        self._publishers.append(publish)

    def publish(self) -> None:
        """Copy this worker's scrape-time values into its multiprocess files."""
        for series, read in list(self._published.values()):
            series.set(read())
        for publish in self._publishers:
            publish()

    async def publish_every(self, seconds: float = PUBLISH_INTERVAL) -> None:
        while True:
            self.publish()
            await asyncio.sleep(seconds)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(NoCreatedSeries(self.registry))
        self.publish()  # the answering worker's own values as they are now
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # prometheus-client leaves it untyped
        for collector in self._local_collectors:
            registry.register(collector)
        return generate_latest(NoCreatedSeries(registry))


class NoCreatedSeries:
    """A registry's families without their `_created` samples: prometheus-client adds one to every counter and
    histogram series (a third of the exposition), which no dashboard, alert or `advise` reads, and which
    vLLM and most exporters turn off. Filtered here, not by prometheus-client's process-wide switch."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [sample for sample in family.samples if not sample.name.endswith("_created")]
            yield family


_LOAD_SIGNALS: dict[str, Callable[[EngineLoad], float | None]] = {
    "running": lambda load: load.running,
    "waiting": lambda load: load.waiting,
    "kv_cache_usage": lambda load: load.kv_cache_usage,
    "prefix_cache_hit_rate": lambda load: load.prefix_cache_hit_rate,
    "age_seconds": lambda load: time.monotonic() - load.scraped_at,
}


# Every `outcome` label value of load_scrapes (pool/scrape.py).
_SCRAPE_OUTCOMES = ("ok", "timeout", "error", "unreadable", *(f"status_{n}xx" for n in range(1, 6)))


def _load_reader(endpoint: Endpoint, read: Callable[[EngineLoad], float | None]) -> Callable[[], float]:
    """A load signal for export; NaN until the endpoint has been scraped or when it lacks the signal."""

    def current() -> float:
        value = read(endpoint.load) if endpoint.load is not None else None
        return math.nan if value is None else value

    return current


REFUSED_HELP = (
    "Client connections the listener answered 408 or 431 and closed: headers or body not in time "
    "(header_timeout, body_timeout), headers too large or too many (header_too_large, too_many_headers)."
)


class _RefusedConnectionsCollector(Collector):
    def __init__(self, counts: Mapping[str, int], reasons: tuple[str, ...]) -> None:
        self._counts = counts
        self._reasons = reasons

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(f"{PREFIX}_connections_refused", REFUSED_HELP, labels=["reason"])
        for reason in self._reasons:
            family.add_metric([reason], self._counts.get(reason, 0))
        yield family


class _AdaptiveCollector(Collector):
    def __init__(
        self,
        thresholds: Callable[[], Iterable[tuple[str, float]]],
        costs: Callable[[], Iterable[tuple[str, str, str, float]]],
    ) -> None:
        self._thresholds = thresholds
        self._costs = costs

    def collect(self) -> Iterable[Metric]:
        threshold = GaugeMetricFamily(
            f"{PREFIX}_adaptive_threshold_tokens",
            "The prompt length (uncached tokens) at which threshold_mode adaptive would disaggregate now, "
            "given the decoder's running streams and queued direct prefills and the least-queued prefiller "
            "(+Inf: it would not).",
            labels=["decoder"],
        )
        for decoder, tokens in self._thresholds():
            threshold.add_metric([decoder], tokens)
        yield threshold
        cost = GaugeMetricFamily(
            f"{PREFIX}_adaptive_cost",
            "Costs the adaptive threshold learned: model (direct_prefill and direct_wait per decoder, "
            "prefill_hop per prefiller, prefill_hop_slo: the same calls on a neutral prior, which the SLOs "
            "judge the hop by, handoff), term (overhead_seconds, seconds_per_token, observations); and "
            "per decoder model itl_budget: its recent inter-token gaps (recent_gaps), the pauses longer than "
            "itl_slo direct prefills put in them (late_gaps), their ratio (late_share), fading with time.",
            labels=["model", "endpoint", "term"],
        )
        for model, endpoint, term, value in self._costs():
            cost.add_metric([model, endpoint, term], value)
        yield cost
