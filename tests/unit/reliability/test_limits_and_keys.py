from __future__ import annotations

from pathlib import Path

import pytest

from dpd_router.api.auth import KeyRing, hash_key
from dpd_router.api.limits import KeyLimits, TokenBucket, worker_share
from dpd_router.request.errors import Forbidden, RateLimited, Unauthorized


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_allows_a_minute_of_burst_then_refills() -> None:
    clock = Clock()
    bucket = TokenBucket(60, clock=clock)
    assert all(bucket.take(1) == 0 for _ in range(60))
    assert bucket.take(1) == pytest.approx(1.0)
    clock.now += 2
    assert bucket.take(2) == 0


def test_an_amount_larger_than_the_bucket_needs_a_full_bucket() -> None:
    clock = Clock()
    bucket = TokenBucket(100, clock=clock)
    assert bucket.take(150) == 0
    assert bucket.take(150) > 0


async def test_key_limits_raise_429_with_retry_after() -> None:
    limits = KeyLimits(requests=TokenBucket(1), prompt_tokens=TokenBucket(1000))
    await limits.take_request()
    with pytest.raises(RateLimited) as caught:
        await limits.take_request()
    assert caught.value.status_code == 429 and caught.value.retry_after > 0
    await limits.take_prompt_tokens(900)
    with pytest.raises(RateLimited):
        await limits.take_prompt_tokens(900)


def test_keys_are_matched_by_hash_and_admin_rights_are_checked(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(
        f"keys:\n"
        f"  - sha256: {hash_key('tenant-a-key')}\n    tenant: a\n    requests_per_minute: 10\n"
        f"  - sha256: {hash_key('ops-key')}\n    admin: true\n"
    )
    ring = KeyRing.load(keys_file=keys_file, key_hashes=[hash_key("plain")], admin_key_hashes=[])
    assert ring.enabled
    principal = ring.authenticate("Bearer tenant-a-key")
    assert principal.tenant == "a" and principal.limits.requests is not None
    assert principal.key_id == hash_key("tenant-a-key")[:12]
    assert ring.authenticate("bearer plain").tenant is None
    for bad in (None, "", "Bearer", "Bearer wrong", "Basic plain"):
        with pytest.raises(Unauthorized):
            ring.authenticate(bad)
    with pytest.raises(Forbidden):
        ring.authenticate_admin("Bearer plain")
    assert ring.authenticate_admin("Bearer ops-key").admin


def test_without_keys_the_api_is_open_but_admin_is_not() -> None:
    ring = KeyRing.load(keys_file=None, key_hashes=[], admin_key_hashes=[])
    assert ring.authenticate(None).key_id == "anonymous"
    with pytest.raises(Unauthorized):
        ring.authenticate_admin(None)


def test_admin_keys_alone_protect_only_the_admin_endpoints() -> None:
    ring = KeyRing.load(keys_file=None, key_hashes=[], admin_key_hashes=[hash_key("ops")])
    assert not ring.enabled
    assert ring.authenticate(None).key_id == "anonymous"
    assert ring.authenticate_admin("Bearer ops").admin


def test_each_of_several_workers_keeps_its_share_of_a_keys_rates(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(
        f"keys:\n  - sha256: {hash_key('k')}\n    requests_per_minute: 90\n    prompt_tokens_per_minute: 1000\n"
    )
    ring = KeyRing.load(keys_file=keys_file, key_hashes=[], admin_key_hashes=[], workers=4)
    limits = ring.authenticate("Bearer k").limits
    assert limits.requests is not None and limits.requests.rate_per_minute == 22.5
    assert limits.prompt_tokens is not None and limits.prompt_tokens.rate_per_minute == 250


def test_a_workers_share_of_a_count_is_rounded_up_and_zero_stays_zero() -> None:
    assert [worker_share(limit, 4) for limit in (0, 1, 4, 5, 256)] == [0, 1, 1, 2, 64]
    assert worker_share(7, 1) == 7


class FakeStore:
    """A shared store that answers as told (None: unreachable), recording what it was asked."""

    def __init__(self, answer: float | None) -> None:
        self.answer = answer
        self.asked: list[tuple[str, float, float]] = []

    async def take(self, key: str, rate_per_minute: float, amount: float) -> float | None:
        self.asked.append((key, rate_per_minute, amount))
        return self.answer


async def test_a_shared_store_spends_the_keys_full_rate_and_the_local_share_stands_in_when_it_cannot(
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(
        f"keys:\n  - sha256: {hash_key('k')}\n    requests_per_minute: 4\n    prompt_tokens_per_minute: 1000\n"
    )
    store = FakeStore(0.0)
    ring = KeyRing.load(keys_file=keys_file, key_hashes=[], admin_key_hashes=[], workers=2, store=store)
    limits = ring.authenticate("Bearer k").limits
    for _ in range(5):  # more than the local share (2): the store decides
        await limits.take_request()
    await limits.take_prompt_tokens(800)
    key_id = hash_key("k")[:12]
    assert store.asked[0] == (f"{key_id}:requests", 4.0, 1)
    assert store.asked[-1] == (f"{key_id}:prompt_tokens", 1000.0, 800)
    store.answer = 7.5
    with pytest.raises(RateLimited) as caught:
        await limits.take_request()
    assert caught.value.retry_after == 7.5
    store.answer = None  # unreachable: this process's share, 2 a minute, decides
    await limits.take_request()
    await limits.take_request()
    with pytest.raises(RateLimited):
        await limits.take_request()
