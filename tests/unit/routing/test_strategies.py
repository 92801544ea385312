"""Table tests per strategy: given the candidates' state, which one is chosen."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpd_router.config import Settings
from dpd_router.pool.endpoint import Endpoint, EngineLoad
from dpd_router.pool.pool import Pool
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.cache import CacheLocator, KVHintSource
from dpd_router.routing.load import Balance, load_score
from dpd_router.routing.planner import build_planner
from dpd_router.routing.prefix_index import PrefixIndex
from dpd_router.routing.rendezvous import rendezvous_choice
from dpd_router.routing.request import RoutingRequest, session_key
from dpd_router.routing.strategies import KVAware, LeastLoaded, PrefixAware, RoundRobin, Session
from dpd_router.routing.strategies.prefixaware import KEY_TOKENS

BALANCE = Balance(abs_threshold=32, rel_threshold=1.5)


def engines(count: int, role: str = "prefill") -> list[Endpoint]:
    return [Endpoint(f"http://10.0.0.{i}:8000", role) for i in range(count)]  # type: ignore[arg-type]


def request(
    ids: list[int] | None = None, *, key: str | None = None, hint: dict[str, int] | None = None
) -> RoutingRequest:
    ids = ids if ids is not None else list(range(64))
    return RoutingRequest(Prompt(token_ids=ids, num_tokens=len(ids), seconds=0.0), session_key=key, kv_hint=hint)


def scraped(endpoint: Endpoint, *, running: float = 0, waiting: float = 0, age: float = 0.0) -> None:
    load = EngineLoad(running, waiting, None, None, scraped_at=time.monotonic() - age)
    endpoint.record_load(load, fresh_for=6.0)


# roundrobin


def test_roundrobin_takes_turns_and_keeps_rotating_when_the_set_shrinks() -> None:
    a, b, c = engines(3)
    strategy = RoundRobin()
    assert [strategy.select([a, b, c], request()) for _ in range(4)] == [a, b, c, a]
    assert [strategy.select([a, c], request()) for _ in range(2)] == [a, c]


# leastloaded


@pytest.mark.parametrize(
    ("in_flight", "waiting", "running", "expected"),
    [
        ((3, 1, 5), (0, 0, 0), (0, 0, 0), 1),  # router in-flight alone
        ((0, 0, 0), (4, 0, 1), (0, 6, 0), 2),  # a queued request weighs more than a running one
        ((0, 0, 0), (0, 0, 0), (9, 2, 4), 1),  # scraped running requests
        ((5, 0, 0), (0, 3, 0), (0, 0, 0), 2),  # in-flight and scraped load add up
    ],
)
def test_leastloaded_takes_the_lowest_load_score(
    in_flight: tuple[int, ...], waiting: tuple[int, ...], running: tuple[int, ...], expected: int
) -> None:
    candidates = engines(3)
    for endpoint, flying, queued, busy in zip(candidates, in_flight, waiting, running, strict=True):
        endpoint.in_flight = flying
        scraped(endpoint, running=busy, waiting=queued)
    assert LeastLoaded().select(candidates, request()) is candidates[expected]


def test_a_stale_scrape_is_ignored_by_the_load_score() -> None:
    endpoint = engines(1)[0]
    endpoint.in_flight = 2
    scraped(endpoint, running=10, waiting=10, age=7.0)
    assert load_score(endpoint, time.monotonic()) == 2.0
    scraped(endpoint, running=10, waiting=10, age=1.0)
    assert load_score(endpoint, time.monotonic()) == 2.0 + 10 + 2 * 10


def test_leastloaded_ties_take_turns() -> None:
    a, b = engines(2)
    strategy = LeastLoaded()
    assert {strategy.select([a, b], request()) for _ in range(4)} == {a, b}


# session


def test_session_key_comes_from_the_header_then_the_user_field() -> None:
    assert session_key({"x-session-id": "s1"}, {"user": "u1"}, header="x-session-id") == "s1"
    assert session_key({}, {"user": "u1"}, header="x-session-id") == "u1"
    assert session_key({}, {"user": 7}, header="x-session-id") is None
    assert session_key({}, {}, header="x-session-id") is None


def test_session_sends_one_key_to_one_endpoint_whatever_the_order_or_the_replica() -> None:
    candidates = engines(5)
    first = Session().select(candidates, request(key="conversation-42"))
    assert all(Session().select(candidates[::-1], request(key="conversation-42")) is first for _ in range(5))


def test_session_without_a_key_falls_back_to_least_loaded() -> None:
    a, b = engines(2)
    a.in_flight = 4
    assert Session().select([a, b], request(key=None)) is b


@settings(max_examples=30, deadline=None)
@given(count=st.integers(min_value=3, max_value=12), leaving=st.integers(min_value=0, max_value=11))
def test_removing_one_of_n_endpoints_moves_only_its_own_keys(count: int, leaving: int) -> None:
    candidates = engines(count)
    gone = candidates[leaving % count]
    remaining = [endpoint for endpoint in candidates if endpoint is not gone]
    keys = [f"user-{i}" for i in range(2000)]
    before = {key: Session().select(candidates, request(key=key)) for key in keys}
    after = {key: Session().select(remaining, request(key=key)) for key in keys}
    moved = [key for key in keys if before[key] is not after[key]]
    assert all(before[key] is gone for key in moved)
    assert abs(len(moved) / len(keys) - 1 / count) < 0.05


@settings(max_examples=30, deadline=None)
@given(count=st.integers(min_value=2, max_value=12))
def test_adding_an_endpoint_takes_about_one_in_n_plus_one_keys_and_moves_no_others(count: int) -> None:
    candidates = engines(count + 1)
    newcomer = candidates[-1]
    keys = [f"user-{i}" for i in range(2000)]
    moved = 0
    for key in keys:
        before = Session().select(candidates[:-1], request(key=key))
        after = Session().select(candidates, request(key=key))
        if after is not before:
            assert after is newcomer
            moved += 1
    assert abs(moved / len(keys) - 1 / (count + 1)) < 0.05


# prefixaware


def prefix_aware(block_size: int = 16) -> tuple[PrefixAware, PrefixIndex]:
    index = PrefixIndex(block_size=block_size, capacity=10_000)
    return PrefixAware(CacheLocator(index), BALANCE), index


def test_prefixaware_takes_the_endpoint_with_the_longest_prefix() -> None:
    strategy, index = prefix_aware()
    a, b, c = engines(3)
    shared = list(range(64))
    index.record(request(shared[:32]), [a])
    index.record(request(shared), [b])
    b.in_flight = 5  # busier, but well within balance
    assert strategy.select([a, b, c], request(shared + [7] * 40)) is b


def key_of(ids: list[int], *, block_size: int = 16, key_tokens: int = KEY_TOKENS) -> str:
    """The hashed prefix the strategy uses: the chained hash of the prompt's first key_tokens (whole blocks)."""
    hashes = request(ids).block_hashes(block_size)
    return f"{hashes[min(len(hashes), key_tokens // block_size) - 1]:016x}"


