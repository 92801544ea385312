"""The prefill and decode pools, built once at startup from settings."""

from __future__ import annotations

from collections.abc import Iterable

from dpd_router.pool.endpoint import Endpoint, Role


class Pool:
    """The router's view of every engine, split by role."""

    def __init__(self, prefill_urls: Iterable[str], decode_urls: Iterable[str]) -> None:
        self.prefillers = [Endpoint(url, "prefill") for url in prefill_urls]
        self.decoders = [Endpoint(url, "decode") for url in decode_urls]

    def endpoints(self) -> list[Endpoint]:
        return [*self.prefillers, *self.decoders]

    def members(self, role: Role) -> list[Endpoint]:
        return self.prefillers if role == "prefill" else self.decoders

    def healthy(self, role: Role) -> list[Endpoint]:
        return [endpoint for endpoint in self.members(role) if endpoint.healthy]

    def ready(self) -> bool:
        """At least one decoder has answered a health probe and is healthy now."""
        return any(endpoint.healthy and endpoint.probed_ok for endpoint in self.decoders)
