"""How busy an endpoint is, as one number every strategy can compare, and when that is too busy."""

from __future__ import annotations

from dataclasses import dataclass

from dpd_router.pool.endpoint import Endpoint

# A request queued in the engine costs more than one running: it has not even started its prefill.
WAITING_WEIGHT = 2.0


def load_score(endpoint: Endpoint, now: float) -> float:
    """Calls the router has open to the endpoint, plus the engine's running and (weighted) waiting
    requests from its last fresh `/metrics` scrape; only the router's own count when that is stale."""
    score = float(endpoint.in_flight)
    load = endpoint.fresh_load(now)
    if load is not None:
        score += load.running + WAITING_WEIGHT * load.waiting
    return score


@dataclass(frozen=True)
class Balance:
    """When a cache hit is not worth the queue: sgl-router's absolute and relative load thresholds.

    The endpoint holding the longest prefix is passed over when its load exceeds the least loaded
    candidate's by more than `abs_threshold` *and* is more than `rel_threshold` times it.
    """

    abs_threshold: float
    rel_threshold: float

    def overloaded(self, load: float, lightest: float) -> bool:
        return load - lightest > self.abs_threshold and load > lightest * self.rel_threshold
