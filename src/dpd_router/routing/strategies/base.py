"""The one interface every selection policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dpd_router.pool.endpoint import Endpoint
from dpd_router.routing.request import RoutingRequest


class Strategy(Protocol):
    """Picks one of `candidates` (never empty, all healthy) for `request`.

    Selection has no side effects beyond the strategy's own turn counters: the planner records
    where a prompt went once the whole plan is made.
    """

    name: str

    def select(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint: ...
