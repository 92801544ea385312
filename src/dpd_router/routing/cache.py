"""Where a prompt's prefix is already cached: the sources routing asks, in order of trust.

A source answers with the tokens of the prompt's prefix each candidate holds, or None when it has
nothing to say (not configured, not connected, no hint for this request). The locator takes the
first source that places some of the prompt on a candidate, and ends with the router's own prefix
index, which always answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from dpd_router.pool.endpoint import Endpoint
from dpd_router.routing.prefix_index import PrefixIndex
from dpd_router.routing.request import RoutingRequest


class CacheSource(Protocol):
    """Tokens of `request`'s prompt prefix each candidate holds, or None when the source cannot tell."""

    name: str

    def matched_tokens(self, request: RoutingRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, int] | None: ...


class KVHintSource:
    """The per-request answer an external KV index (the LMCache controller) gave before planning."""

    name = "lmcache"

    def matched_tokens(self, request: RoutingRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, int] | None:
        hint = request.kv_hint
        if hint is None:
            return None
        return {endpoint: hint.get(endpoint.url, 0) for endpoint in candidates}


class CacheLocator:
    """Asks `sources` in order, then the prefix index; records placements in the prefix index."""

    def __init__(self, index: PrefixIndex, sources: Sequence[CacheSource] = ()) -> None:
        self.index = index
        self._sources: tuple[CacheSource, ...] = (*sources, index)

    @property
    def block_size(self) -> int:
        return self.index.block_size

    def matched_tokens(self, request: RoutingRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, int]:
        """Per candidate, the cached prefix in tokens by the first source that finds any; {} if none does."""
        return self.locate(request, candidates)[1]

    def locate(
        self, request: RoutingRequest, candidates: Sequence[Endpoint]
    ) -> tuple[CacheSource | None, dict[Endpoint, int]]:
        """`matched_tokens` and the source that answered (None when none did).

        The prefix index is this process's own record; the other sources report the engines' caches,
        which every router process sees alike.
        """
        for source in self._sources:
            found = source.matched_tokens(request, candidates)
            if found and any(tokens > 0 for tokens in found.values()):
                return source, found
        return None, {}

    def reaching(self, request: RoutingRequest, candidates: Sequence[Endpoint], tokens: int) -> tuple[int, int]:
        """The longest prefix any source places on a candidate, and how many candidates some source places
        at least `tokens` of the prompt on."""
        longest, reaching = 0, set[Endpoint]()
        for source in self._sources:
            found = source.matched_tokens(request, candidates)
            if found:
                longest = max(longest, *found.values())
                reaching.update(endpoint for endpoint, matched in found.items() if matched >= tokens)
        return longest, len(reaching)

    def cached_tokens(self, request: RoutingRequest, endpoint: Endpoint) -> int:
        return self.matched_tokens(request, (endpoint,)).get(endpoint, 0)

    def record(self, request: RoutingRequest, endpoints: Iterable[Endpoint]) -> None:
        self.index.record(request, endpoints)
