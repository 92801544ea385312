"""LMCache's disaggregated prefill as the simulator plays it: the prefiller pushes, the router is told.

A decode engine started with `--lmcache-receiver-port P` (repeat it: one port per TP rank) runs a
ZMQ REP socket on each port, LMCache's receiver. A prefill engine that gets `kv_transfer_params`
with `disagg_spec` computes the prompt, answers with `{"first_tok": id}`, and meanwhile pushes the
prompt's KV (its token ids) to every receiver port the spec names, waits for each rank's reply,
and then pushes one msgpack `{"type": "ProxyNotif", "req_id": R}` per rank to the router's PULL
socket (`--lmcache-notify-url`). A decoder later asked for `prompt + [first_tok]` as a plain
completion finds the prompt's KV in its receive buffer and computes only the last token.

As LMCache's, the receive buffer is bounded and never evicts: KV leaves it only when a decode
retrieves it. A push that does not fit is refused, so no ProxyNotif follows (real LMCache's sender
waits for room instead, which the router sees the same way: no notification in time).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack
import zmq
import zmq.asyncio

from dpd_sim.gpu import TimingModel
from dpd_sim.kv import prompt_digest
from dpd_sim.kv_events import zmq_address
from dpd_sim.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# How long a prefiller waits for a receiver rank to take the KV.
PUSH_TIMEOUT = 10.0


class DisaggSpecError(ValueError):
    """The request's `disagg_spec` cannot be served."""


@dataclass(frozen=True, slots=True)
class DisaggSpec:
    """Where one request's KV goes, read from `kv_transfer_params.disagg_spec`."""

    req_id: str
    receiver_host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> DisaggSpec:
        spec = params.get("disagg_spec")
        if not isinstance(spec, dict):
            raise DisaggSpecError("kv_transfer_params.disagg_spec must be an object")
        req_id, host = spec.get("req_id"), spec.get("receiver_host")
        init_ports, alloc_ports = spec.get("receiver_init_port"), spec.get("receiver_alloc_port")
        if not isinstance(req_id, str) or not req_id or not isinstance(host, str) or not host:
            raise DisaggSpecError("disagg_spec needs req_id and receiver_host strings")
        if not _ports(init_ports) or not _ports(alloc_ports) or len(init_ports) != len(alloc_ports):
            raise DisaggSpecError("disagg_spec needs receiver_init_port and receiver_alloc_port: one port per TP rank")
        return cls(req_id, host, tuple(init_ports), tuple(alloc_ports))


def _ports(value: object) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 for port in value)
    )


class BufferFull(Exception):
    """The receive buffer has no room for a pushed prompt's KV."""


class ReceiveBuffer:
    """KV pushed to this decoder, by the prompt it belongs to; complete once every rank has its part.

    An entry is used once (LMCache frees its PD buffer when the decoder retrieves it) and nothing
    else ever frees it: the buffer holds at most `capacity_tokens` prompt tokens, and a prompt that
    does not fit is refused (BufferFull) until decodes have taken enough.
    """

    def __init__(self, ranks: int, capacity_tokens: int = 1_000_000) -> None:
        self.ranks = ranks
        self.capacity_tokens = capacity_tokens
        self.tokens = 0
        self.refused = 0
        self._entries: dict[str, tuple[int, set[int]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, token_ids: Sequence[int], rank: int) -> None:
        digest = prompt_digest(token_ids)
        entry = self._entries.get(digest)
        if entry is None:
            if self.tokens + len(token_ids) > self.capacity_tokens:
                self.refused += 1
                raise BufferFull(
                    f"the LMCache receive buffer holds {self.tokens} of {self.capacity_tokens} tokens: "
                    f"no room for {len(token_ids)}"
                )
            entry = (len(token_ids), set())
            self._entries[digest] = entry
            self.tokens += len(token_ids)
        entry[1].add(rank)

    def holds(self, prompt: Sequence[int]) -> bool:
        """Whether every rank's part of the KV for `prompt` but its last token is here."""
        entry = self._entries.get(prompt_digest(prompt[:-1])) if len(prompt) >= 2 else None
        return entry is not None and len(entry[1]) >= self.ranks

    def take(self, prompt: Sequence[int]) -> int:
        """Prompt tokens whose KV arrived for `prompt` (its prefix but the last token, which the
        prefiller produced itself); 0 when none did. The entry is used up."""
        if len(prompt) < 2:
            return 0
        digest = prompt_digest(prompt[:-1])
        entry = self._entries.get(digest)
        if entry is None or len(entry[1]) < self.ranks:
            return 0
        del self._entries[digest]
        self.tokens -= entry[0]
        return entry[0]


class PdReceiver:
    """The decoder's LMCache receiver: a ZMQ REP socket per TP rank that stores pushed KV."""

    def __init__(self, host: str, ports: Sequence[int], buffer: ReceiveBuffer) -> None:
        self.addresses = [zmq_address(host, port) for port in ports]
        self.buffer = buffer
        self.received = 0
        self._context: zmq.asyncio.Context | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._context = zmq.asyncio.Context()
        try:
            for rank, address in enumerate(self.addresses):
                socket = self._context.socket(zmq.REP)
                socket.setsockopt(zmq.LINGER, 0)
                self._sockets.append(socket)
                socket.bind(address)
                self._tasks.append(asyncio.create_task(self._serve(socket, rank), name=f"lmcache-receiver {address}"))
        except zmq.ZMQError:
            await self.close()
            raise
        log.info("LMCache PD receiver on %s", ", ".join(self.addresses))

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)
        for socket in self._sockets:
            socket.close(linger=0)
        self._sockets.clear()
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _serve(self, socket: zmq.asyncio.Socket, rank: int) -> None:
        while True:
            payload = await socket.recv()
            try:
                message = msgpack.unpackb(payload, raw=False)
                token_ids = message["token_ids"]
                if message.get("type") != "KVPush" or not isinstance(token_ids, list):
                    raise ValueError("not a KV push")
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                await socket.send(msgpack.packb({"ok": False, "error": str(exc)}))
                continue
            try:
                self.buffer.store(token_ids, rank)
            except BufferFull as exc:
                await socket.send(msgpack.packb({"ok": False, "error": str(exc)}))
                continue
            self.received += 1
            await socket.send(msgpack.packb({"ok": True}))


