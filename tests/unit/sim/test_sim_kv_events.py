"""The simulated engine's vLLM KV events: the encodings, the prefix cache's reports, and a real ZMQ SUB."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from dpd_sim.kv import BLOCK_SIZE, PrefixCache, block_hashes
from dpd_sim.kv_events import (
    END_SEQ,
    EventFormat,
    KvEventPublisher,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
    external_hash,
)
from dpd_sim.ports import free_port
from tests.unit.sim.conftest import EngineFactory

TIMEOUT = 20.0  # a bound for a failure only: a loaded CI machine can take seconds to join a SUB socket


# the encodings


def test_map_events_are_tagged_maps_without_default_fields_as_current_vllm_sends() -> None:
    stored = block_stored([11, 12], 10, list(range(32))).encode("map")
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": 10,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert list(stored)[:4] == ["type", "block_hashes", "parent_block_hash", "token_ids"]
    assert block_removed([11]).encode("map") == {
        "type": "BlockRemoved",
        "block_hashes": [11],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert all_blocks_cleared().encode("map") == {"type": "AllBlocksCleared"}


def test_array_events_are_tagged_positional_arrays_as_earlier_vllm_sends() -> None:
    stored = block_stored([11, 12], None, list(range(32))).encode("array")
    assert stored == [
        "BlockStored",
        [11, 12],
        None,
        list(range(32)),
        16,
        None,
        "GPU",
        None,
        [None, None],
        0,
        "full_attention",
        None,
    ]
    assert block_removed([11]).encode("array") == ["BlockRemoved", [11], "GPU", 0]
    assert all_blocks_cleared().encode("array") == ["AllBlocksCleared"]


@pytest.mark.parametrize("event_format", ["map", "array"])
def test_a_batch_is_ts_events_and_rank(event_format: EventFormat) -> None:
    ts, events, rank = msgpack.unpackb(encode_batch(12.5, [all_blocks_cleared()], event_format))
    assert (ts, rank) == (12.5, 0)
    assert events == [{"type": "AllBlocksCleared"} if event_format == "map" else ["AllBlocksCleared"]]
    assert msgpack.unpackb(encode_batch(1.0, [], event_format, dp_rank=None)) == [1.0, []]


def test_block_hashes_are_sent_as_64_bit_ints() -> None:
    (first,) = block_hashes(list(range(16)))
    assert external_hash(first) == int.from_bytes(first[-8:], "big") < 2**64


# what the prefix cache reports


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int]) -> None:
        self.calls.append(("stored", list(hashes), parent, list(token_ids)))

    def removed(self, hashes: Sequence[bytes]) -> None:
        self.calls.append(("removed", list(hashes)))

    def cleared(self) -> None:
        self.calls.append(("cleared",))


def test_the_prefix_cache_reports_new_blocks_with_their_parent_and_tokens() -> None:
    recorder = Recorder()
    cache = PrefixCache(capacity_blocks=100, listener=recorder)
    prompt = list(range(40))
    cache.insert(block_hashes(prompt), prompt)
    cache.insert(block_hashes(prompt), prompt)  # already cached: nothing new
    longer = [*prompt[:32], *range(500, 548)]
    hashes = block_hashes(longer)
    cache.insert(hashes, longer)
    cache.clear()
    assert recorder.calls == [
        ("stored", block_hashes(prompt), None, prompt[:32]),
        ("stored", hashes[2:5], hashes[1], longer[32:80]),
        ("cleared",),
    ]
    assert len(cache) == 0


def test_eviction_reports_removed_blocks_tail_first() -> None:
    recorder = Recorder()
    cache = PrefixCache(capacity_blocks=4, listener=recorder)
    first, second = list(range(48)), list(range(100, 132))
    cache.insert(block_hashes(first), first)
    cache.insert(block_hashes(second), second)
    evicted = recorder.calls[-1]
    assert evicted == ("removed", [block_hashes(first)[2]])
    assert cache.cached_tokens(block_hashes(first), len(first)) == 32, "the prompt's leading blocks stay"


# the publisher on a real socket


@asynccontextmanager
async def subscriber(address: str, topic: bytes = b"kv-events") -> AsyncIterator[zmq.asyncio.Socket]:
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(address)
    try:
        yield sub
    finally:
        sub.close(linger=0)
        context.term()


async def joined(sub: zmq.asyncio.Socket, trigger: Callable[[], Awaitable[None]]) -> list[bytes]:
    """A SUB socket misses what is sent before it has joined: trigger events until one arrives."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        await trigger()
        if await sub.poll(50):
            frames: list[bytes] = await sub.recv_multipart()
            return frames
    raise AssertionError("the subscriber never received the publisher's events")


