"""Optional OpenTelemetry spans for each request and its two hops.

With `otel_tracing: true` and the OpenTelemetry API installed (the `otel` extra brings the SDK; the
exporter is configured the usual way, e.g. `opentelemetry-instrument` or OTEL_* variables), every
finished request becomes a `dpd_router.request` span with `dpd_router.prefill` and
`dpd_router.decode` children, built from the timestamps the request already recorded, so tracing
adds no work to the request path.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dpd_router.record.observe import RequestTrace

log = logging.getLogger("dpd_router.tracing")


class SpanExporter:
    """Turns finished traces into OpenTelemetry spans (a no-op tracer when no SDK is configured)."""

    def __init__(self, tracer: Any) -> None:
        self._tracer = tracer
        # perf_counter readings become wall-clock nanoseconds with one fixed offset.
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    @classmethod
    def create(cls) -> SpanExporter | None:
        try:
            from opentelemetry import trace
        except ImportError:
            log.warning("otel_tracing is on but opentelemetry is not installed: pip install 'dpd-router[otel]'")
            return None
        return cls(trace.get_tracer("dpd_router"))

    def _ns(self, perf_seconds: float) -> int:
        return self._offset_ns + int(perf_seconds * 1e9)

    def export(self, trace: RequestTrace, ended: float) -> None:
        from opentelemetry import trace as otel

        attributes = {
            "dpd_router.request_id": trace.request_id,
            "dpd_router.path": trace.path,
            "dpd_router.reason": trace.reason,
            "dpd_router.record.outcome": trace.outcome,
            "dpd_router.prompt_tokens": trace.prompt_tokens or 0,
            "dpd_router.completion_tokens": trace.completion_tokens or 0,
            "http.response.status_code": trace.status,
        }
        if trace.tenant:
            attributes["dpd_router.tenant"] = trace.tenant
        if trace.continued_after is not None:
            attributes["dpd_router.continuations"] = trace.continuations
            attributes["dpd_router.continued_after"] = trace.continued_after
        root = self._tracer.start_span("dpd_router.request", start_time=self._ns(trace.started), attributes=attributes)
        context = otel.set_span_in_context(root)
        if trace.prefill_started is not None and trace.prefill_seconds is not None:
            prefill = self._tracer.start_span(
                "dpd_router.prefill",
                context=context,
                start_time=self._ns(trace.prefill_started),
                attributes={"server.address": trace.prefiller or "", "dpd_router.error": trace.prefill_error or ""},
            )
            prefill.end(end_time=self._ns(trace.prefill_started + trace.prefill_seconds))
        if trace.decode_started is not None:
            decode = self._tracer.start_span(
                "dpd_router.decode",
                context=context,
                start_time=self._ns(trace.decode_started),
                attributes={"server.address": trace.decoder or ""},
            )
            if trace.first_token_at is not None:
                decode.add_event("first_token", timestamp=self._ns(trace.first_token_at))
            decode.end(end_time=self._ns(ended))
        root.end(end_time=self._ns(ended))