def test_prefixaware_places_a_new_prefix_by_the_rendezvous_hash_of_its_leading_blocks() -> None:
    strategy, index = prefix_aware()
    a, b, c = engines(3)
    index.record(request(list(range(64))), [a])
    a.in_flight = 1  # no longer the least loaded turn decides: the prefix does
    for start in range(100, 2000, 97):
        ids = list(range(start, start + 80))
        assert strategy.select([a, b, c], request(ids)) is rendezvous_choice([a, b, c], key_of(ids))


def test_prefixaware_hashes_the_first_key_tokens_only_so_every_turn_of_a_conversation_agrees() -> None:
    strategy, _ = prefix_aware()
    candidates = engines(5)
    first_turn = [random.Random(3).randrange(50_000) for _ in range(KEY_TOKENS + 300)]
    chosen = strategy.select(candidates, request(first_turn))
    for turn in range(1, 6):
        later = first_turn + [turn] * (500 * turn)
        assert strategy.select(candidates, request(later)) is chosen


def test_two_independent_planners_place_the_same_new_prompt_on_the_same_prefiller() -> None:
    urls = [f"http://10.1.0.{i}:8000" for i in range(3)]
    config = Settings(
        prefill_urls=urls, decode_urls=["http://10.2.0.1:8000"], routing_threshold=1024, threshold_mode="static"
    )
    # Separate pools and prefix indexes, as in two router replicas: nothing shared but the URLs.
    first, second = (build_planner(config, Pool(urls, config.decode_urls), RouterMetrics()) for _ in "ab")
    rng = random.Random(11)
    used: set[str] = set()
    for conversation in range(40):
        turn = [rng.randrange(50_000) for _ in range(rng.randrange(1100, 5000))]
        # The replicas see different traffic: each places the other's turns and its own, in turn.
        placed: set[str] = set()
        for replica in (first, second, second, first) if conversation % 2 else (second, first, first, second):
            prefiller = replica.plan(Prompt(turn, len(turn), 0.0)).prefiller
            assert prefiller is not None
            placed.add(prefiller.url)
            turn = turn + [rng.randrange(50_000) for _ in range(300)]
        assert len(placed) == 1, (conversation, placed)
        used |= placed
    assert used == set(urls)


