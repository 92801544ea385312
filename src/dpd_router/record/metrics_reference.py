"""The metric reference (docs/metrics.md): every family RouterMetrics exposes, generated from the code.

A HELP text is one line (`/metrics` is read by people and tools alike); what a family's labels mean and
when it moves, where a line is not enough, is in DETAILS, which only the reference shows.
"""

from __future__ import annotations

from prometheus_client.metrics import MetricWrapperBase

from dpd_router.record.metrics import RouterMetrics

# The longer account of a family, by its name, for the reference.
DETAILS: dict[str, str] = {
    "dpd_router_time_to_first_token_seconds": (
        "Time from a streamed request's arrival to its first token relayed, by arm, path and prompt-length "
        "bucket (`prompt_tokens`, the bucket's upper bound in tokens; empty when no count came back): the "
        "evidence for choosing the routing threshold. Sum over `prompt_tokens` for TTFT by path."
    ),
    "dpd_router_e2e_latency_seconds": (
        "Time from arrival to the last byte by arm, path and prompt-length bucket (`prompt_tokens`, as for "
        "TTFT): with TTFT and ITL by prompt length, what compares arms and the shadow."
    ),
    "dpd_router_inter_token_latency_seconds": (
        "Gaps between consecutive output chunks relayed to streaming clients, by arm, path and the stream's "
        "prompt-length bucket (`prompt_tokens`, as for TTFT). A stream's chunk holds one token or more."
    ),
    "dpd_router_phase_seconds": (
        "Where the time to first token went, by arm, path and phase: queue (admission wait), tokenize, "
        "prefill (the KV-staging call), first_token (decode call start to the first token relayed), router "
        "(the rest: parsing, planning, waiting for the event loop). A request's phases add up to its TTFT."
    ),
    "dpd_router_uncached_prompt_tokens": (
        "Prompt tokens the serving engines had to compute (the prompt minus the prefix already cached on the "
        "chosen decoder, as the router estimates it), by arm and path: the prefill work each pool does."
    ),
    "dpd_router_stream_continuations": (
        "Streams whose decoder failed after the client saw output (a reset connection, an in-band error, a "
        "stream cut short, the idle limit), by the client's `api` and `outcome`: `continued` on another "
        "decoder, `failed` (no decoder could take the continuation), `not_tried`, with the `reason` "
        "(`n`, `structured_output`, `tools`, `logprobs`, `parsed_output`, `no_token_ids`, `too_long`, "
        "`no_output`, `deadline`, `limit`, `disabled`, `connector`, `answer_complete`, ...)."
    ),
    "dpd_router_kv_transfer_ineffective": (
        "Disaggregated requests whose decoder recomputed the prompt anyway (it reported far fewer cached "
        "prompt tokens than the prefiller staged, or could not load the KV and was asked to compute the "
        "prompt): a KV connector misconfiguration."
    ),
    "dpd_router_orphaned_prefills": (
        "Prefill calls whose client left while they ran, by what became of them: released (answered within "
        "the grace, its KV released), cut (no answer within the grace: the call was cut, and KV the engine "
        "staged meanwhile waits out its lease), failed (the call failed)."
    ),
    "dpd_router_kv_released": (
        "Staged KV that no decoder answered a call for (its client left before, or its decoder was replaced),"
        " released by the router instead of waiting out the engine's hold on it, by connector (nixl: a "
        "decoder refuses the parameters and frees the prefiller's blocks; lmcache: the pushed KV is drained)."
    ),
    "dpd_router_config_reloads": (
        "Live configuration changes, by source (file, sighup, admin, peer: another worker's admin change) and"
        " outcome (applied, unchanged, rejected)."
    ),
    "dpd_router_background_encodes_skipped": (
        "Prompts planned on their first tokens that were not encoded whole because the background encoder had"
        " tokenize_background_max_chars waiting: their tail blocks go unindexed."
    ),
    "dpd_router_admission_rejected": (
        "Requests refused for capacity, by reason (queue_full, queue_timeout) and the admission budget that "
        "refused them (pool: shared, or a tenant's)."
    ),
    "dpd_router_limits_store_errors": (
        "Per-key limit checks the shared limits store (limits_store) failed or was too slow to answer; the "
        "process decided on its own share of the limit instead."
    ),
    "dpd_router_responses_store_errors": (
        "Calls to the Responses store (responses_store) that failed: responses not kept (the client had its "
        "answer; a follow-up naming one gets 404), kept not for their size, and reads answered 503."
    ),
    "dpd_router_endpoint_load": (
        "Engine load from the endpoint's last good /metrics scrape, by signal: running and waiting "
        "(requests), kv_cache_usage and prefix_cache_hit_rate (0..1), age_seconds (since that scrape)."
    ),
    "dpd_router_discovery_events": (
        "Kubernetes discovery, by role and event: added, draining, restored (ready again while draining), "
        "removed (drained), conflict (a pod the pool cannot take), relisted, watch_gone (410: relisted), "
        "watch_error (reconnected after a back-off)."
    ),
    "dpd_router_adapter_loads": (
        "LoRA adapters of `lora_adapters` the router loaded where a request needed one, by engine role and "
        "outcome (loaded, failed): a decoder's failure fails the request with a 502, a prefiller's leaves the "
        "adapter's requests to the decoders alone."
    ),
    "dpd_router_shadow_requests": (
        "Shadow copies sent, by outcome (ok, timeout, error, status_4xx, status_5xx); their latencies are in "
        'the request metrics under arm="shadow".'
    ),
    "dpd_router_shadow_dropped": (
        "Shadow copies dropped unsent, by reason (queue_full: every shadow call busy and the queue full; "
        "closed: still queued when the shadow stopped, with the router or replaced by a live change)."
    ),
}

HELP_MAX_CHARS = 120


def families() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(exposed name, type, labels, HELP) of every family, in the order RouterMetrics defines them."""
    metrics = RouterMetrics()
    out = []
    for value in vars(metrics).values():
        if not isinstance(value, MetricWrapperBase):
            continue
        # prometheus-client keeps a family's name, type, labels and HELP on the wrapper alone (no public view).
        name, kind = str(value._name), str(value._type)
        exposed = f"{name}_total" if kind == "counter" else name
        out.append((exposed, kind, tuple(str(label) for label in value._labelnames), str(value._documentation)))
    return out


def render_markdown() -> str:
    rows = ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
    for exposed, kind, labels, help_text in families():
        text = DETAILS.get(exposed.removesuffix("_total"), help_text).replace("|", "\\|")
        names = ", ".join(f"`{label}`" for label in labels) or "-"
        rows.append(f"| `{exposed}` | {kind} | {names} | {text} |")
    return "\n".join(rows) + "\n"
