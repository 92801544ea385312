"""Leases on prefilled KV and the prefix cache."""

from __future__ import annotations

import pytest

from dpd_sim.kv import (
    KvLease,
    LeaseExpired,
    LeaseMismatch,
    LeaseTable,
    LeaseUnknown,
    PrefixCache,
    block_hashes,
    prompt_digest,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_is_claimed_once_with_matching_blocks_and_prompt() -> None:
    leases = LeaseTable(30.0)
    lease = leases.grant("cmpl-a", prompt_digest([1, 2, 3]), 40)
    assert len(lease.block_ids) == 3 and leases.leased_tokens == 40
    with pytest.raises(LeaseMismatch):
        leases.claim("cmpl-a", lease.block_ids[:2], lease.prompt_digest)
    with pytest.raises(LeaseMismatch):
        leases.claim("cmpl-a", lease.block_ids, prompt_digest([1, 2, 4]))
    assert leases.claim("cmpl-a", lease.block_ids, lease.prompt_digest) == lease
    with pytest.raises(LeaseUnknown):
        leases.claim("cmpl-a", lease.block_ids, lease.prompt_digest)
    assert (leases.active, leases.leased_tokens) == (0, 0)


def test_leases_expire_and_say_so() -> None:
    clock = Clock()
    expired: list[KvLease] = []
    leases = LeaseTable(1.0, clock=clock, on_expire=expired.append)
    first = leases.grant("cmpl-1", "d1", 16)
    second = leases.grant("cmpl-2", "d2", 16)
    clock.now += 2
    with pytest.raises(LeaseExpired):
        leases.claim("cmpl-1", first.block_ids, "d1")
    assert leases.reap() == 1
    with pytest.raises(LeaseExpired):
        leases.claim("cmpl-2", second.block_ids, "d2")
    assert [lease.remote_request_id for lease in expired] == ["cmpl-1", "cmpl-2"]
    assert leases.active == 0


def test_a_released_lease_frees_its_blocks_without_expiring() -> None:
    expired: list[KvLease] = []
    leases = LeaseTable(30.0, on_expire=expired.append)
    lease = leases.grant("cmpl-1", prompt_digest([1, 2, 3]), 3)
    assert leases.release("cmpl-1") is True
    assert (leases.active, leases.leased_tokens, leases.released, expired) == (0, 0, 1, [])
    assert leases.release("cmpl-1") is False  # vLLM: a notification for an unknown request is only logged
    with pytest.raises(LeaseUnknown):
        leases.claim("cmpl-1", lease.block_ids, lease.prompt_digest)


def test_lease_table_is_bounded() -> None:
    leases = LeaseTable(30.0, max_leases=2)
    for index in range(5):
        leases.grant(f"cmpl-{index}", "d", 16)
    assert leases.active == 2
    with pytest.raises(LeaseExpired):
        leases.claim("cmpl-0", (1,), "d")


def test_prefix_cache_matches_whole_leading_blocks_and_evicts_lru() -> None:
    cache = PrefixCache(capacity_blocks=4)
    prompt = list(range(40))
    cache.insert(block_hashes(prompt))
    assert cache.cached_tokens(block_hashes(prompt), len(prompt)) == 32
    assert cache.cached_tokens(block_hashes(prompt[:32]), 32) == 16
    assert cache.cached_tokens(block_hashes([99, *prompt[1:]]), 40) == 0
    cache.insert(block_hashes(list(range(100, 164))))
    assert len(cache) == 4
    assert cache.cached_tokens(block_hashes(prompt), len(prompt)) == 0
