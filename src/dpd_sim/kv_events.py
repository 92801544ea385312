"""vLLM KV-cache events from a simulated engine: what its prefix cache stores, evicts and clears, over ZMQ.

The wire format is what vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py) sends when run
with `--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","topic":"kv-events"}'`:

- a PUB socket; every message is `[topic, seq, payload]`, `seq` an 8-byte big-endian counter from 0;
- `payload` is msgpack of the batch `[ts, [event, ...], data_parallel_rank]` (a msgspec
  `array_like` struct; the rank is 0 on an engine that is not data-parallel);
- each event is a msgspec struct tagged with its class name. `map`, what vLLM sends since it dropped
  `array_like` from the event structs (PR #42892, after 0.23), fields equal to their default left out:
  `{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
  "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, ...],
  "group_idx": 0, "kv_cache_spec_kind": "full_attention"}`; `array`, what earlier releases send:
  the same fields by position after the tag (`["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name, ...]`), every field present.

Block hashes are 64-bit ints (the last 8 bytes of the engine's block hash, as vLLM sends with its
default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`). Events raised while the event loop runs one task
are sent as one batch, as vLLM sends one batch per engine step. An optional ROUTER socket replays
the last batches: a request `[b"", start_seq]` (a REQ socket adds the empty frame) is answered with
`[b"", seq, payload]` for every buffered batch from `start_seq`, then `[b"", -1, b""]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import msgpack
import zmq
import zmq.asyncio

from dpd_sim.kv import BLOCK_SIZE
from dpd_sim.tasks import cancel_and_wait

log = logging.getLogger("dpd_sim.kv_events")

EventFormat = Literal["map", "array"]
EVENT_FORMATS: tuple[EventFormat, ...] = ("map", "array")
DEFAULT_TOPIC = "kv-events"
MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEvent(NamedTuple):
    """One event as vLLM's msgspec struct holds it: tag, fields in declaration order, and the index
    of the first field that has a default (None). msgspec's `omit_defaults` leaves such a field out
    of a map when it holds its default; an `array_like` struct always carries every field."""

    tag: str
    fields: tuple[tuple[str, Any], ...]
    first_default: int

    def encode(self, event_format: EventFormat) -> dict[str, Any] | list[Any]:
        if event_format == "map":
            encoded: dict[str, Any] = {"type": self.tag}
            for position, (name, value) in enumerate(self.fields):
                if position < self.first_default or value is not None:
                    encoded[name] = value
            return encoded
        return [self.tag, *(value for _, value in self.fields)]


def external_hash(block_hash: bytes) -> int:
    """The hash an event carries for one of the engine's blocks (vLLM's `maybe_convert_block_hash`)."""
    return int.from_bytes(block_hash[-8:], "big")


def block_stored(hashes: Sequence[int], parent: int | None, token_ids: Sequence[int]) -> KvEvent:
    """Full blocks newly in the prefix cache: `token_ids` are theirs alone, `parent` the block before."""
    fields = (
        ("block_hashes", list(hashes)),
        ("parent_block_hash", parent),
        ("token_ids", list(token_ids)),
        ("block_size", BLOCK_SIZE),
        ("lora_id", None),
        ("medium", MEDIUM_GPU),
        ("lora_name", None),
        ("extra_keys", [None] * len(hashes)),
        ("group_idx", 0),
        ("kv_cache_spec_kind", "full_attention"),
        ("kv_cache_spec_sliding_window", None),
    )
    return KvEvent("BlockStored", fields, first_default=7)


def block_removed(hashes: Sequence[int]) -> KvEvent:
    fields = (("block_hashes", list(hashes)), ("medium", MEDIUM_GPU), ("group_idx", 0))
    return KvEvent("BlockRemoved", fields, first_default=2)


def all_blocks_cleared() -> KvEvent:
    return KvEvent("AllBlocksCleared", (), first_default=0)


def encode_batch(ts: float, events: Sequence[KvEvent], event_format: EventFormat, dp_rank: int | None = 0) -> bytes:
    batch: list[Any] = [ts, [event.encode(event_format) for event in events]]
    if dp_rank is not None:
        batch.append(dp_rank)
    return bytes(msgpack.packb(batch, use_bin_type=True))


def zmq_address(host: str, port: int) -> str:
    if host in ("", "*"):
        return f"tcp://*:{port}"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class KvEventPublisher:
    """A ZMQ PUB socket (and optionally a replay ROUTER socket) sending the engine's KV events.

    `publish` is synchronous and cheap (it queues the event); a task sends everything queued since
    its last turn as one batch, so events keep their order and a step's events share a batch.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        topic: str = DEFAULT_TOPIC,
        event_format: EventFormat = "map",
        replay_port: int | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        if event_format not in EVENT_FORMATS:
            raise ValueError(f"event_format must be one of {', '.join(EVENT_FORMATS)}")
        self.address = zmq_address(host, port)
        self.replay_address = zmq_address(host, replay_port) if replay_port is not None else None
        self.topic = topic.encode()
        self.event_format: EventFormat = event_format
        self._ipv6 = ":" in host
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pending: list[KvEvent] = []
        self._wake = asyncio.Event()
        self._next_seq = 0
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def published(self) -> int:
        """Batches sent so far (the next batch's sequence number)."""
        return self._next_seq

    def publish(self, event: KvEvent) -> None:
        self._pending.append(event)
        self._wake.set()

    # The prefix cache's listener (dpd_sim.kv.PrefixCacheListener).

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int]) -> None:
        parent_hash = None if parent is None else external_hash(parent)
        self.publish(block_stored([external_hash(block) for block in hashes], parent_hash, token_ids))

    def removed(self, hashes: Sequence[bytes]) -> None:
        self.publish(block_removed([external_hash(block) for block in hashes]))

    def cleared(self) -> None:
        self.publish(all_blocks_cleared())

    async def start(self) -> None:
        """Bind the sockets (raises zmq.ZMQError if a port is taken) and start sending."""
        if self._context is not None:
            return
        self._context = zmq.asyncio.Context()
        try:
            self._pub = self._socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, self._hwm)
            self._pub.bind(self.address)
            if self.replay_address is not None:
                self._replay = self._socket(zmq.ROUTER)
                self._replay.bind(self.replay_address)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._tasks.append(asyncio.create_task(self._send_batches(), name="sim-kv-events"))
        if self._replay is not None:
            self._tasks.append(asyncio.create_task(self._serve_replays(), name="sim-kv-events-replay"))
        log.info(
            "publishing KV events on %s (topic %r, %s events)", self.address, self.topic.decode(), self.event_format
        )

    async def close(self) -> None:
        """Send what is still queued, then close the sockets."""
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)
        if self._pub is not None and self._pending:
            with contextlib.suppress(zmq.ZMQError):
                await self._flush()
        self._close_sockets()

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self._context is not None
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if self._ipv6:
            socket.setsockopt(zmq.IPV6, 1)
        return socket

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _send_batches(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._flush()
            except zmq.ZMQError as exc:
                log.error("KV event batch not sent: %s", exc)

    async def _flush(self) -> None:
        assert self._pub is not None
        events, self._pending = self._pending, []
        if not events:
            return
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(time.time(), events, self.event_format)
        self._buffer.append((seq, payload))
        await self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV event replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", END_SEQ, b""))
