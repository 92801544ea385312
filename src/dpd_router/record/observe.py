"""What one request did, recorded once at its end: the metrics and the one log line."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import Counter, Histogram

from dpd_router.record.metrics import RouterMetrics, model_label, observe_each, prompt_length_bucket
from dpd_router.record.outcome import Outcome

log = logging.getLogger("dpd_router.request")

# The `arm` label of requests no experiment arm took.
DEFAULT_ARM = "live"

# Inter-token gaps kept per request for the ITL histogram: enough for long answers, bounded memory.
MAX_RECORDED_GAPS = 4096


class Output:
    """What the decode hop produced for one request's client: the decoder of its last call and when that call
    started, when the chunks of tokens came, and the token counts the engine's usage reported. The relay (and
    a stream's continuation, or a head the router sent itself) marks it as the answer goes by; the request's
    record takes it once, when the request ends (`RequestTrace.take`). What waits on the engine's count (a
    prompt counted whole later) reads it here."""

    __slots__ = (
        "cached_tokens",
        "completion_tokens",
        "decode_started",
        "decoder",
        "decoder_cached_tokens",
        "first_token_at",
        "gaps",
        "last_chunk_at",
        "prompt_tokens",
        "token_chunks",
    )

    def __init__(self) -> None:
        # The decoder of the last decode call (None: none, or the prefill's own answer), and when it started.
        self.decoder: str | None = None
        self.decode_started: float | None = None
        self.first_token_at: float | None = None
        self.last_chunk_at: float | None = None
        self.token_chunks = 0
        # The gaps between chunks (at most MAX_RECORDED_GAPS): the ITL histogram's.
        self.gaps: list[float] = []
        # The prompt's tokens as the engine counted them, when its usage said.
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        # The cache hit the client is told (the prefiller's where the KV came from one), and the decoder's own.
        self.cached_tokens: int | None = None
        self.decoder_cached_tokens: int | None = None

    def mark_token_chunk(self, now: float) -> None:
        self.mark_token_chunks(now, 1)

    def mark_token_chunks(self, now: float, count: int) -> None:
        """`count` chunks with output tokens that reached the router together at `now` (one read's): the first
        ends the gap since the last chunk (or is the first token), the others follow it with none."""
        if count <= 0:
            return
        gaps = self.gaps
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_chunk_at is not None and len(gaps) < MAX_RECORDED_GAPS:
            gaps.append(now - self.last_chunk_at)
        if count > 1:
            gaps.extend([0.0] * min(count - 1, MAX_RECORDED_GAPS - len(gaps)))
        self.last_chunk_at = now
        self.token_chunks += count


class Staging:
    """What the prefill hop produced for one request: the prefiller of its last call, when that call started
    and how long it took, why an earlier one failed, whether it ran beside the decode call, the prompt tokens
    it staged, and whether the decoder's usage can show the transfer. The hop and the hop shapes write it as
    they stage; the request's record takes it once, when the request ends (`RequestTrace.take`)."""

    __slots__ = ("error", "overlaps_decode", "prefiller", "seconds", "staged_tokens", "started", "usage_shows_transfer")

    def __init__(self) -> None:
        self.prefiller: str | None = None
        self.started: float | None = None
        self.seconds: float | None = None
        self.error: str | None = None
        # The prefill call ran beside the decode call (a concurrent connector: SGLang), not before it.
        self.overlaps_decode = False
        self.staged_tokens: int | None = None
        # vLLM >= 0.32 decoders report the prefiller's cache hit (kv_transfer_params.remote_prefill_cached_tokens)
        # instead of the tokens they pulled: their usage cannot show whether the KV arrived.
        self.usage_shows_transfer = True


class Ending:
    """How a request ended: its status, outcome and error (the last failure recorded; ok without one), and
    what became of a stream whose decoder failed after output (continued elsewhere, or why not). Whatever
    ends the request records it here (the handler, the decode hop, the relay, a stream's continuation); the
    request's record takes it once, when the request ends (`RequestTrace.take`)."""

    __slots__ = ("continuations", "continued_after", "error", "outcome", "status")

    def __init__(self) -> None:
        self.status = 200
        self.outcome = "ok"
        self.error: str | None = None
        # Times the stream was continued on another decoder after its decoder failed (gateway/resume.py),
        # and the failure it was continued after (or why it was not).
        self.continuations = 0
        self.continued_after: str | None = None

    def fail(self, outcome: str, error: str, status: int | None = None) -> None:
        self.outcome = outcome
        self.error = error
        if status is not None:
            self.status = status


@dataclass(frozen=True)
class Asked:
    """Who asked, and for what: known as the request starts and never changed after. The hops read it (a
    metric's labels, a continuation's start); the record takes it when the request ends."""

    request_id: str
    kind: str
    stream: bool
    started: float  # a perf_counter reading: when the request reached the router
    queue_seconds: float = 0.0
    tenant: str | None = None
    model: str | None = None
    adapter: str | None = None
    key_id: str | None = None
    arm: str = DEFAULT_ARM


@dataclass
class RequestTrace:
    """The facts of one request: who asked, how it was planned and served, how it ended. Written when it ends
    (gateway/completion.py), from who asked (`Asked`), the prompt as read, what the hops produced (`Output`,
    `Staging`), how it ended (`Ending`) and its plans; its report may add the prompt's count after that."""

    request_id: str
    kind: str
    stream: bool
    started: float = field(default_factory=time.perf_counter)
    queue_seconds: float = 0.0
    decode_started: float | None = None
    tenant: str | None = None
    # The served model whose engines serve the request (None: a lone model not yet named).
    model: str | None = None
    # The LoRA adapter of that model it named, if any.
    adapter: str | None = None
    # The caller's API key id (the first 12 hex digits of its hash; "anonymous" with auth off).
    key_id: str | None = None
    # The experiment arm whose routing settings served the request (DEFAULT_ARM without experiments).
    arm: str = DEFAULT_ARM
    path: str = "direct"
    reason: str = ""
    threshold: int | None = None
    prompt_tokens: int | None = None
    uncached_tokens: int | None = None
    # Streams running on the chosen decoder when the request was planned (what a direct prefill stalls).
    decoder_streams: float = 0.0
    # Prompt tokens queued on the prefiller when an adaptive plan chose it (None otherwise).
    prefiller_queue: float | None = None
    # Prompt tokens of streamed direct requests on the decoder before their first token, when planned.
    decoder_queue: float = 0.0
    tokenize_seconds: float | None = None
    prefiller: str | None = None
    decoder: str | None = None
    prefill_started: float | None = None
    prefill_seconds: float | None = None
    prefill_error: str | None = None
    # The prefill call ran beside the decode call (a concurrent connector: SGLang), not before it.
    prefill_overlaps_decode: bool = False
    first_token_at: float | None = None
    last_chunk_at: float | None = None
    token_chunks: int = 0
    completion_tokens: int | None = None
    # The prompt's tokens as the engine counted them (its usage), when it said.
    engine_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    decoder_cached_tokens: int | None = None
    staged_tokens: int | None = None
    # Whether the decoder's usage can show the transfer: vLLM >= 0.32 decoders report the prefiller's
    # cache hit (kv_transfer_params.remote_prefill_cached_tokens) instead of the tokens they pulled.
    usage_shows_transfer: bool = True
    # Times the stream was continued on another decoder after its decoder failed (gateway/resume.py),
    # and the failure it was continued after (or why it was not).
    continuations: int = 0
    continued_after: str | None = None
    status: int = 200
    outcome: str = "ok"
    error: str | None = None
    finished: bool = False

    gaps: list[float] = field(default_factory=list, repr=False)

    def take(
        self,
        output: Output,
        staging: Staging | None = None,
        ending: Ending | None = None,
        *,
        asked: Asked | None = None,
        prompt: tuple[int | None, float | None] | None = None,
    ) -> None:
        """Who asked, the prompt as read (its tokens, None where its count comes later, and the seconds its
        reading took), what the decoders (and the prefill hop) produced, and how the request ended, put on the
        record as the request ends."""
        if asked is not None:
            self.started, self.queue_seconds = asked.started, asked.queue_seconds
            self.tenant, self.model, self.adapter = asked.tenant, asked.model, asked.adapter
            self.key_id, self.arm = asked.key_id, asked.arm
        if prompt is not None:
            self.prompt_tokens, self.tokenize_seconds = prompt
        if ending is not None:
            self.status, self.outcome, self.error = ending.status, ending.outcome, ending.error
            self.continuations, self.continued_after = ending.continuations, ending.continued_after
        if staging is not None:
            self.prefiller, self.prefill_started, self.prefill_seconds = (
                staging.prefiller,
                staging.started,
                staging.seconds,
            )
            self.prefill_error, self.prefill_overlaps_decode = staging.error, staging.overlaps_decode
            self.staged_tokens, self.usage_shows_transfer = staging.staged_tokens, staging.usage_shows_transfer
        self.decoder, self.decode_started = output.decoder, output.decode_started
        self.first_token_at, self.last_chunk_at = output.first_token_at, output.last_chunk_at
        self.token_chunks, self.gaps = output.token_chunks, output.gaps
        self.engine_prompt_tokens, self.completion_tokens = output.prompt_tokens, output.completion_tokens
        self.cached_tokens, self.decoder_cached_tokens = output.cached_tokens, output.decoder_cached_tokens


def outcome_of(trace: RequestTrace) -> Outcome:
    """The record learners get of a finished request."""
    first_token = None
    if trace.first_token_at is not None and trace.decode_started is not None:
        first_token = trace.first_token_at - trace.decode_started
    return Outcome(
        ok=trace.outcome == "ok",
        path=trace.path,
        stream=trace.stream,
        uncached_tokens=trace.uncached_tokens,
        prefiller=trace.prefiller,
        decoder=trace.decoder,
        decoder_streams=trace.decoder_streams,
        decoder_queue=trace.decoder_queue,
        prefiller_queue=trace.prefiller_queue,
        prefill_seconds=trace.prefill_seconds,
        prefill_retried=trace.prefill_error is not None,
        prefill_overlaps_decode=trace.prefill_overlaps_decode,
        first_token_seconds=first_token,
        token_gaps=max(trace.token_chunks - 1, 0),
        arm=trace.arm,
        model=trace.model,
    )


class SpanSink(Protocol):
    def export(self, trace: RequestTrace, ended: float) -> None: ...


class _Series:
    """One model, arm and path's metric children, bound once: a request's metrics cost no label lookups."""

    def __init__(self, metrics: RouterMetrics, model: str, arm: str, path: str) -> None:
        self._metrics = metrics
        self._labels = (model, arm, path)
        self.prompt_tokens = metrics.prompt_tokens.labels(*self._labels)
        self.output_tokens = metrics.output_tokens.labels(*self._labels)
        self.uncached_prompt_tokens = metrics.uncached_prompt_tokens.labels(*self._labels)
        self._requests: dict[tuple[str, str], Counter] = {}
        self._histograms: dict[tuple[int, str], Histogram] = {}

    def requests(self, api: str, outcome: str) -> Counter:
        child = self._requests.get((api, outcome))
        if child is None:
            model, arm, path = self._labels
            child = self._requests[(api, outcome)] = self._metrics.requests.labels(model, arm, api, path, outcome)
        return child

    def phase(self, name: str) -> Histogram:
        return self.child(self._metrics.phase, name)

    def child(self, histogram: Histogram, label: str) -> Histogram:
        """`histogram`'s child for this model, arm and path and its last label (a prompt-length bucket, a phase)."""
        key = (id(histogram), label)
        child = self._histograms.get(key)
        if child is None:
            child = self._histograms[key] = histogram.labels(*self._labels, label)
        return child


# Finished requests the operator console lists (their log lines' fields, kept as they were logged).
RECENT_REQUESTS = 300


class Observer:
    """Turns finished traces into metrics, one structured log line each, and optional spans; keeps the
    last few hundred log lines' fields for the operator console."""

    def __init__(
        self,
        metrics: RouterMetrics,
        spans: SpanSink | None = None,
        listeners: Sequence[Callable[[Outcome], None]] = (),
    ) -> None:
        self.metrics = metrics
        self.spans = spans
        self.listeners = list(listeners)
        # (wall-clock end, the log line's fields) of the last requests.
        self.recent: collections.deque[tuple[float, dict[str, Any]]] = collections.deque(maxlen=RECENT_REQUESTS)
        self._series: dict[tuple[str, str, str], _Series] = {}

    def finish(self, trace: RequestTrace, *, ended: float | None = None) -> None:
        """Record the request; `ended` (a perf_counter reading) when it ended before it is reported."""
        if trace.finished:
            return
        trace.finished = True
        now = time.perf_counter() if ended is None else ended
        self.record(trace, now)
        if transfer_was_ineffective(trace):
            self.metrics.kv_transfer_ineffective.inc()
            log.warning(
                "KV transfer ineffective for request %s: the decoder %s reported %s cached prompt tokens of the %s "
                "the prefiller %s staged, so it recomputed the prompt. Check that both engines run the same "
                "kv_connector and can reach each other's side channel (vLLM logs 'Retrieved 0 out of N required "
                "tokens' on the decoder).",
                trace.request_id,
                trace.decoder,
                trace.decoder_cached_tokens,
                trace.staged_tokens,
                trace.prefiller,
                extra={"fields": {"request_id": trace.request_id, "event": "kv_transfer_ineffective"}},
            )
        self._log(trace, now)
        if self.spans is not None:
            self.spans.export(trace, now)
        if self.listeners:
            outcome = outcome_of(trace)
            for listener in self.listeners:
                listener(outcome)

    def record(self, trace: RequestTrace, now: float) -> None:
        """The request's latency and size metrics, under its arm and path (a shadow copy's too)."""
        series = self._series_of(model_label(trace.model), trace.arm, trace.path)
        series.requests(trace.kind, trace.outcome).inc()
        e2e = now - trace.started
        bucket = prompt_length_bucket(trace.prompt_tokens)
        series.child(self.metrics.e2e, bucket).observe(e2e)
        if trace.uncached_tokens is not None:
            series.uncached_prompt_tokens.inc(trace.uncached_tokens)
        # A whole (non-streamed) answer has no first token to time: TTFT and its phases are for streams.
        if trace.stream and trace.first_token_at is not None:
            series.child(self.metrics.ttft, bucket).observe(trace.first_token_at - trace.started)
            self._observe_phases(trace, series)
            if trace.gaps:
                observe_each(series.child(self.metrics.itl, bucket), trace.gaps)
        if trace.prompt_tokens is not None:
            series.prompt_tokens.observe(trace.prompt_tokens)
        if trace.completion_tokens is not None:
            series.output_tokens.observe(trace.completion_tokens)

    def _series_of(self, model: str, arm: str, path: str) -> _Series:
        series = self._series.get((model, arm, path))
        if series is None:
            series = self._series[(model, arm, path)] = _Series(self.metrics, model, arm, path)
        return series

    @staticmethod
    def _observe_phases(trace: RequestTrace, series: _Series) -> None:
        """Split the TTFT into what each step took; `router` is the rest (parsing, planning, and
        waiting for the event loop), so the phases of a request add up to its TTFT."""
        assert trace.first_token_at is not None
        measured = {
            "queue": trace.queue_seconds,
            "tokenize": trace.tokenize_seconds,
            # A prefill running beside the decode call is inside `first_token` already.
            "prefill": None if trace.prefill_overlaps_decode else trace.prefill_seconds,
            "first_token": None if trace.decode_started is None else trace.first_token_at - trace.decode_started,
        }
        accounted = 0.0
        for name, seconds in measured.items():
            if seconds is not None:
                series.phase(name).observe(seconds)
                accounted += seconds
        ttft = trace.first_token_at - trace.started
        series.phase("router").observe(max(ttft - accounted, 0.0))

    def _log(self, trace: RequestTrace, now: float) -> None:
        fields: dict[str, Any] = {
            "request_id": trace.request_id,
            "model": trace.model,
            "adapter": trace.adapter,
            "tenant": trace.tenant,
            "key_id": trace.key_id,
            "kind": trace.kind,
            "stream": trace.stream,
            "arm": trace.arm,
            "path": trace.path,
            "reason": trace.reason,
            "prompt_tokens": trace.prompt_tokens,
            "uncached_tokens": trace.uncached_tokens,
            "threshold": trace.threshold,
            # What a direct prefill would have stalled, and (adaptive) the prefill queue it weighed.
            "decoder_streams": trace.decoder_streams,
            "prefiller_queue_tokens": trace.prefiller_queue,
            "decoder_queue_tokens": trace.decoder_queue,
            "prefiller": trace.prefiller,
            "decoder": trace.decoder,
            "cached_tokens": trace.cached_tokens,
            "decoder_cached_tokens": trace.decoder_cached_tokens,
            "completion_tokens": trace.completion_tokens,
            "queue_ms": _ms(trace.queue_seconds),
            "tokenize_ms": _ms(trace.tokenize_seconds),
            "prefill_ms": _ms(trace.prefill_seconds),
            "ttft_ms": _ms(None if trace.first_token_at is None else trace.first_token_at - trace.started),
            "e2e_ms": _ms(now - trace.started),
            "status": trace.status,
            "outcome": trace.outcome,
        }
        if trace.prefill_error:
            fields["prefill_error"] = trace.prefill_error
        if trace.continued_after is not None:
            fields["continuations"] = trace.continuations
            fields["continued_after"] = trace.continued_after
        if trace.error:
            fields["error"] = trace.error
        level = logging.INFO if trace.outcome in ("ok", "client_disconnect") else logging.WARNING
        log.log(
            level,
            "Conditional routing: tokens=%s, threshold=%s, disaggregate=%s",
            trace.prompt_tokens,
            trace.threshold,
            trace.path == "disaggregated",
            extra={"fields": fields},
        )
        self.recent.append((time.time(), fields))


# A decoder that reports fewer cached prompt tokens than this share of what the prefiller staged
# did not get the KV (engines always recompute the last token, and may miss a partial block).
INEFFECTIVE_BELOW_SHARE = 0.5


def transfer_was_ineffective(trace: RequestTrace) -> bool:
    """A disaggregated request whose decoder reported recomputing the staged prompt."""
    if trace.path != "disaggregated" or trace.outcome != "ok":
        return False
    if trace.decoder_cached_tokens is None or not trace.staged_tokens or not trace.usage_shows_transfer:
        return False
    return trace.decoder_cached_tokens < trace.staged_tokens * INEFFECTIVE_BELOW_SHARE


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
