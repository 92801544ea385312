"""What routing knows about one request: its prompt, its session key and any KV-location hint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dpd_router.prompt.tokenizer import Prompt
from dpd_router.routing.blocks import ROOT_SEED, block_hashes

T = TypeVar("T")

# Tokens already held by each endpoint, by endpoint URL, as an external KV source reported them.
KVHint = Mapping[str, int]

# Session keys longer than this are cut; they only feed a hash.
MAX_SESSION_KEY_CHARS = 256


@dataclass
class RoutingRequest:
    """One request as the strategies see it; lives for a single `Planner.plan` call.

    Block hashes and index matches are computed on first use and kept, so the decoder choice,
    the threshold and the prefiller choice share one pass over a long prompt.
    """

    prompt: Prompt
    session_key: str | None = None
    kv_hint: KVHint | None = None
    # Why the KV connector cannot disaggregate this request (None: it can).
    unsupported: str | None = None
    _blocks: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False)
    _memo: dict[int, Any] = field(default_factory=dict, init=False, repr=False)

    def block_hashes(self, block_size: int) -> list[int]:
        hashes = self._blocks.get(block_size)
        if hashes is None:
            hashes = self._blocks[block_size] = self._hashes_of_prompt(block_size)
        return hashes

    def _hashes_of_prompt(self, block_size: int) -> list[int]:
        """The prompt's block hashes: those its reader hashed already (Prompt.blocks) carried on with the
        blocks read since, or all of them."""
        ids = self.prompt.token_ids
        memo = self.prompt.blocks
        if memo is None:
            return block_hashes(ids, block_size)
        full = len(ids) // block_size
        done = memo.get(block_size, [])
        if len(done) < full:
            seed = done[-1] if done else ROOT_SEED
            done = done + block_hashes(ids[len(done) * block_size : full * block_size], block_size, seed=seed)
            memo[block_size] = done
        return done[:full]

    def memo(self, owner: object, compute: Callable[[RoutingRequest], T]) -> T:
        """`compute(self)`, once per `owner` (an index) for this request."""
        key = id(owner)
        if key not in self._memo:
            self._memo[key] = compute(self)
        value: T = self._memo[key]
        return value


def session_key(headers: Mapping[str, str], body: Mapping[str, Any], *, header: str | None) -> str | None:
    """The request's session key: the `header` if present, else the body's `user` field, else None."""
    value = headers.get(header) if header else None
    if not value:
        user = body.get("user")
        value = user if isinstance(user, str) else None
    return value[:MAX_SESSION_KEY_CHARS] if value else None