class PdSender:
    """The prefiller's side: push a prompt's KV to each receiver rank, then tell the router."""

    def __init__(self, notify_url: str | None, timing: TimingModel) -> None:
        self.notify_url = notify_url
        self.timing = timing
        self.pushed = 0
        self.notified = 0
        self.failed = 0
        self._context = zmq.asyncio.Context()
        self._notify: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, spec: DisaggSpec, token_ids: Sequence[int], *, notify: bool) -> None:
        """Start the hand-off in the background (the prefill answer does not wait for it)."""
        task = asyncio.create_task(self._send(spec, list(token_ids), notify), name=f"lmcache-push {spec.req_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        tasks, self._tasks = set(self._tasks), set()
        await cancel_and_wait(tasks)
        if self._notify is not None:
            self._notify.close(linger=0)
            self._notify = None
        self._context.term()

    async def _send(self, spec: DisaggSpec, token_ids: list[int], notify: bool) -> None:
        await asyncio.sleep(self.timing.kv_transfer_seconds(len(token_ids)))
        try:
            await asyncio.gather(
                *(
                    self._push(spec, zmq_address(spec.receiver_host, port), rank, token_ids)
                    for rank, port in enumerate(spec.init_ports)
                )
            )
        except (zmq.ZMQError, TimeoutError, RuntimeError) as exc:
            self.failed += 1
            log.warning("LMCache push of %s to %s failed: %s", spec.req_id, spec.receiver_host, exc)
            return
        self.pushed += 1
        if notify:
            await self._notify_router(spec.req_id, len(spec.init_ports))

    async def _push(self, spec: DisaggSpec, address: str, rank: int, token_ids: list[int]) -> None:
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(address)
            await socket.send(
                msgpack.packb({"type": "KVPush", "req_id": spec.req_id, "rank": rank, "token_ids": token_ids})
            )
            async with asyncio.timeout(PUSH_TIMEOUT):
                reply = msgpack.unpackb(await socket.recv(), raw=False)
            if not isinstance(reply, dict) or not reply.get("ok"):
                raise RuntimeError(f"receiver {address} refused the KV: {reply}")
        finally:
            socket.close(linger=0)

    async def _notify_router(self, req_id: str, ranks: int) -> None:
        if self.notify_url is None:
            log.warning("no --lmcache-notify-url: nobody is told that the KV of %s landed", req_id)
            return
        if self._notify is None:
            self._notify = self._context.socket(zmq.PUSH)
            self._notify.setsockopt(zmq.LINGER, 0)
            self._notify.connect(self.notify_url)
        for _ in range(ranks):  # one per worker (TP rank), as LMCache's workers each send their own
            await self._notify.send(msgpack.packb({"type": "ProxyNotif", "req_id": req_id}))
            self.notified += 1
