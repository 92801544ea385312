"""Endpoint selection policies: each picks one endpoint from the healthy candidates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dpd_router.pool.endpoint import Endpoint
from dpd_router.tokenizer import Prompt


class Strategy(Protocol):
    """Picks one of `candidates` (never empty, all healthy) for `prompt`."""

    name: str

    def select(self, candidates: Sequence[Endpoint], prompt: Prompt) -> Endpoint: ...


class RoundRobin:
    """Takes turns over the candidates.

    The turn counter is independent of the candidate list, so when an endpoint leaves or comes
    back the rotation continues instead of restarting or skipping.
    """

    name = "roundrobin"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Sequence[Endpoint], prompt: Prompt) -> Endpoint:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen


class LeastLoaded:
    """Takes the candidate with the fewest calls in flight from this router; ties rotate."""

    name = "leastloaded"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Sequence[Endpoint], prompt: Prompt) -> Endpoint:
        fewest = min(endpoint.in_flight for endpoint in candidates)
        tied = [endpoint for endpoint in candidates if endpoint.in_flight == fewest]
        self._turn += 1
        return tied[self._turn % len(tied)]


def prefill_strategy(name: str) -> Strategy:
    if name == "roundrobin":
        return RoundRobin()
    raise ValueError(f"unknown prefill_strategy {name!r}")
