"""Pools changed at runtime: add, drain, remove, the live union, and what routing keeps across changes."""

from __future__ import annotations

import asyncio

import pytest

from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.routing.cache import CacheLocator
from dpd_router.routing.load import Balance
from dpd_router.routing.prefix_index import PrefixIndex
from dpd_router.routing.request import RoutingRequest
from dpd_router.routing.strategies import PrefixAware, Session


def url(i: int) -> str:
    return f"http://10.0.0.{i}:8000"


def request(ids: list[int] | None = None, *, key: str | None = None) -> RoutingRequest:
    ids = ids if ids is not None else list(range(64))
    return RoutingRequest(Prompt(token_ids=ids, num_tokens=len(ids), seconds=0.0), session_key=key)


def test_an_added_endpoint_is_a_healthy_member_at_once() -> None:
    pool = Pool([], [url(1)])
    endpoint = pool.add(url(2), "prefill")
    assert pool.prefillers == [endpoint]
    assert pool.healthy("prefill") == [endpoint]
    assert pool.get(url(2)) is endpoint


def test_a_draining_endpoint_takes_no_new_calls_but_stays_a_member() -> None:
    pool = Pool([url(1), url(2)], [url(3)])
    draining = pool.drain(url(1))
    assert draining is not None and draining.draining
    assert draining.state == "draining"
    assert pool.healthy("prefill") == [pool.get(url(2))]
    assert draining in pool.prefillers, "its open calls still count it"


def test_draining_an_unknown_url_does_nothing() -> None:
    assert Pool([url(1)], [url(2)]).drain(url(9)) is None


def test_adding_a_draining_url_again_keeps_the_same_endpoint_and_its_state() -> None:
    pool = Pool([url(1)], [url(2)])
    endpoint = pool.get(url(1))
    assert endpoint is not None
    endpoint.record_failure("connect error")
    pool.drain(url(1))
    assert pool.add(url(1), "prefill") is endpoint
    assert not endpoint.draining and endpoint.breaker.consecutive_failures == 1
    assert len(pool.prefillers) == 1


def test_a_url_cannot_serve_both_roles() -> None:
    pool = Pool([url(1)], [url(2)])
    with pytest.raises(ValueError, match="already a prefill endpoint"):
        pool.add(url(1), "decode")


def test_remove_takes_out_that_endpoint_object_only() -> None:
    pool = Pool([url(1), url(2)], [url(3)])
    first = pool.get(url(1))
    assert first is not None
    held = pool.prefillers
    assert pool.remove(first)
    assert [e.url for e in pool.prefillers] == [url(2)]
    assert held == [first, pool.get(url(2))], "a list already handed out is not edited under its reader"
    assert not pool.remove(first)


def test_the_union_sees_endpoints_added_and_removed_in_its_pools() -> None:
    shared, tenant = Pool([], [url(1)]), Pool([], [url(2)], name="acme")
    union = Pool.union([shared, tenant])
    added = shared.add(url(3), "decode")
    assert [e.url for e in union.decoders] == [url(1), url(3), url(2)]
    assert union.get(url(3)) is added
    shared.remove(added)
    assert [e.url for e in union.endpoints()] == [url(1), url(2)]
    with pytest.raises(TypeError):
        union.add(url(4), "decode")


def test_a_pool_is_ready_only_with_a_probed_decoder_that_is_not_draining() -> None:
    pool = Pool([], [url(1)])
    decoder = pool.get(url(1))
    assert decoder is not None
    decoder.probed_ok = True
    assert pool.ready()
    pool.drain(url(1))
    assert not pool.ready()


async def test_wait_idle_returns_when_the_last_open_call_finishes() -> None:
    endpoint = Endpoint(url(1), "decode")
    endpoint.start()
    endpoint.start()
    waiting = asyncio.create_task(endpoint.wait_idle())
    await asyncio.sleep(0.01)
    endpoint.finish()
    await asyncio.sleep(0.01)
    assert not waiting.done()
    endpoint.finish()
    await asyncio.wait_for(waiting, 1)


async def test_wait_idle_returns_at_once_without_open_calls() -> None:
    await asyncio.wait_for(Endpoint(url(1), "decode").wait_idle(), 1)


# What routing keeps when the pool changes.

SESSIONS = [f"session-{i}" for i in range(2000)]


def assignments(pool: Pool, strategy: Session) -> dict[str, str]:
    return {key: strategy.select(pool.healthy("prefill"), request(key=key)).url for key in SESSIONS}


def test_removing_one_of_n_prefillers_moves_only_the_sessions_that_were_on_it() -> None:
    pool = Pool([url(i) for i in range(5)], [url(9)])
    strategy = Session()
    before = assignments(pool, strategy)
    pool.drain(url(2))
    after = assignments(pool, strategy)
    moved = {key for key in SESSIONS if before[key] != after[key]}
    assert moved == {key for key in SESSIONS if before[key] == url(2)}
    assert 0.1 < len(moved) / len(SESSIONS) < 0.3, "about 1/N of them"


def test_adding_a_prefiller_takes_sessions_only_for_itself() -> None:
    pool = Pool([url(i) for i in range(4)], [url(9)])
    strategy = Session()
    before = assignments(pool, strategy)
    pool.add(url(4), "prefill")
    after = assignments(pool, strategy)
    moved = {key for key in SESSIONS if before[key] != after[key]}
    assert {after[key] for key in moved} == {url(4)}
    assert 0.1 < len(moved) / len(SESSIONS) < 0.3, "about 1/(N+1) of them"


def test_sessions_return_to_a_prefiller_that_comes_back() -> None:
    pool = Pool([url(i) for i in range(3)], [url(9)])
    strategy = Session()
    before = assignments(pool, strategy)
    leaving = pool.drain(url(1))
    assert leaving is not None
    pool.remove(leaving)
    pool.add(url(1), "prefill")  # a new Endpoint object for the same engine URL
    assert assignments(pool, strategy) == before


def test_prefix_affinity_survives_other_engines_leaving_and_an_engine_returning() -> None:
    pool = Pool([url(i) for i in range(3)], [url(9)])
    cache = CacheLocator(PrefixIndex(block_size=16, capacity=10_000))
    strategy = PrefixAware(cache, Balance(abs_threshold=32, rel_threshold=1.5))
    prompts = {i: list(range(i * 1000, i * 1000 + 64)) for i in range(3)}
    for i, ids in prompts.items():
        holder = pool.get(url(i))
        assert holder is not None
        cache.index.record(request(ids), [holder])

    leaving = pool.drain(url(1))
    assert leaving is not None
    pool.remove(leaving)
    for i in (0, 2):
        assert strategy.select(pool.healthy("prefill"), request(prompts[i])).url == url(i)

    pool.add(url(1), "prefill")
    assert strategy.select(pool.healthy("prefill"), request(prompts[1])).url == url(1), "matched by URL"
