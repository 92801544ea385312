from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dpd_router.pool.endpoint import Endpoint
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.routing.prefix_index import PrefixIndex, matched_depths, prefix_closed_depths
from dpd_router.routing.request import RoutingRequest


def request(ids: list[int]) -> RoutingRequest:
    return RoutingRequest(Prompt(token_ids=ids, num_tokens=len(ids), seconds=0.0))


def test_a_recorded_prompt_matches_its_endpoint_block_by_block() -> None:
    index = PrefixIndex(block_size=4, capacity=100)
    a, b = Endpoint("http://a", "decode"), Endpoint("http://b", "decode")
    index.record(request(list(range(16))), [a])
    shares_two_blocks = request([0, 1, 2, 3, 4, 5, 6, 7, 99, 99, 99, 99])
    assert index.matched_tokens(shares_two_blocks, [a, b]) == {a: 8, b: 0}
    assert index.matched_tokens(request(list(range(16))), [a, b]) == {a: 16, b: 0}
    assert index.matched_tokens(request([9, *range(1, 16)]), [a, b]) == {a: 0, b: 0}


def test_several_endpoints_hold_different_depths_of_the_same_prefix() -> None:
    index = PrefixIndex(block_size=2, capacity=100)
    a, b = Endpoint("http://a", "prefill"), Endpoint("http://b", "decode")
    index.record(request([1, 2, 3, 4]), [a])
    index.record(request([1, 2, 3, 4, 5, 6, 7, 8]), [b])
    assert index.matched_tokens(request([1, 2, 3, 4, 5, 6, 7, 8, 9]), [a, b]) == {a: 4, b: 8}


def test_the_least_recently_used_blocks_go_first_and_a_prefix_loses_its_tail_first() -> None:
    index = PrefixIndex(block_size=1, capacity=4)
    a = Endpoint("http://a", "decode")
    index.record(request([1, 2, 3]), [a])
    index.record(request([7, 8]), [a])  # 5 blocks for 4 places: block [1,2,3]'s tail goes
    assert len(index) == 4
    assert index.matched_tokens(request([1, 2, 3]), [a]) == {a: 2}
    assert index.matched_tokens(request([7, 8]), [a]) == {a: 2}


def test_matching_refreshes_nothing_but_recording_does() -> None:
    index = PrefixIndex(block_size=1, capacity=2)
    a = Endpoint("http://a", "decode")
    index.record(request([1]), [a])
    index.record(request([2]), [a])
    index.record(request([1]), [a])  # [1] is the most recent now
    index.record(request([3]), [a])
    assert index.matched_tokens(request([1]), [a]) == {a: 1}
    assert index.matched_tokens(request([2]), [a]) == {a: 0}


@settings(max_examples=50, deadline=None)
@given(
    capacity=st.integers(min_value=1, max_value=64),
    prompts=st.lists(st.lists(st.integers(0, 50), max_size=40), max_size=60),
)
def test_the_index_never_holds_more_blocks_than_its_capacity(capacity: int, prompts: list[list[int]]) -> None:
    index = PrefixIndex(block_size=2, capacity=capacity)
    endpoints = [Endpoint(f"http://e{i}", "decode") for i in range(3)]
    for turn, ids in enumerate(prompts):
        index.record(request(ids), [endpoints[turn % 3]])
        assert len(index) <= capacity


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(min_value=1, max_value=48),
    records=st.lists(
        st.tuples(st.lists(st.integers(0, 3), max_size=24), st.sets(st.integers(0, 3), min_size=1)), max_size=40
    ),
    probes=st.lists(st.lists(st.integers(0, 3), max_size=28), min_size=1, max_size=6),
)
def test_every_endpoint_holds_a_prefix_so_a_search_finds_what_a_walk_of_every_block_does(
    capacity: int, records: list[tuple[list[int], set[int]]], probes: list[list[int]]
) -> None:
    """Prompts that share prefixes, recorded on sets of endpoints and evicted past the capacity: each
    endpoint's blocks of any prompt's chain stay a prefix of it, so the binary search of each endpoint's
    depth matches the walk that checks every block."""
    index = PrefixIndex(block_size=2, capacity=capacity)
    endpoints = [Endpoint(f"http://e{i}", "decode") for i in range(4)]
    for ids, placed in records:
        index.record(request(ids), [endpoints[i] for i in sorted(placed)])
        for probe in [ids, *probes]:
            hashes = request(probe).block_hashes(2)
            everyone = index._bits.everyone
            assert prefix_closed_depths(hashes, index._entries, everyone) == matched_depths(
                hashes, index._entries, everyone
            )


def test_memory_stays_flat_under_a_million_distinct_prompt_blocks() -> None:
    index = PrefixIndex(block_size=16, capacity=10_000)
    a = Endpoint("http://a", "decode")
    for start in range(0, 16 * 1_000_000, 16 * 64):
        index.record(request(list(range(start, start + 16 * 64))), [a])  # 64 fresh blocks a prompt
        assert len(index) <= 10_000
    assert len(index) == 10_000


def test_matched_depths_reports_where_each_endpoint_drops_out() -> None:
    entries = {10: 0b11, 11: 0b11, 12: 0b01}
    assert matched_depths([10, 11, 12, 13], entries, 0b11) == {0b01: 3, 0b10: 2}
    assert matched_depths([10, 11, 12], entries, 0b01) == {0b01: 3}
    assert matched_depths([99], entries, 0b11) == {}


def test_an_index_that_has_seen_too_many_endpoint_urls_starts_afresh() -> None:
    from dpd_router.pool.endpoint import Endpoint
    from dpd_router.prompt.tokenizer import Prompt
    from dpd_router.routing import prefix_index as module
    from dpd_router.routing.request import RoutingRequest

    index = module.PrefixIndex(block_size=4, capacity=1000)
    request = RoutingRequest(Prompt(token_ids=list(range(16)), num_tokens=16, seconds=0.0))
    for i in range(module.MAX_ENDPOINT_URLS + 2):
        index.record(request, [Endpoint(f"http://10.0.{i // 250}.{i % 250}:8000", "prefill")])
    assert len(index._bits) <= module.MAX_ENDPOINT_URLS + 1
    fresh = Endpoint("http://10.9.9.9:8000", "prefill")
    index.record(request, [fresh])
    assert index.matched_tokens(request, [fresh])[fresh] == 16
