"""KV cache bookkeeping: block hashes, the engine's prefix cache, and leases on prefilled blocks."""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol

BLOCK_SIZE = 16
_BLOCK_ID_LIMIT = 2**31


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("I", token_ids).tobytes()


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A digest of a whole prompt, so a decoder proves it asks for the KV of the same tokens."""
    return blake2b(token_bytes(token_ids), digest_size=16).hexdigest()


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE, *, parent: bytes = b"") -> list[bytes]:
    """Chained hashes of the prompt's full blocks: block i's hash covers tokens 0 .. 16(i+1).

    `parent` is the hash of the block before `token_ids` (none: they start a prompt).
    """
    raw = token_bytes(token_ids)
    width = 4 * block_size
    full = (len(token_ids) // block_size) * width
    hashes: list[bytes] = []
    for start in range(0, full, width):
        parent = blake2b(parent + raw[start : start + width], digest_size=16).digest()
        hashes.append(parent)
    return hashes


def block_count(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


class PrefixCacheListener(Protocol):
    """Told what the prefix cache stores, evicts and clears (the engine's KV events)."""

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int]) -> None: ...

    def removed(self, hashes: Sequence[bytes]) -> None: ...

    def cleared(self) -> None: ...


class PrefixCache:
    """A bounded LRU of block hashes the engine has computed or received.

    A prompt's blocks are touched last-block-first, so its leading blocks are the last to be
    evicted, as vLLM frees a request's blocks tail first: a block whose parent is gone is of no use.
    """

    def __init__(self, capacity_blocks: int = 65536, listener: PrefixCacheListener | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.listener = listener
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def cached_tokens(self, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """Tokens of the prompt's prefix already in cache; the last prompt token is always computed."""
        matched = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            matched += 1
        for block_hash in reversed(hashes[:matched]):
            self._blocks.move_to_end(block_hash)
        computable_blocks = max(prompt_tokens - 1, 0) // BLOCK_SIZE
        return min(matched, computable_blocks) * BLOCK_SIZE

    def insert(self, hashes: Sequence[bytes], token_ids: Sequence[int] = ()) -> None:
        """Cache a prompt's full blocks (`token_ids` is the prompt, for the listener); evict beyond capacity."""
        runs: list[tuple[int, int]] = []
        for position, block_hash in enumerate(hashes):
            if block_hash in self._blocks:
                continue
            self._blocks[block_hash] = None
            if runs and runs[-1][1] == position:
                runs[-1] = (runs[-1][0], position + 1)
            else:
                runs.append((position, position + 1))
        for block_hash in reversed(hashes):
            self._blocks.move_to_end(block_hash)
        evicted: list[bytes] = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        listener = self.listener
        if listener is None:
            return
        for start, end in runs:
            parent = hashes[start - 1] if start else None
            listener.stored(hashes[start:end], parent, token_ids[start * BLOCK_SIZE : end * BLOCK_SIZE])
        if evicted:
            listener.removed(evicted)

    def clear(self) -> None:
        """Forget every block (vLLM's reset_prefix_cache)."""
        self._blocks.clear()
        if self.listener is not None:
            self.listener.cleared()


class LeaseError(Exception):
    """A decoder asked for KV that this prefiller cannot hand over."""

    status_code = 404

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LeaseUnknown(LeaseError):
    """No lease by that id (never granted, already read, or from another engine)."""


class LeaseMismatch(LeaseError):
    """The lease exists, but the blocks or the prompt asked for differ from what was prefilled."""


class LeaseExpired(LeaseError):
    """The lease ended before the decoder came for the blocks; they were freed."""

    status_code = 410


@dataclass(frozen=True, slots=True)
class KvLease:
    """Prefilled KV blocks held for one decoder to read."""

    remote_request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prompt_digest: str
    expires_at: float


class LeaseTable:
    """Leases on prefilled blocks, in expiry order; bounded, and reaped in the background."""

    def __init__(
        self,
        lease_seconds: float,
        *,
        max_leases: int = 65536,
        remembered_expiries: int = 16384,
        clock: Callable[[], float] = time.monotonic,
        on_expire: Callable[[KvLease], None] | None = None,
    ) -> None:
        self.lease_seconds = lease_seconds
        self.max_leases = max_leases
        self._clock = clock
        self._on_expire = on_expire
        self._leases: OrderedDict[str, KvLease] = OrderedDict()
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._remembered_expiries = remembered_expiries
        self._next_block_id = 1
        self._leased_tokens = 0
        self.released = 0

    @property
    def active(self) -> int:
        return len(self._leases)

    @property
    def leased_tokens(self) -> int:
        return self._leased_tokens

    def grant(self, remote_request_id: str, digest: str, num_tokens: int) -> KvLease:
        blocks = block_count(num_tokens)
        first = self._next_block_id
        self._next_block_id = (first + blocks) % _BLOCK_ID_LIMIT or 1
        lease = KvLease(
            remote_request_id=remote_request_id,
            block_ids=tuple((first + i) % _BLOCK_ID_LIMIT for i in range(blocks)),
            num_tokens=num_tokens,
            prompt_digest=digest,
            expires_at=self._clock() + self.lease_seconds,
        )
        self._leases[remote_request_id] = lease
        self._leased_tokens += num_tokens
        while len(self._leases) > self.max_leases:
            self._expire(next(iter(self._leases)))
        return lease

    def claim(self, remote_request_id: str, block_ids: Sequence[int], digest: str) -> KvLease:
        """Hand the leased blocks to a decoder and release the lease; raise a LeaseError otherwise."""
        lease = self._leases.get(remote_request_id)
        if lease is None:
            if remote_request_id in self._expired:
                raise LeaseExpired(f"lease {remote_request_id} expired")
            raise LeaseUnknown(f"no lease {remote_request_id}")
        if lease.expires_at <= self._clock():
            self._expire(remote_request_id)
            raise LeaseExpired(f"lease {remote_request_id} expired")
        if tuple(block_ids) != lease.block_ids:
            raise LeaseMismatch(f"block ids differ from lease {remote_request_id}")
        if digest != lease.prompt_digest:
            raise LeaseMismatch(f"prompt differs from the one prefilled for {remote_request_id}")
        del self._leases[remote_request_id]
        self._leased_tokens -= lease.num_tokens
        return lease

    def release(self, remote_request_id: str) -> bool:
        """Free a lease no decoder will read (a decoder gave its request up); False if there is none."""
        lease = self._leases.pop(remote_request_id, None)
        if lease is None:
            return False
        self._leased_tokens -= lease.num_tokens
        self.released += 1
        return True

    def reap(self) -> int:
        """Free every lease past its expiry; return how many ended unread."""
        now = self._clock()
        reaped = 0
        while self._leases:
            remote_request_id, lease = next(iter(self._leases.items()))
            if lease.expires_at > now:
                break
            self._expire(remote_request_id)
            reaped += 1
        return reaped

    def _expire(self, remote_request_id: str) -> None:
        lease = self._leases.pop(remote_request_id)
        self._leased_tokens -= lease.num_tokens
        self._expired[remote_request_id] = None
        while len(self._expired) > self._remembered_expiries:
            self._expired.popitem(last=False)
        if self._on_expire is not None:
            self._on_expire(lease)