def test_prefixaware_spreads_distinct_prefixes_evenly() -> None:
    strategy, index = prefix_aware()
    candidates = engines(3)
    rng = random.Random(5)
    counts = dict.fromkeys(candidates, 0)
    for _ in range(300):
        ids = [rng.randrange(50_000) for _ in range(rng.randrange(16, 3000))]
        chosen = strategy.select(candidates, request(ids))
        index.record(request(ids), [chosen])
        counts[chosen] += 1
    assert all(0.20 <= count / 300 <= 0.47 for count in counts.values()), counts


def test_prefixaware_a_new_prefix_whose_hashed_endpoint_is_swamped_goes_to_the_least_loaded() -> None:
    strategy, _ = prefix_aware()
    candidates = engines(3)
    ids = list(range(500, 700))
    hashed = rendezvous_choice(candidates, key_of(ids))
    lightest = next(endpoint for endpoint in candidates if endpoint is not hashed)
    for endpoint in candidates:
        scraped(endpoint, running=10)
    scraped(hashed, running=10, waiting=20)  # 50 against 10: past 32 and past 1.5x
    scraped(lightest, running=5)
    assert strategy.select(candidates, request(ids)) is lightest
    scraped(hashed, running=30)  # 30 against 5: within the absolute threshold
    assert strategy.select(candidates, request(ids)) is hashed


def test_prefixaware_a_prompt_shorter_than_a_block_takes_the_least_loaded() -> None:
    strategy, _ = prefix_aware()
    a, b = engines(2)
    a.in_flight = 1
    assert strategy.select([a, b], request(list(range(15)))) is b


def test_prefixaware_a_short_shared_prefix_does_not_override_the_hash() -> None:
    strategy, index = prefix_aware()
    candidates = engines(3)
    system = list(range(9000, 9000 + 160))  # 10 blocks: shorter than the key and than half the prompt
    conversations = [system + list(range(start, start + 1200)) for start in range(0, 60_000, 6000)]
    holder = candidates[0]
    index.record(request(system + [1] * 64), [holder])
    for ids in conversations:
        assert strategy.select(candidates, request(ids)) is rendezvous_choice(candidates, key_of(ids))
    assert {strategy.select(candidates, request(ids)) for ids in conversations} == set(candidates)