async def next_batch(sub: zmq.asyncio.Socket, after: int) -> tuple[int, list[Any]]:
    """The first batch numbered above `after` (the joining probes' batches are skipped)."""
    while True:
        topic, seq_bytes, payload = await asyncio.wait_for(sub.recv_multipart(), TIMEOUT)
        assert topic == b"kv-events" and len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        if seq > after:
            return seq, events


def last_seq(publisher: KvEventPublisher | None) -> int:
    assert publisher is not None
    return publisher.published - 1


@pytest.mark.parametrize("event_format", ["map", "array"])
async def test_the_publisher_sends_numbered_batches_of_one_step(event_format: EventFormat) -> None:
    port = free_port()
    publisher = KvEventPublisher("127.0.0.1", port, event_format=event_format)
    await publisher.start()
    try:
        async with subscriber(f"tcp://127.0.0.1:{port}") as sub:

            async def probe() -> None:
                publisher.cleared()

            await joined(sub, probe)
            last = last_seq(publisher)
            prompt = list(range(40))
            hashes = block_hashes(prompt)
            publisher.stored(hashes, None, prompt[:32])  # one loop turn: one batch
            publisher.removed(hashes[1:])
            seq, events = await next_batch(sub, after=last)
            assert seq == last + 1 == last_seq(publisher)
            expected = [
                block_stored([external_hash(block) for block in hashes], None, prompt[:32]).encode(event_format),
                block_removed([external_hash(hashes[1])]).encode(event_format),
            ]
            assert events == expected
    finally:
        await publisher.close()


async def test_the_replay_socket_resends_batches_from_a_sequence_number() -> None:
    port, replay_port = free_port(), free_port()
    publisher = KvEventPublisher("127.0.0.1", port, replay_port=replay_port)
    await publisher.start()
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        for _ in range(3):
            publisher.cleared()
            await asyncio.sleep(0.01)
        assert publisher.published == 3
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = [await asyncio.wait_for(dealer.recv_multipart(), TIMEOUT) for _ in range(3)]
        assert [int.from_bytes(reply[1], "big") for reply in replies[:2]] == [1, 2]
        assert all(msgpack.unpackb(reply[2])[1] == [{"type": "AllBlocksCleared"}] for reply in replies[:2])
        assert replies[2] == [b"", END_SEQ, b""]
    finally:
        dealer.close(linger=0)
        context.term()
        await publisher.close()


# an engine's events


async def test_an_engine_publishes_what_its_prefix_cache_stores_evicts_and_clears(engine: EngineFactory) -> None:
    port = free_port()
    async with (
        engine(role="both", kv_events_port=port, prefix_cache_blocks=6) as e,
        subscriber(f"tcp://127.0.0.1:{port}") as sub,
    ):

        async def reset() -> None:
            assert (await e.client.post("/sim/reset_prefix_cache")).status_code == 200

        frames = await joined(sub, reset)
        assert msgpack.unpackb(frames[2])[1] == [{"type": "AllBlocksCleared"}]
        first = list(range(1000, 1070))  # 4 full blocks and 6 tokens
        seq = last_seq(e.core.kv_events)
        await e.client.post("/v1/completions", json={"prompt": first, "max_tokens": 2})
        seq, events = await next_batch(sub, after=seq)
        hashes = [external_hash(block) for block in block_hashes(first)]
        assert events == [block_stored(hashes, None, first[:64]).encode("map")]

        second = list(range(2000, 2048))  # 3 more blocks: one over the cache's six
        await e.client.post("/v1/completions", json={"prompt": second, "max_tokens": 2})
        seq, events = await next_batch(sub, after=seq)
        assert [event["type"] for event in events] == ["BlockStored", "BlockRemoved"]
        assert events[1]["block_hashes"] == [hashes[-1]], "the least recently used block goes, tail first"

        await e.client.post("/reset_prefix_cache")
        _, events = await next_batch(sub, after=seq)
        assert events == [{"type": "AllBlocksCleared"}]


async def test_a_decoder_publishes_the_blocks_it_received(engine: EngineFactory, live_engine: EngineFactory) -> None:
    port = free_port()
    async with (
        live_engine(role="prefill") as prefiller,
        engine(role="decode", kv_events_port=port, kv_events_format="array") as decoder,
        subscriber(f"tcp://127.0.0.1:{port}") as sub,
    ):

        async def reset() -> None:
            await decoder.client.post("/sim/reset_prefix_cache")

        await joined(sub, reset)
        seq = last_seq(decoder.core.kv_events)
        prompt = list(range(3000, 3040))
        prefilled = await prefiller.client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        params = prefilled.json()["kv_transfer_params"]
        answer = await decoder.client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
        )
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        _, events = await next_batch(sub, after=seq)
        hashes = [external_hash(block) for block in block_hashes(prompt)]
        assert events == [block_stored(hashes, None, prompt[: 2 * BLOCK_SIZE]).encode("array")]
