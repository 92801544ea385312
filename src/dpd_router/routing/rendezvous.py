"""Rendezvous (highest-random-weight) hashing: a key's endpoint, the same in every process.

Each candidate scores `hash(url, key)` and the highest wins. No ring to rebuild and no state to
share, so every router worker and replica that sees the same candidates picks the same one; when
one of N endpoints leaves only the keys it held move (about 1/N of them), and an endpoint that
joins takes about 1/(N+1) of the keys. Endpoints are named by URL, the one identity every process
shares (never an object id, nor Python's per-process salted `hash()`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from dpd_router.pool.endpoint import Endpoint


def rendezvous_weight(key: str, node: str) -> int:
    """A stable 64-bit score of `node` for `key` (blake2b, identical in every process)."""
    digest = hashlib.blake2b(f"{node}\x00{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_choice(candidates: Sequence[Endpoint], key: str) -> Endpoint:
    """The candidate `key` belongs to (`candidates` must not be empty); order does not matter."""
    return max(candidates, key=lambda endpoint: rendezvous_weight(key, endpoint.url))
