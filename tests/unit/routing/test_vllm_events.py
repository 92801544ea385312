"""vLLM KV events: decoding both wire shapes, the index they build, and a real ZMQ PUB on loopback."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from dpd_router.config import Settings
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.kv_sources.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventIndex,
    KVEventSubscriber,
    UndecodableBatch,
    decode_batch,
)
from dpd_router.routing.planner import Planner, build_planner
from dpd_router.routing.request import RoutingRequest
from dpd_sim.kv import block_hashes as sim_block_hashes
from dpd_sim.kv_events import EventFormat, encode_batch
from dpd_sim.kv_events import all_blocks_cleared as sim_cleared
from dpd_sim.kv_events import block_removed as sim_removed
from dpd_sim.kv_events import block_stored as sim_stored
from dpd_sim.kv_events import external_hash as sim_external_hash

BLOCK = 4
ENGINE = Endpoint("http://127.0.0.1:8100", "prefill")
OTHER = Endpoint("http://127.0.0.1:8101", "prefill")


def request(ids: list[int]) -> RoutingRequest:
    return RoutingRequest(Prompt(token_ids=ids, num_tokens=len(ids), seconds=0.0))


def stored_map(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", **extra}  # fmt: skip


def stored_array(hashes: list[Any], parent: Any, tokens: list[int]) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, BLOCK, None, "GPU"]


def batch_map(*events: Any, rank: int = 0) -> bytes:
    return msgpack.packb({"ts": time.time(), "events": list(events), "data_parallel_rank": rank})


def batch_array(*events: Any, rank: int | None = None) -> bytes:
    return msgpack.packb([time.time(), list(events)] + ([] if rank is None else [rank]))


def frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def index() -> KVEventIndex:
    return KVEventIndex(block_size=BLOCK, capacity_per_endpoint=1000)


# decoding


def test_map_batches_with_map_events_decode() -> None:
    batch = decode_batch(
        batch_map(
            stored_map([11, 12], None, list(range(8))),
            {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
            rank=2,
        )
    )
    assert batch.dp_rank == 2
    assert batch.events == [
        BlockStored([11, 12], None, list(range(8)), BLOCK, medium="GPU"),
        BlockRemoved([11], medium="GPU"),
        AllBlocksCleared(),
    ]


def test_array_batches_with_positional_events_decode() -> None:
    batch = decode_batch(
        batch_array(stored_array([b"\x01" * 32], 7, list(range(4))), ["BlockRemoved", [7]], ["AllBlocksCleared"])
    )
    assert batch.dp_rank == 0
    assert batch.events == [
        BlockStored([b"\x01" * 32], 7, list(range(4)), BLOCK, medium="GPU"),
        BlockRemoved([7]),
        AllBlocksCleared(),
    ]


def test_unknown_events_are_counted_and_skipped() -> None:
    batch = decode_batch(batch_array(["SomethingNew", 1], {"type": "BlockStored"}, ["AllBlocksCleared"]))
    assert (batch.events, batch.unknown) == ([AllBlocksCleared()], 2)


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb("hello"), msgpack.packb({"ts": "x", "events": []})])
def test_garbage_is_undecodable(payload: bytes) -> None:
    with pytest.raises(UndecodableBatch):
        decode_batch(payload)


# the index


def test_stored_blocks_are_matched_by_their_tokens_not_the_engines_hashes() -> None:
    kv = index()
    kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([901, 902], None, list(range(8))))))
    assert kv.matched_tokens(request(list(range(10))), [ENGINE]) == {ENGINE: 8}
    assert kv.matched_tokens(request([0, 1, 2, 3, 9, 9, 9, 9]), [ENGINE]) == {ENGINE: 4}


def test_a_block_continues_the_chain_of_its_parent() -> None:
    kv = index()
    kv.apply(ENGINE.url, decode_batch(batch_array(stored_array([901], None, [1, 2, 3, 4]))))
    kv.apply(ENGINE.url, decode_batch(batch_array(stored_array([902, 903], 901, [5, 6, 7, 8, 9, 10, 11, 12]))))
    assert kv.matched_tokens(request(list(range(1, 13))), [ENGINE]) == {ENGINE: 12}


def test_blocks_whose_parent_was_never_seen_are_skipped() -> None:
    kv = index()
    applied = kv.apply(ENGINE.url, decode_batch(batch_array(stored_array([902], 555, [5, 6, 7, 8]))))
    assert (applied.stored, applied.skipped) == (0, 1)
    assert len(kv) == 0


@pytest.mark.parametrize(
    "extra", [{"block_size": 16}, {"lora_id": 3}, {"lora_name": "adapter"}], ids=["block size", "lora id", "lora name"]
)
def test_blocks_the_router_cannot_match_are_skipped(extra: dict[str, Any]) -> None:
    kv = index()
    applied = kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([901], None, [1, 2, 3, 4], **extra))))
    assert (applied.stored, applied.skipped, len(kv)) == (0, 1, 0)


def test_removed_blocks_shorten_the_match_and_a_clear_empties_it() -> None:
    kv = index()
    kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([901, 902, 903], None, list(range(12))))))
    kv.apply(OTHER.url, decode_batch(batch_map(stored_map([901], None, list(range(4))))))
    kv.apply(ENGINE.url, decode_batch(batch_map({"type": "BlockRemoved", "block_hashes": [902]})))
    assert kv.matched_tokens(request(list(range(12))), [ENGINE, OTHER]) == {ENGINE: 4, OTHER: 4}
    kv.apply(ENGINE.url, decode_batch(batch_map({"type": "AllBlocksCleared"})))
    assert kv.matched_tokens(request(list(range(12))), [ENGINE, OTHER]) == {ENGINE: 0, OTHER: 4}
    assert kv.blocks_of(ENGINE.url) == 0


def test_a_block_copied_to_another_tier_stays_until_removed_from_both() -> None:
    kv = index()
    kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([901], None, [1, 2, 3, 4]))))
    kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([901], None, [], medium="CPU"))))  # no tokens needed
    kv.apply(ENGINE.url, decode_batch(batch_map({"type": "BlockRemoved", "block_hashes": [901], "medium": "GPU"})))
    assert kv.matched_tokens(request([1, 2, 3, 4]), [ENGINE]) == {ENGINE: 4}
    kv.apply(ENGINE.url, decode_batch(batch_map({"type": "BlockRemoved", "block_hashes": [901], "medium": "CPU"})))
    assert kv.matched_tokens(request([1, 2, 3, 4]), [ENGINE]) == {ENGINE: 0}


def test_a_replayed_store_does_not_outlive_its_removal() -> None:
    kv = index()
    for _ in range(3):
        kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([901], None, [1, 2, 3, 4]))))
    kv.apply(ENGINE.url, decode_batch(batch_map({"type": "BlockRemoved", "block_hashes": [901], "medium": "GPU"})))
    assert kv.matched_tokens(request([1, 2, 3, 4]), [ENGINE]) == {ENGINE: 0}


def test_data_parallel_ranks_keep_their_own_engine_hashes() -> None:
    kv = index()
    kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([901], None, [1, 2, 3, 4]), rank=0)))
    kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([901], None, [5, 6, 7, 8]), rank=1)))
    kv.apply(ENGINE.url, decode_batch(batch_map({"type": "BlockRemoved", "block_hashes": [901]}, rank=1)))
    assert kv.matched_tokens(request([1, 2, 3, 4]), [ENGINE]) == {ENGINE: 4}
    assert kv.matched_tokens(request([5, 6, 7, 8]), [ENGINE]) == {ENGINE: 0}


def test_each_endpoint_keeps_at_most_its_capacity() -> None:
    kv = KVEventIndex(block_size=BLOCK, capacity_per_endpoint=10)
    for start in range(0, 400, 4):
        kv.apply(ENGINE.url, decode_batch(batch_map(stored_map([start], None, list(range(start, start + 4))))))
        assert kv.blocks_of(ENGINE.url) <= 10 and len(kv) <= 10
    assert kv.matched_tokens(request(list(range(396, 400))), [ENGINE]) == {ENGINE: 4}
    assert kv.matched_tokens(request(list(range(0, 4))), [ENGINE]) == {ENGINE: 0}


def test_an_engine_never_heard_from_gives_no_answer() -> None:
    kv = index()
    assert kv.matched_tokens(request(list(range(8))), [ENGINE]) is None
    kv.apply(OTHER.url, decode_batch(batch_map()))
    assert kv.matched_tokens(request(list(range(8))), [ENGINE, OTHER]) == {ENGINE: 0, OTHER: 0}


# sequence numbers


def kv_event_count(metrics: RouterMetrics, url: str, kind: str) -> float:
    return metrics.registry.get_sample_value("dpd_router_kv_events_total", {"endpoint": url, "kind": kind}) or 0.0


def test_a_gap_in_sequence_numbers_is_counted_and_a_restart_forgets_the_engine() -> None:
    metrics = RouterMetrics()
    subscriber = KVEventSubscriber(index(), {ENGINE.url: ["tcp://127.0.0.1:1"]}, metrics)
    seq = subscriber.receive(ENGINE.url, frames(0, batch_map(stored_map([901], None, [1, 2, 3, 4]))), None)
    seq = subscriber.receive(ENGINE.url, frames(5, batch_map()), seq)
    assert (seq, kv_event_count(metrics, ENGINE.url, "gap")) == (5, 4.0)
    assert subscriber.index.matched_tokens(request([1, 2, 3, 4]), [ENGINE]) == {ENGINE: 4}
    seq = subscriber.receive(ENGINE.url, frames(0, batch_map()), seq)
    assert kv_event_count(metrics, ENGINE.url, "restart") == 1.0
    assert subscriber.index.matched_tokens(request([1, 2, 3, 4]), [ENGINE]) == {ENGINE: 0}


def test_malformed_messages_are_counted_not_raised() -> None:
    metrics = RouterMetrics()
    subscriber = KVEventSubscriber(index(), {ENGINE.url: ["tcp://127.0.0.1:1"]}, metrics)
    assert subscriber.receive(ENGINE.url, [b"only-one-frame"], 3) == 3
    assert subscriber.receive(ENGINE.url, frames(4, b"\xc1"), 3) == 3
    assert kv_event_count(metrics, ENGINE.url, "undecodable") == 2.0


# over a real socket


async def wait_for_match(subscriber: KVEventSubscriber, ids: list[int], tokens: int, deadline: float) -> None:
    while subscriber.index.matched_tokens(request(ids), [ENGINE]) != {ENGINE: tokens}:
        assert time.monotonic() < deadline, f"the index never matched {tokens} tokens"
        await asyncio.sleep(0.01)


async def test_the_subscriber_indexes_events_from_a_real_zmq_publisher() -> None:
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    metrics = RouterMetrics()
    subscriber = KVEventSubscriber(index(), {ENGINE.url: [f"tcp://127.0.0.1:{port}"]}, metrics)
    subscriber.start()
    system = list(range(100, 108))
    try:
        # A SUB socket joins late: publish until the first batch is seen (at most 5 s).
        deadline = time.monotonic() + 5
        seq = 0
        while subscriber.index.matched_tokens(request(system), [ENGINE]) in (None, {ENGINE: 0}):
            assert time.monotonic() < deadline, "the subscriber never received the publisher's events"
            positional = batch_array(stored_array([-5, -6], None, system), rank=0)
            await publisher.send_multipart(frames(seq, positional))
            seq += 1
            await asyncio.sleep(0.02)
        # A current engine's map-shaped batch continues the chain from the second block.
        longer = [*system, 1, 2, 3, 4]
        await publisher.send_multipart(frames(seq, batch_map(stored_map([b"\x07" * 32], -6, [1, 2, 3, 4]))))
        await wait_for_match(subscriber, longer, 12, deadline)
        await publisher.send_multipart(frames(seq + 1, batch_map({"type": "BlockRemoved", "block_hashes": [-6]})))
        await wait_for_match(subscriber, longer, 4, deadline)
        assert subscriber.index.blocks_of(ENGINE.url) == 2
        assert kv_event_count(metrics, ENGINE.url, "removed") == 1.0
    finally:
        await subscriber.close()
        publisher.close(linger=0)
        context.term()


async def test_subscriptions_follow_the_pool_as_engines_come_and_go() -> None:
    """With kv_events_port, an engine discovery adds is subscribed to; one that leaves is dropped and forgotten."""
    settings = Settings(
        prefill_strategy="kvaware", kv_events_port=5557, block_size=4, decode_urls=["http://127.0.0.1:9000"]
    )
    pool = Pool([], settings.decode_urls)
    subscriber = KVEventSubscriber.from_settings(settings, pool, RouterMetrics())
    assert subscriber is not None
    subscriber.start()
    try:
        assert subscriber.subscriptions == [("http://127.0.0.1:9000", "tcp://127.0.0.1:5557")]
        pool.add("http://10.0.0.7:8000", "prefill")
        subscriber.refresh()
        assert ("http://10.0.0.7:8000", "tcp://10.0.0.7:5557") in subscriber.subscriptions
        subscriber.receive("http://10.0.0.7:8000", frames(0, batch_map(stored_map([901], None, [1, 2, 3, 4]))), None)
        newcomer = pool.get("http://10.0.0.7:8000")
        assert newcomer is not None
        assert subscriber.index.matched_tokens(request([1, 2, 3, 4]), [newcomer]) == {newcomer: 4}

        pool.remove(newcomer)
        subscriber.refresh()
        assert subscriber.subscriptions == [("http://127.0.0.1:9000", "tcp://127.0.0.1:5557")]
        assert subscriber.index.blocks_of("http://10.0.0.7:8000") == 0
    finally:
        await subscriber.close()
    assert subscriber.subscriptions == []


# the planner on engine reports


def kvaware_planner(kv: KVEventIndex) -> Planner:
    settings = Settings(
        prefill_urls=["http://127.0.0.1:8100", "http://127.0.0.1:8101"],
        decode_urls=["http://127.0.0.1:8200", "http://127.0.0.1:8201"],
        prefill_strategy="kvaware",
        block_size=BLOCK,
        routing_threshold=8,
    )
    return build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics(), kv_sources=[kv])


def test_kvaware_sends_a_prompt_to_the_prefiller_the_engines_say_holds_it() -> None:
    kv = index()
    planner = kvaware_planner(kv)
    holder = planner.pool.prefillers[1]
    kv.apply(holder.url, decode_batch(batch_map(stored_map([901, 902], None, list(range(8))))))
    holder.in_flight = 2
    plan = planner.plan(Prompt(token_ids=list(range(40)), num_tokens=40, seconds=0.0))
    assert (plan.reason, plan.prefiller) == ("long_prompt", holder)


def test_a_prefix_the_decoders_engine_reports_makes_a_long_prompt_go_direct() -> None:
    kv = index()
    planner = kvaware_planner(kv)
    decoder = planner.pool.decoders[1]
    kv.apply(decoder.url, decode_batch(batch_map(stored_map(list(range(10)), None, list(range(40))))))
    plan = planner.plan(Prompt(token_ids=list(range(44)), num_tokens=44, seconds=0.0))
    assert (plan.path, plan.reason, plan.decoder, plan.uncached_tokens) == ("direct", "cached_on_decoder", decoder, 4)


# what the simulated engines send (byte for byte vLLM's msgspec encoding, in both event shapes)


@pytest.mark.parametrize("event_format", ["map", "array"])
def test_the_simulated_engines_events_index_like_real_vllms(event_format: EventFormat) -> None:
    prompt = list(range(1000, 1040))
    engine_hashes = [sim_external_hash(block) for block in sim_block_hashes(prompt)]  # u64, like vLLM's
    kv = KVEventIndex(block_size=16, capacity_per_endpoint=1000)
    first = sim_stored(engine_hashes[:1], None, prompt[:16])
    rest = sim_stored(engine_hashes[1:], engine_hashes[0], prompt[16:32])
    batch = decode_batch(encode_batch(time.time(), [first, rest], event_format))
    assert (batch.dp_rank, batch.unknown) == (0, 0)
    assert batch.events == [
        BlockStored(engine_hashes[:1], None, prompt[:16], 16, medium="GPU"),
        BlockStored(engine_hashes[1:], engine_hashes[0], prompt[16:32], 16, medium="GPU"),
    ]
    assert kv.apply(ENGINE.url, batch).counts() == {"stored": 2}
    assert kv.matched_tokens(request([*prompt, 7]), [ENGINE]) == {ENGINE: 32}
    removed = decode_batch(encode_batch(time.time(), [sim_removed(engine_hashes[1:])], event_format))
    assert kv.apply(ENGINE.url, removed).counts() == {"removed": 1}
    assert kv.matched_tokens(request([*prompt, 7]), [ENGINE]) == {ENGINE: 16}
    cleared = decode_batch(encode_batch(time.time(), [sim_cleared()], event_format))
    assert kv.apply(ENGINE.url, cleared).counts() == {"cleared": 1}
    assert kv.blocks_of(ENGINE.url) == 0
