"""The prefill and decode pools, built once at startup from settings."""

from __future__ import annotations

from collections.abc import Iterable

from dpd_router.pool.breaker import BreakerPolicy, CircuitBreaker
from dpd_router.pool.endpoint import Endpoint, Role


class Pool:
    """The router's view of a set of engines, split by role.

    The shared pool and each tenant's reserved pool are separate Pools; `Pool.union` gives one
    view of every engine (sharing the same Endpoint objects) for health probes and load scraping.
    """

    def __init__(
        self,
        prefill_urls: Iterable[str],
        decode_urls: Iterable[str],
        *,
        breaker: BreakerPolicy | None = None,
        name: str = "shared",
    ) -> None:
        policy = breaker or BreakerPolicy()
        self.name = name
        self.prefillers = [Endpoint(url, "prefill", breaker=CircuitBreaker(policy)) for url in prefill_urls]
        self.decoders = [Endpoint(url, "decode", breaker=CircuitBreaker(policy)) for url in decode_urls]

    @classmethod
    def union(cls, pools: Iterable[Pool]) -> Pool:
        merged = cls((), (), name="all")
        for pool in pools:
            merged.prefillers += pool.prefillers
            merged.decoders += pool.decoders
        return merged

    def endpoints(self) -> list[Endpoint]:
        return [*self.prefillers, *self.decoders]

    def members(self, role: Role) -> list[Endpoint]:
        return self.prefillers if role == "prefill" else self.decoders

    def healthy(self, role: Role) -> list[Endpoint]:
        """The endpoints of `role` that may take new calls now (probes pass, breaker not open)."""
        return [endpoint for endpoint in self.members(role) if endpoint.available]

    def ready(self) -> bool:
        """At least one decoder has answered a health probe and may take traffic now."""
        return any(endpoint.probed_ok and endpoint.available for endpoint in self.decoders)
