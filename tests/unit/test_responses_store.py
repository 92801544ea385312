"""The Responses store's contract, kept by both backends alike: the SQLite file and a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
import pytest

from dpd_router.responses.store import RedisResponses, ResponseStore, SqliteResponses, StoredResponse
from tests.redis_server import redis_server


class Clock:
    """Wall-clock seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def record(
    rid: str, *, previous: str | None = None, size: int = 10, at: float = 0, owner: str = "alice"
) -> StoredResponse:
    return StoredResponse(rid, owner, previous, at, orjson.dumps([{"role": "user", "content": "x" * size}]), b"{}")


MakeStore = Callable[[float, int, "Clock"], ResponseStore]


@pytest.fixture(params=["sqlite", "redis"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[MakeStore]:
    """A factory of stores of one backend over the same data: (ttl, max_bytes, clock) -> store."""
    made: list[ResponseStore] = []
    if request.param == "sqlite":

        def sqlite(ttl: float, max_bytes: int, clock: Clock) -> ResponseStore:
            made.append(SqliteResponses(tmp_path / "responses.sqlite3", ttl=ttl, max_bytes=max_bytes, clock=clock))
            return made[-1]

        yield sqlite
    else:
        async with redis_server() as server:

            def redis(ttl: float, max_bytes: int, clock: Clock) -> ResponseStore:
                made.append(RedisResponses(server.url, ttl=ttl, max_bytes=max_bytes, clock=clock))
                return made[-1]

            yield redis
            for store in made:
                await store.aclose()
            made.clear()
    for store in made:
        await store.aclose()


async def test_a_chain_is_walked_back_to_its_start_and_only_for_its_owner(make_store: MakeStore) -> None:
    store = make_store(3600, 1 << 20, Clock())
    assert await store.put(record("resp_1"))
    assert await store.put(record("resp_2", previous="resp_1"))
    assert await store.put(record("resp_3", previous="resp_2"))
    chain = await store.chain("resp_3", "alice")
    assert [kept.id for kept in chain] == ["resp_3", "resp_2", "resp_1"]
    assert [kept.previous for kept in chain] == ["resp_2", "resp_1", None]
    assert chain[0].input == record("resp_3").input
    assert (await store.get("resp_2", "alice")).previous == "resp_1"
    assert await store.chain("resp_3", "bob") is None, "another key is told nothing is kept"
    await store.put(record("resp_theirs", owner="bob"))
    await store.put(record("resp_4", previous="resp_theirs"))
    assert await store.chain("resp_4", "alice") is None, "every response of the chain is the owner's own"
    assert await store.get("resp_3", "bob") is None
    assert not await store.delete("resp_3", "bob")
    assert await store.get("resp_3", "alice") is not None


async def test_a_deleted_or_expired_response_ends_every_chain_through_it(make_store: MakeStore) -> None:
    clock = Clock()
    store = make_store(100, 1 << 20, clock)
    await store.put(record("resp_1"))
    await store.put(record("resp_2", previous="resp_1"))
    assert await store.delete("resp_1", "alice")
    assert await store.get("resp_1", "alice") is None
    assert await store.chain("resp_2", "alice") is None, "never a silently shortened history"
    assert await store.get("resp_2", "alice") is not None, "the response itself is still kept"
    await store.put(record("resp_3"))
    clock.now += 101
    if isinstance(store, RedisResponses):
        return  # Redis expires keys by its own clock: test_redis_expires_by_the_ttl covers it
    assert await store.get("resp_3", "alice") is None
    assert await store.chain("resp_3", "alice") is None


async def test_the_oldest_are_dropped_past_the_size_bound(make_store: MakeStore) -> None:
    clock = Clock()
    one = record("resp_0").size
    store = make_store(3600, 3 * one + one // 2, clock)
    for index in range(5):
        clock.now += 1
        assert await store.put(record(f"resp_{index}", at=index))
    kept = [rid for rid in ("resp_0", "resp_1", "resp_2", "resp_3", "resp_4") if await store.get(rid, "alice")]
    assert kept == ["resp_2", "resp_3", "resp_4"]
    assert not await store.put(record("huge", size=4 * one)), "a record larger than the bound alone is refused"
    assert await store.get("resp_4", "alice") is not None, "and takes nothing with it"
    # A replaced record counts once: rewriting one many times drops nothing.
    for _ in range(5):
        await store.put(record("resp_4", at=4))
    assert [rid for rid in ("resp_2", "resp_3", "resp_4") if await store.get(rid, "alice")] == kept


async def test_a_second_store_on_the_same_data_sees_what_the_first_kept(make_store: MakeStore) -> None:
    """Worker processes of one router (one SQLite file), replicas (one Redis), or a restart."""
    clock = Clock()
    first = make_store(3600, 1 << 20, clock)
    await first.put(record("resp_1"))
    await first.aclose()
    second = make_store(3600, 1 << 20, clock)
    await second.put(record("resp_2", previous="resp_1"))
    third = make_store(3600, 1 << 20, clock)
    assert [kept.id for kept in await third.chain("resp_2", "alice")] == ["resp_2", "resp_1"]


async def test_redis_expires_by_the_ttl() -> None:
    async with redis_server() as server:
        store = RedisResponses(server.url, ttl=0.2, max_bytes=1 << 20)
        try:
            await store.put(record("resp_1"))
            assert await store.get("resp_1", "alice") is not None
            await asyncio.sleep(0.4)
            assert await store.get("resp_1", "alice") is None
            assert await store.chain("resp_1", "alice") is None
        finally:
            await store.aclose()
