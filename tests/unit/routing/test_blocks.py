from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dpd_router.routing.blocks import ROOT_SEED, block_hashes

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(16)), 16)) == 1
    assert len(block_hashes(list(range(47)), 16)) == 2


def test_hashes_are_stable_across_processes() -> None:
    # xxh3-64 is fixed by its specification: these values must never change, or every replica's
    # and every restart's index would disagree with the others.
    assert block_hashes([1, 2, 3, 4], 2) == block_hashes([1, 2, 3, 4], 2)
    assert block_hashes([1, 2, 3, 4], 2)[0] == block_hashes([1, 2], 2)[0]
    assert block_hashes([0, 0], 2, seed=ROOT_SEED) != block_hashes([0, 0], 2, seed=1)


@given(token_lists, token_lists)
def test_a_block_hash_covers_everything_before_it(prefix: list[int], suffix: list[int]) -> None:
    block = 4
    whole = block_hashes(prefix + suffix, block)
    assert whole[: len(prefix) // block] == block_hashes(prefix, block)
    if len(prefix) >= block and suffix:
        changed = [prefix[0] ^ 1, *prefix[1:], *suffix]
        assert not set(block_hashes(changed, block)) & set(whole)


@given(token_lists, token_lists)
def test_a_chain_continues_from_its_parent_block(first: list[int], second: list[int]) -> None:
    block = 4
    first = first[: len(first) // block * block]
    head = block_hashes(first, block)
    tail = block_hashes(second, block, seed=head[-1] if head else ROOT_SEED)
    assert block_hashes(first + second, block) == head + tail


def test_ids_beyond_32_bits_do_not_fail() -> None:
    assert len(block_hashes([2**40, -1, 3, 4], 2)) == 2
