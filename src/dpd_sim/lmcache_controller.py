"""A stand-in for the LMCache controller's lookup API, fed by the simulated engines' KV events.

`python -m dpd_sim.lmcache_controller --port 9000 --instance ID=tcp://127.0.0.1:5557[@IP] ...`
subscribes to each instance's vLLM KV events (either event encoding) and answers as the LMCache
controller does:

- `POST /lookup {"tokens": [...]}` -> `{"event_id": ..., "layout_info": {"<instance_id>":
  ["LocalCPUBackend", <matched prefix tokens>]}}`, for every instance holding some of the prefix;
- `POST /query_instance {"event_id": ..., "ip": ...}` -> `{"event_id": ..., "res": "<instance_id>"}`
  (`res` null when no instance was declared with that IP);
- `GET /sim/instances`: per instance, the KV event batches heard and the blocks held.

A real controller learns from LMCache workers and matches in LMCache chunks (256 tokens by
default); this one learns from the engines' prefix caches and matches in their 16-token blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import orjson
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from dpd_sim.kv import BLOCK_SIZE, block_hashes
from dpd_sim.tasks import cancel_and_wait

log = logging.getLogger("dpd_sim.lmcache_controller")

LOCATION = "LocalCPUBackend"
# Field positions of the array encoding (the tag first), as vLLM's msgspec array_like structs.
_POSITIONS = {"block_hashes": 1, "parent_block_hash": 2, "token_ids": 3, "block_size": 4}


@dataclass
class InstanceBlocks:
    """What one instance holds: its engine's block hashes, re-keyed by the chained hash of their tokens."""

    batches: int = 0
    _chain: dict[Any, bytes] = field(default_factory=dict)
    _held: dict[bytes, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._chain)

    def holds(self, block: bytes) -> bool:
        return block in self._held

    def apply(self, payload: bytes) -> None:
        """Apply one msgpack batch `[ts, [event, ...], dp_rank]`; events it cannot read are skipped."""
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        events = batch.get("events") if isinstance(batch, dict) else batch[1]
        self.batches += 1
        for event in events or ():
            kind, fields = _fields(event)
            if kind == "BlockStored":
                self._store(fields)
            elif kind == "BlockRemoved":
                for engine_hash in fields.get("block_hashes") or ():
                    self._drop(engine_hash)
            elif kind == "AllBlocksCleared":
                self._chain.clear()
                self._held.clear()

    def _store(self, fields: Mapping[str, Any]) -> None:
        engine_hashes = list(fields.get("block_hashes") or ())
        if fields.get("block_size") != BLOCK_SIZE:
            return
        parent = fields.get("parent_block_hash")
        seed = b"" if parent is None else self._chain.get(parent)
        if seed is None:
            return
        ours = block_hashes(list(fields.get("token_ids") or ()), parent=seed)
        for engine_hash, chained in zip(engine_hashes, ours, strict=False):
            if engine_hash not in self._chain:
                self._chain[engine_hash] = chained
                self._held[chained] = self._held.get(chained, 0) + 1

    def _drop(self, engine_hash: Any) -> None:
        chained = self._chain.pop(engine_hash, None)
        if chained is None:
            return
        left = self._held[chained] - 1
        if left:
            self._held[chained] = left
        else:
            del self._held[chained]


def _fields(event: Any) -> tuple[str | None, Mapping[str, Any]]:
    if isinstance(event, dict):
        return event.get("type"), event
    if isinstance(event, list) and event and isinstance(event[0], str):
        return event[0], {name: event[index] for name, index in _POSITIONS.items() if index < len(event)}
    return None, {}


@dataclass
class Controller:
    """Every instance's blocks, the lookups over them, and the SUB sockets that feed them."""

    publishers: Mapping[str, str]
    """instance id -> the ZMQ address its engine publishes KV events on."""
    ips: Mapping[str, str] = field(default_factory=dict)
    """instance id -> the IP `/query_instance` knows it by."""
    instances: dict[str, InstanceBlocks] = field(init=False)
    _context: zmq.asyncio.Context | None = field(default=None, init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.instances = {instance: InstanceBlocks() for instance in self.publishers}

    def lookup(self, tokens: Sequence[int]) -> dict[str, int]:
        """Matched prefix tokens per instance holding any of the prompt's leading blocks."""
        hashes = block_hashes(tokens)
        matches: dict[str, int] = {}
        for instance, blocks in self.instances.items():
            depth = 0
            while depth < len(hashes) and blocks.holds(hashes[depth]):
                depth += 1
            if depth:
                matches[instance] = depth * BLOCK_SIZE
        return matches

    def instance_at(self, ip: str) -> str | None:
        return next((instance for instance, address in self.ips.items() if address == ip), None)

    def start(self) -> None:
        self._context = zmq.asyncio.Context()
        for instance, address in self.publishers.items():
            self._tasks.append(asyncio.create_task(self._listen(instance, address), name=f"lmcache-sub {instance}"))

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _listen(self, instance: str, address: str) -> None:
        assert self._context is not None
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(address)
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    self.instances[instance].apply(frames[2])
                except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
                    log.warning("KV event batch from %s skipped: %s", instance, exc)
        finally:
            socket.close(linger=0)


def create_app(controller: Controller) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        controller.start()
        try:
            yield
        finally:
            await controller.close()

    app = FastAPI(title="dpd-router sim LMCache controller", lifespan=lifespan, openapi_url=None)
    app.state.controller = controller

    @app.post("/lookup")
    async def lookup(request: Request) -> Response:
        body = await _body(request)
        tokens = body.get("tokens") if body is not None else None
        if not isinstance(tokens, list) or not all(isinstance(token, int) for token in tokens):
            return _json({"error": "tokens must be a list of token ids"}, 400)
        layout = {instance: [LOCATION, matched] for instance, matched in controller.lookup(tokens).items()}
        return _json({"event_id": f"lookup-{uuid.uuid4().hex}", "layout_info": layout})

    @app.post("/query_instance")
    async def query_instance(request: Request) -> Response:
        body = await _body(request)
        if body is None or not isinstance(body.get("ip"), str):
            return _json({"error": "ip is required"}, 400)
        return _json({"event_id": body.get("event_id"), "res": controller.instance_at(body["ip"])})

    @app.get("/sim/instances")
    async def instances() -> Response:
        return _json(
            {name: {"batches": blocks.batches, "blocks": len(blocks)} for name, blocks in controller.instances.items()}
        )

    return app


async def _body(request: Request) -> dict[str, Any] | None:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


def _json(payload: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status_code, media_type="application/json")


def parse_instance(spec: str) -> tuple[str, str, str | None]:
    """`ID=tcp://host:port[@IP]` -> (instance id, ZMQ address, IP or None)."""
    instance, separator, rest = spec.partition("=")
    if not separator or not instance or not rest.startswith("tcp://"):
        raise argparse.ArgumentTypeError(f"expected ID=tcp://host:port[@IP], got {spec!r}")
    address, _, ip = rest.partition("@")
    return instance, address, ip or None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dpd_sim.lmcache_controller",
        description="An LMCache controller stand-in (/lookup, /query_instance) fed by simulated engines' KV events.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--instance",
        type=parse_instance,
        action="append",
        default=[],
        help="ID=tcp://host:port[@IP]: an instance and its engine's KV events address (repeat per engine)",
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    publishers = {instance: address for instance, address, _ in args.instance}
    ips = {instance: ip for instance, _, ip in args.instance if ip}
    uvicorn.run(
        create_app(Controller(publishers, ips)),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
    )


if __name__ == "__main__":
    main()
