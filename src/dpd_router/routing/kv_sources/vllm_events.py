"""vLLM KV-cache events: where each engine says its KV blocks are, as a routing cache source.

Each engine (each data-parallel rank) publishes on a ZMQ PUB socket
(`--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}'`)
multipart messages `[topic, seq (8-byte big-endian), msgpack(batch)]`. A batch is
`[ts, [event...], dp_rank]` (vLLM's `EventBatch` is a msgspec `array_like` struct; the map
`{"ts", "events", "data_parallel_rank"}` is accepted too). An event is a map with a `type` key
(vLLM after 0.23, since PR #42892) or, from earlier engines, a positional array headed by its type:

    BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
    BlockRemoved     block_hashes, medium
    AllBlocksCleared

Engine block hashes are engine-internal (salted, and different across vLLM versions), so the index
re-keys every stored block by the router's own chained hash of its `token_ids` (blocks.py), seeded
with the parent block's router hash. A request then matches engines' blocks exactly as it matches
the router's prefix index. `block_size` must equal the engines' `--block-size`; events with another
block size, LoRA blocks and blocks whose parent the index never saw are skipped and counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq
import zmq.asyncio

from dpd_router.config import Settings
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.blocks import ROOT_SEED, block_hashes
from dpd_router.routing.prefix_index import EndpointBits, matched_depths
from dpd_router.routing.request import RoutingRequest
from dpd_router.startup.tasks import cancel_and_wait

log = logging.getLogger("dpd_router.kv_events")

# A ZMQ message larger than this is dropped by the socket (a 128k-token BlockStored is ~0.6 MiB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[Hashable]
    parent_block_hash: Hashable | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora: bool = False


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[Hashable]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    dp_rank: int
    unknown: int = 0


class UndecodableBatch(ValueError):
    """The payload is not a msgpack KV-event batch in either known shape."""


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack batch; events of unknown types are counted in `unknown` and dropped."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise UndecodableBatch(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise UndecodableBatch("a batch is [ts, events, dp_rank] or {ts, events, data_parallel_rank}")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise UndecodableBatch("a batch needs a numeric ts and a list of events")
    decoded: list[KVEvent] = []
    unknown = 0
    for item in events:
        event = _decode_event(item)
        if event is None:
            unknown += 1
        else:
            decoded.append(event)
    return EventBatch(float(ts), decoded, rank if isinstance(rank, int) else 0, unknown)


def _decode_event(item: Any) -> KVEvent | None:
    if isinstance(item, dict):
        kind, fields = item.get("type"), item
    elif isinstance(item, list) and item and isinstance(item[0], str):
        kind, fields = item[0], _POSITIONAL.get(item[0], {})
        fields = {name: item[index] for name, index in fields.items() if index < len(item)}
    else:
        return None
    try:
        if kind == "BlockStored":
            return BlockStored(
                block_hashes=_hashes(fields["block_hashes"]),
                parent_block_hash=_hash_key(fields.get("parent_block_hash")),
                token_ids=list(fields.get("token_ids") or ()),
                block_size=int(fields["block_size"]),
                medium=_medium(fields.get("medium")),
                lora=fields.get("lora_id") is not None or fields.get("lora_name") is not None,
            )
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(fields["block_hashes"]), _medium(fields.get("medium")))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError):
        return None
    return None


# Field positions in the array form (msgspec array_like structs: the tag, then every field in order;
# older engines have fewer fields, newer ones more after these).
_POSITIONAL: dict[str, dict[str, int]] = {
    "BlockStored": {
        "block_hashes": 1,
        "parent_block_hash": 2,
        "token_ids": 3,
        "block_size": 4,
        "lora_id": 5,
        "medium": 6,
        "lora_name": 7,
    },
    "BlockRemoved": {"block_hashes": 1, "medium": 2},
    "AllBlocksCleared": {},
}


def _medium(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# Storage tiers as bits of a block's entry; an unknown tier shares the last bit.
_TIER_BITS = {"GPU": 1, "CPU": 2, "CPU_PINNED": 2, "DISK": 4}
_OTHER_TIER = 8
_ALL_TIERS = 15


def _tier(medium: str | None) -> int:
    return 1 if medium is None else _TIER_BITS.get(medium, _OTHER_TIER)


def _hash_key(value: Any) -> Hashable | None:
    if value is None or isinstance(value, int | bytes | str):
        return value
    raise TypeError(f"a block hash is an int or bytes, not {type(value).__name__}")


def _hashes(values: Any) -> list[Hashable]:
    if not isinstance(values, list):
        raise TypeError("block_hashes must be a list")
    return [_hash_key(value) for value in values]


def _engine_key(rank: int, block: Hashable) -> Hashable:
    """Engine hashes are per data-parallel rank; rank 0 keys by the bare hash to stay small."""
    return block if not rank else (rank, block)


def _rank_of(key: Hashable) -> int:
    return key[0] if isinstance(key, tuple) else 0


class _EngineBlocks:
    """One endpoint's blocks as its events describe them, bounded to `capacity` (LRU by store).

    `_blocks` maps the engine's key to [router hash, tiers]: a block stored in two tiers (GPU, then
    CPU) stays held until removed from both; storing it twice in one tier (a replayed event) is
    harmless. A removal without a medium removes it from every tier. `_refs` counts the engine keys
    behind each router hash; the shared `held` bitmask has this endpoint's bit while that count > 0.
    """

    def __init__(self, bit: int, held: dict[int, int], capacity: int) -> None:
        self._bit = bit
        self._held = held
        self._capacity = capacity
        self._blocks: OrderedDict[Hashable, list[int]] = OrderedDict()
        self._refs: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def store(self, event: BlockStored, rank: int, block_size: int) -> tuple[int, int]:
        """Apply a BlockStored; returns (blocks stored, blocks skipped)."""
        count = len(event.block_hashes)
        if event.lora or event.block_size != block_size:
            return 0, count
        seed = ROOT_SEED
        if event.parent_block_hash is not None:
            parent = self._blocks.get(_engine_key(rank, event.parent_block_hash))
            if parent is None:
                return 0, count
            seed = parent[0]
        ours: list[int] = []
        if len(event.token_ids) >= count * block_size:
            ours = block_hashes(event.token_ids[: count * block_size], block_size, seed=seed)
        tier = _tier(event.medium)
        stored = 0
        for position, engine_hash in enumerate(event.block_hashes):
            key = _engine_key(rank, engine_hash)
            entry = self._blocks.get(key)
            if entry is not None:
                entry[1] |= tier
                self._blocks.move_to_end(key)
            elif ours:
                self._blocks[key] = [ours[position], tier]
                self._hold(ours[position])
            else:
                break
            stored += 1
        while len(self._blocks) > self._capacity:
            _, (evicted, _) = self._blocks.popitem(last=False)
            self._release(evicted)
        return stored, count - stored

    def remove(self, event: BlockRemoved, rank: int) -> int:
        tiers = _ALL_TIERS if event.medium is None else _tier(event.medium)
        removed = 0
        for engine_hash in event.block_hashes:
            key = _engine_key(rank, engine_hash)
            entry = self._blocks.get(key)
            if entry is None:
                continue
            entry[1] &= ~tiers
            if not entry[1]:
                del self._blocks[key]
                self._release(entry[0])
            removed += 1
        return removed

    def clear(self, rank: int | None = None) -> None:
        """Forget every block (of one data-parallel rank, when given)."""
        if rank is None:
            for ours in self._refs:
                self._drop_bit(ours)
            self._refs.clear()
            self._blocks.clear()
            return
        for key in [key for key in self._blocks if _rank_of(key) == rank]:
            self._release(self._blocks.pop(key)[0])

    def _hold(self, ours: int) -> None:
        before = self._refs.get(ours, 0)
        self._refs[ours] = before + 1
        if not before:
            self._held[ours] = self._held.get(ours, 0) | self._bit

    def _release(self, ours: int) -> None:
        left = self._refs.get(ours, 0) - 1
        if left > 0:
            self._refs[ours] = left
            return
        self._refs.pop(ours, None)
        self._drop_bit(ours)

    def _drop_bit(self, ours: int) -> None:
        mask = self._held.get(ours, 0) & ~self._bit
        if mask:
            self._held[ours] = mask
        else:
            self._held.pop(ours, None)


@dataclass
class AppliedEvents:
    """What one batch did to the index, in blocks (events for `cleared` and `unknown`)."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    skipped: int = 0
    unknown: int = 0

    def counts(self) -> dict[str, int]:
        return {kind: value for kind, value in vars(self).items() if value}