def test_prefixaware_passes_over_a_holder_out_of_balance_with_the_others() -> None:
    strategy, index = prefix_aware()
    a, b = engines(2)
    index.record(request(list(range(64))), [a])
    scraped(a, running=10, waiting=20)  # 10 + 2*20 = 50 against 0: past 32 and past 1.5x
    assert strategy.select([a, b], request(list(range(64)))) is b
    scraped(a, running=10, waiting=10)  # 30 against 0: within the absolute threshold
    assert strategy.select([a, b], request(list(range(64)))) is a
    scraped(b, running=40, waiting=0)  # 50 against 40: within 32 of the lightest, so balanced
    scraped(a, running=10, waiting=20)
    assert strategy.select([a, b], request(list(range(64)))) is a


def test_prefixaware_ties_among_equal_prefixes_go_to_the_holder_the_prefix_hashes_to() -> None:
    strategy, index = prefix_aware()
    a, b, c = engines(3)
    ids = list(range(64))
    index.record(request(ids), [a, b])
    hashed = rendezvous_choice([a, b], key_of(ids))
    hashed.in_flight = 2  # busier, but well within balance
    assert strategy.select([a, b, c], request(ids)) is hashed
    assert strategy.select([c, b, a], request(ids)) is hashed


def test_prefixaware_ignores_prefixes_on_endpoints_that_are_not_candidates() -> None:
    strategy, index = prefix_aware()
    a, b, c = engines(3)
    index.record(request(list(range(64))), [a])
    c.in_flight = 1
    # The prompt is placed as if new: by its hash among the candidates, whatever a holds.
    assert strategy.select([b, c], request(list(range(64)))) is rendezvous_choice([b, c], key_of(list(range(64))))


# kvaware


class FixedSource:
    """A cache source that reports fixed matches (None: no answer)."""

    name = "fixed"

    def __init__(self, tokens: dict[str, int] | None) -> None:
        self.tokens = tokens

    def matched_tokens(self, request: RoutingRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, int] | None:
        if self.tokens is None:
            return None
        return {endpoint: self.tokens.get(endpoint.url, 0) for endpoint in candidates}


def test_kvaware_trusts_the_engines_report_over_the_routers_own_index() -> None:
    a, b = engines(2)
    index = PrefixIndex(block_size=16, capacity=1000)
    index.record(request(), [a])
    strategy = KVAware(CacheLocator(index, [KVHintSource(), FixedSource({b.url: 48})]), BALANCE)
    assert strategy.select([a, b], request()) is b


def test_kvaware_takes_the_longest_lmcache_match_not_the_first() -> None:
    a, b, c = engines(3)
    index = PrefixIndex(block_size=16, capacity=1000)
    strategy = KVAware(CacheLocator(index, [KVHintSource(), FixedSource({a.url: 64})]), BALANCE)
    hint = {a.url: 16, c.url: 256, b.url: 32}
    assert strategy.select([a, b, c], request(hint=hint)) is c


@pytest.mark.parametrize("events", [None, {}], ids=["no answer", "nothing cached"])
def test_kvaware_falls_back_to_the_prefix_index_when_no_source_places_the_prompt(
    events: dict[str, int] | None,
) -> None:
    a, b = engines(2)
    index = PrefixIndex(block_size=16, capacity=1000)
    index.record(request(), [b])
    a_busy_but_balanced = 3
    b.in_flight = a_busy_but_balanced
    strategy = KVAware(CacheLocator(index, [KVHintSource(), FixedSource(events)]), BALANCE)
    assert strategy.select([a, b], request(hint={})) is b


def test_kvaware_with_no_match_anywhere_takes_the_rendezvous_choice() -> None:
    candidates = engines(3)
    candidates[0].in_flight = 1
    strategy = KVAware(CacheLocator(PrefixIndex(block_size=16, capacity=10), [FixedSource(None)]), BALANCE)
    for start in range(0, 4000, 250):
        ids = list(range(start, start + 64))
        assert strategy.select(candidates, request(ids)) is rendezvous_choice(candidates, key_of(ids))
