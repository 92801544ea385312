from __future__ import annotations

import pytest

from dpd_router.record.observe import RequestTrace
from dpd_router.record.tracing import SpanExporter

sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402


def test_a_disaggregated_request_becomes_a_span_with_prefill_and_decode_children() -> None:
    memory = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    exporter = SpanExporter(provider.get_tracer("test"))

    trace = RequestTrace(request_id="r-1", kind="chat", stream=True, path="disaggregated", reason="long_prompt")
    trace.started = 10.0
    trace.prefiller, trace.decoder = "http://p:1", "http://d:1"
    trace.prefill_started, trace.prefill_seconds = 10.01, 0.2
    trace.decode_started, trace.first_token_at = 10.22, 10.3
    exporter.export(trace, ended=11.0)

    spans = {span.name: span for span in memory.get_finished_spans()}
    assert set(spans) == {"dpd_router.request", "dpd_router.prefill", "dpd_router.decode"}
    root = spans["dpd_router.request"]
    for child in ("dpd_router.prefill", "dpd_router.decode"):
        assert spans[child].parent is not None and spans[child].parent.span_id == root.context.span_id
    assert spans["dpd_router.prefill"].end_time - spans["dpd_router.prefill"].start_time == pytest.approx(
        0.2e9, rel=1e-6
    )
    assert root.end_time - root.start_time == pytest.approx(1.0e9, rel=1e-6)
    assert root.attributes["dpd_router.request_id"] == "r-1"
    assert [event.name for event in spans["dpd_router.decode"].events] == ["first_token"]


def test_a_direct_request_has_no_prefill_span() -> None:
    memory = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace = RequestTrace(request_id="r-2", kind="chat", stream=False)
    trace.decode_started = trace.started
    SpanExporter(provider.get_tracer("test")).export(trace, ended=trace.started + 0.5)
    assert sorted(span.name for span in memory.get_finished_spans()) == ["dpd_router.decode", "dpd_router.request"]
