"""Observing many values at once gives a histogram exactly what observing them one by one does, in one
process and in prometheus-client's multiprocess mode (`--workers`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from dpd_router.record.metrics import LATENCY_BUCKETS, observe_each


def samples() -> list[float]:
    rng = random.Random(7)
    edges = list(LATENCY_BUCKETS)  # exactly on a bound goes into that bound's bucket
    return [*edges, 0.0, 1e9, *(rng.expovariate(20) for _ in range(500))]


def parsed(exposition: bytes) -> dict[str, float]:
    return {
        f"{sample.name}{sorted(sample.labels.items())}": sample.value
        for family in text_string_to_metric_families(exposition.decode())
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def same(batched: bytes, one_by_one: bytes) -> bool:
    """Every bucket and the count exactly; the sum to rounding (added in another order)."""
    ours, theirs = parsed(batched), parsed(one_by_one)
    sums = [key for key in ours if key.startswith("itl_seconds_sum")]
    assert ours.keys() == theirs.keys() and len(sums) == 1
    return all(ours[key] == theirs[key] for key in ours if key not in sums) and ours[sums[0]] == pytest.approx(
        theirs[sums[0]], rel=1e-12
    )


def observed(registry: CollectorRegistry | None, batched: bool) -> None:
    child = Histogram("itl_seconds", "gaps", ["path"], buckets=LATENCY_BUCKETS, registry=registry).labels("direct")
    if batched:
        observe_each(child, samples())
    else:
        for value in samples():
            child.observe(value)


def exposition(batched: bool) -> bytes:
    registry = CollectorRegistry()
    observed(registry, batched)
    return generate_latest(registry)


def test_values_observed_at_once_expose_what_values_observed_one_by_one_do() -> None:
    assert same(exposition(batched=True), exposition(batched=False))
    assert parsed(exposition(batched=True))["itl_seconds_count[('path', 'direct')]"] == len(samples())


def test_the_same_in_multiprocess_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    totals = []
    for batched in (True, False):
        directory = tmp_path / str(batched)
        directory.mkdir()
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        values.ValueClass = values.get_value_class()
        try:
            observed(None, batched)  # registered nowhere: the collector reads the files
            registry = CollectorRegistry()
            MultiProcessCollector(registry, str(directory))
            totals.append(generate_latest(registry))
        finally:
            monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
            values.ValueClass = values.get_value_class()
    assert same(*totals)