@dataclass
class KVEventIndex:
    """Every subscribed endpoint's blocks, by router block hash, as a cache source for routing.

    It answers only for candidates it has heard from (a batch received since start or restart):
    an engine that has published nothing yet is not taken to hold nothing.
    """

    block_size: int
    capacity_per_endpoint: int
    name: str = field(default="kv_events", init=False)
    _bits: EndpointBits = field(default_factory=EndpointBits, init=False, repr=False)
    _held: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _engines: dict[str, _EngineBlocks] = field(default_factory=dict, init=False, repr=False)

    def __len__(self) -> int:
        return len(self._held)

    def blocks_of(self, url: str) -> int:
        engine = self._engines.get(url)
        return len(engine) if engine is not None else 0

    def apply(self, url: str, batch: EventBatch) -> AppliedEvents:
        engine = self._engine(url)
        applied = AppliedEvents(unknown=batch.unknown)
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored, skipped = engine.store(event, batch.dp_rank, self.block_size)
                applied.stored += stored
                applied.skipped += skipped
            elif isinstance(event, BlockRemoved):
                applied.removed += engine.remove(event, batch.dp_rank)
            else:
                engine.clear(batch.dp_rank)
                applied.cleared += 1
        return applied

    def forget(self, url: str, rank: int | None = None) -> None:
        """Drop what an endpoint (or one of its ranks) reported, e.g. when its publisher restarted."""
        engine = self._engines.get(url)
        if engine is not None:
            engine.clear(rank)

    def matched_tokens(self, request: RoutingRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, int] | None:
        if not any(endpoint.url in self._engines for endpoint in candidates):
            return None
        depths = request.memo(self, self._depths)
        bit = self._bits.bit
        return {endpoint: depths.get(bit(endpoint.url), 0) * self.block_size for endpoint in candidates}

    def _depths(self, request: RoutingRequest) -> dict[int, int]:
        return matched_depths(request.block_hashes(self.block_size), self._held, self._bits.everyone)

    def _engine(self, url: str) -> _EngineBlocks:
        engine = self._engines.get(url)
        if engine is None:
            engine = self._engines[url] = _EngineBlocks(self._bits.bit(url), self._held, self.capacity_per_endpoint)
        return engine


