"""`roundrobin`: take turns over the healthy candidates."""

from __future__ import annotations

from collections.abc import Sequence

from dpd_router.pool.endpoint import Endpoint
from dpd_router.routing.request import RoutingRequest


class RoundRobin:
    """Takes turns over the candidates.

    The turn counter is independent of the candidate list, so when an endpoint leaves or comes
    back the rotation continues instead of restarting or skipping.
    """

    name = "roundrobin"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen
