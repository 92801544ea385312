"""The engine's Prometheus metrics, under vLLM's names, in a registry of the engine's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
XFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class EngineMetrics:
    """Counters, gauges and histograms a router scrapes from `/metrics`.

    prometheus_client exposes a counter `x` as `x_total`, so `vllm:prompt_tokens` comes out as
    `vllm:prompt_tokens_total`, and `vllm:nixl_num_failed_transfers` as
    `vllm:nixl_num_failed_transfers_total`, exactly as a real vLLM engine shows them.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        values = (model_name, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=self.registry).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets).labels(*values)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests on the GPU.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting for the GPU.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.nixl_num_failed_transfers = counter("vllm:nixl_num_failed_transfers", "Failed NIXL KV transfers.")
        self.nixl_num_kv_expired_reqs = counter("vllm:nixl_num_kv_expired_reqs", "KV leases that expired unread.")
        self.request_success = Counter(
            "vllm:request_success",
            "Requests that finished.",
            (*LABELS, "finished_reason"),
            registry=self.registry,
        ).labels(*values, "length")
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.nixl_xfer_time = histogram(
            "vllm:nixl_xfer_time_seconds", "Duration of successful NIXL KV transfers.", XFER_BUCKETS
        )
        self.remote_prefills = counter("sim:remote_prefills", "Prefills done for a remote decoder.")
        self.kv_transfers = counter("sim:kv_transfers", "Decodes that consumed remote KV.")
        self.local_prefills = counter("sim:local_prefills", "Requests prefilled on this engine (direct path).")

    def watch(
        self,
        *,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_cache_usage: Callable[[], float],
    ) -> None:
        """Read the load gauges from the engine's state at scrape time."""
        self.num_requests_running.set_function(running)
        self.num_requests_waiting.set_function(waiting)
        self.kv_cache_usage_perc.set_function(kv_cache_usage)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """The registry's samples minus `*_created`, which vLLM switches off."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [sample for sample in family.samples if not sample.name.endswith("_created")]
            yield family