class KVEventSubscriber:
    """One ZMQ SUB socket per engine publisher, feeding a KVEventIndex; owns its sockets' tasks.

    Sequence numbers are checked per publisher: a gap (messages lost past the high-water mark) is
    counted; a sequence that goes backwards means the engine restarted, and what that rank had
    reported is forgotten. `publishers` may be a function of the pool: it is read again every
    `refresh_interval` seconds, so engines that discovery adds are subscribed to, and engines that
    leave are unsubscribed and forgotten.
    """

    def __init__(
        self,
        index: KVEventIndex,
        publishers: Mapping[str, Sequence[str]] | Callable[[], Mapping[str, Sequence[str]]],
        metrics: RouterMetrics,
        *,
        refresh_interval: float = 2.0,
    ) -> None:
        self.index = index
        self._publishers = publishers if callable(publishers) else (lambda: publishers)
        self._metrics = metrics
        self._refresh_interval = refresh_interval
        self._context: zmq.asyncio.Context | None = None
        self._listeners: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._refresher: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: Settings, pool: Pool, metrics: RouterMetrics) -> KVEventSubscriber | None:
        """The subscriber for `kvaware` routing, or None when no engine's publisher is configured."""
        if not settings.kv_events_endpoints and settings.kv_events_port is None:
            return None
        if settings.prefill_strategy != "kvaware":
            log.warning("KV event publishers are configured but prefill_strategy is not kvaware: not subscribing")
            return None
        engines = len(publishers_from_settings(settings, pool))
        capacity = max(1, settings.prefix_index_capacity // max(1, engines))
        index = KVEventIndex(block_size=settings.block_size, capacity_per_endpoint=capacity)
        metrics.watch_cache_index(index.name, lambda: len(index))
        return cls(index, lambda: publishers_from_settings(settings, pool), metrics)

    @property
    def subscriptions(self) -> list[tuple[str, str]]:
        """(engine URL, publisher address) of every open subscription."""
        return sorted(self._listeners)

    def start(self) -> None:
        if self._context is not None:
            return
        self._context = zmq.asyncio.Context()
        self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="kv-events refresh")

    def refresh(self) -> None:
        """Subscribe to publishers that appeared; drop (and forget the blocks of) those that left."""
        wanted = {(url, address) for url, addresses in self._publishers().items() for address in addresses}
        stopped = {key for key, task in self._listeners.items() if task.done()}  # its socket failed: again
        for key in stopped:
            del self._listeners[key]
        for key in wanted - self._listeners.keys():
            url, address = key
            self._listeners[key] = asyncio.create_task(self._listen(url, address), name=f"kv-events {address}")
            log.info("subscribed to KV events of %s at %s", url, address)
        for key in self._listeners.keys() - wanted:
            url, address = key
            self._listeners.pop(key).cancel()
            if not any(other == url for other, _ in self._listeners):
                self.index.forget(url)
            log.info("unsubscribed from KV events of %s at %s", url, address)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_interval)
            try:
                self.refresh()
            except Exception:
                log.exception("could not refresh the KV event subscriptions")

    async def close(self) -> None:
        tasks = [*self._listeners.values(), *([self._refresher] if self._refresher else [])]
        await cancel_and_wait(tasks)
        self._listeners.clear()
        self._refresher = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _listen(self, url: str, address: str) -> None:
        assert self._context is not None
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(address)
        last_seq: int | None = None
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    last_seq = self.receive(url, frames, last_seq)
                except Exception:
                    log.exception("KV event from %s could not be applied", address)
        except zmq.ZMQError as exc:
            log.error("KV event subscription to %s stopped: %s", address, exc)
        finally:
            socket.close(linger=0)

    def receive(self, url: str, frames: Sequence[bytes], last_seq: int | None) -> int | None:
        """Apply one multipart message from `url`'s publisher; returns the sequence number to expect after."""
        count = self._metrics.kv_events.labels
        if len(frames) != 3 or len(frames[1]) != 8:
            count(url, "undecodable").inc()
            return last_seq
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = decode_batch(frames[2])
        except UndecodableBatch as exc:
            count(url, "undecodable").inc()
            log.debug("undecodable KV event batch from %s: %s", url, exc)
            return last_seq
        if last_seq is not None and seq <= last_seq:
            log.info("KV event publisher of %s (rank %d) restarted; forgetting its blocks", url, batch.dp_rank)
            self.index.forget(url, batch.dp_rank)
            count(url, "restart").inc()
        elif last_seq is not None and seq > last_seq + 1:
            count(url, "gap").inc(seq - last_seq - 1)
        for kind, value in self.index.apply(url, batch).counts().items():
            count(url, kind).inc(value)
        return seq


def publishers_from_settings(settings: Settings, pool: Pool) -> dict[str, list[str]]:
    """Engine URL -> its publishers' ZMQ addresses: `kv_events_endpoints`, else `kv_events_port` on its host."""
    publishers: dict[str, list[str]] = {url: list(addresses) for url, addresses in settings.kv_events_endpoints.items()}
    if settings.kv_events_port is not None:
        for endpoint in pool.endpoints():
            host = urlsplit(endpoint.url).hostname
            if endpoint.url not in publishers and host:
                publishers[endpoint.url] = [f"tcp://{_zmq_host(host)}:{settings.kv_events_port}"]
    return publishers


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
