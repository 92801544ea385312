"""The console's history: the charts' counters and histograms, sampled and bounded."""

from __future__ import annotations

from dpd_router.api.console import ConsoleHistory
from dpd_router.record.metrics import RouterMetrics


def test_the_history_keeps_the_last_samples_of_the_charted_series() -> None:
    metrics = RouterMetrics()
    history = ConsoleHistory(metrics, interval=5.0, keep=20.0)
    for i in range(6):
        metrics.route_decisions.labels("m", "live", "direct", "below_threshold").inc()
        metrics.ttft.labels("m", "live", "direct", "512").observe(0.01 * (i + 1))
        history.sample()
    samples = history.samples()
    assert len(samples) == 4, "20 s of 5 s samples"
    counts = [sum(row["count"] for row in s["counters"]["route_decisions_total"]) for s in samples]
    assert counts == [3, 4, 5, 6]
    ttft = samples[-1]["histograms"]["time_to_first_token_seconds"]
    assert [(row["path"], row["count"]) for row in ttft] == [("direct", 6)]
    assert [s["time"] for s in samples] == sorted(s["time"] for s in samples)


def test_with_several_models_each_models_history_is_kept_apart() -> None:
    metrics = RouterMetrics()
    history = ConsoleHistory(metrics, models=["alpha", "beta"], interval=5.0, keep=20.0)
    for _ in range(2):
        metrics.route_decisions.labels("alpha", "live", "disaggregated", "long_prompt").inc()
    for _ in range(3):
        metrics.route_decisions.labels("beta", "live", "direct", "below_threshold").inc()
    history.sample()

    def decisions(samples: list[dict[str, object]]) -> list[tuple[str, str, int]]:
        rows = samples[-1]["counters"]["route_decisions_total"]  # type: ignore[index]
        return [(row["path"], row["reason"], row["count"]) for row in rows]

    assert decisions(history.samples("alpha")) == [("disaggregated", "long_prompt", 2)]
    assert decisions(history.samples("beta")) == [("direct", "below_threshold", 3)]
    assert history.samples(None) == history.samples("alpha"), "the first model's, as the page opens on it"
