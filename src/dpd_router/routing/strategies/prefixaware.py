"""`prefixaware`: send a prompt where its longest prefix already is, unless that endpoint is swamped."""

from __future__ import annotations

import time
from collections.abc import Sequence

from dpd_router.pool.endpoint import Endpoint
from dpd_router.routing.cache import CacheLocator
from dpd_router.routing.load import Balance, load_score
from dpd_router.routing.request import RoutingRequest
from dpd_router.routing.strategies.base import Strategy
from dpd_router.routing.strategies.leastloaded import LeastLoaded


class PrefixAware:
    """Longest cached prefix first, guarded by `balance`; least-loaded when nothing matches.

    Among candidates holding equally long prefixes the least loaded wins. When the winner's load
    is out of balance with the lightest candidate's, the prefix is not worth the queue and the
    least-loaded candidate is taken instead. The cache view is the router's own prefix index.
    """

    name = "prefixaware"

    def __init__(self, cache: CacheLocator, balance: Balance, fallback: Strategy | None = None) -> None:
        self.cache = cache
        self._balance = balance
        self._fallback = fallback if fallback is not None else LeastLoaded()

    def select(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        matched = self.cache.matched_tokens(request, candidates)
        longest = max(matched.values(), default=0)
        if longest <= 0:
            return self._fallback.select(candidates, request)
        holders = [endpoint for endpoint in candidates if matched.get(endpoint, 0) == longest]
        chosen = holders[0] if len(holders) == 1 else self._fallback.select(holders, request)
        if len(holders) < len(candidates):
            now = time.monotonic()
            lightest = min(load_score(endpoint, now) for endpoint in candidates)
            if self._balance.overloaded(load_score(chosen, now), lightest):
                return self._fallback.select(candidates, request)
        return chosen
