"""`session`: the same session key always reaches the same endpoint, on every router replica.

Rendezvous (highest-random-weight) hashing of the key (routing/rendezvous.py): no ring to rebuild
and no state to share; when one of N endpoints leaves, only the keys it held move (about 1/N of
them), and an endpoint that joins takes about 1/(N+1) of the keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpd_router.pool.endpoint import Endpoint
from dpd_router.routing.rendezvous import rendezvous_choice
from dpd_router.routing.request import RoutingRequest
from dpd_router.routing.strategies.base import Strategy
from dpd_router.routing.strategies.leastloaded import LeastLoaded


class Session:
    """Routes by the request's session key with rendezvous hashing; without a key, `fallback`."""

    name = "session"

    def __init__(self, fallback: Strategy | None = None) -> None:
        self._fallback = fallback if fallback is not None else LeastLoaded()

    def select(self, candidates: Sequence[Endpoint], request: RoutingRequest) -> Endpoint:
        key = request.session_key
        if not key:
            return self._fallback.select(candidates, request)
        return rendezvous_choice(candidates, key)
