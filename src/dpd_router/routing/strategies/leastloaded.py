"""`leastloaded`: the candidate with the lowest load score; the tie-breaker and fallback of all others."""

from __future__ import annotations

import time
from collections.abc import Sequence

from dpd_router.pool.endpoint import Endpoint
from dpd_router.routing.load import load_score
from dpd_router.routing.request import RoutingRequest


class LeastLoaded:
    """Takes the candidate with the lowest `load_score`; equal scores take turns."""

    name = "leastloaded"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        if len(candidates) == 1:
            return candidates[0]
        now = time.monotonic()
        scores = [load_score(endpoint, now) for endpoint in candidates]
        lowest = min(scores)
        tied = [endpoint for endpoint, score in zip(candidates, scores, strict=True) if score == lowest]
        self._turn += 1
        return tied[self._turn % len(tied)]
