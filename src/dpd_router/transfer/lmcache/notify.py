"""LMCache's ProxyNotif channel: the ZMQ PULL socket the prefillers' workers tell the router on when KV has landed."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import zmq
import zmq.asyncio

from dpd_router.startup.tasks import cancel_and_wait

log = logging.getLogger("dpd_router.lmcache")

# A ProxyNotif is a few dozen bytes; anything much larger is not one.
MAX_NOTIFICATION_BYTES = 64 * 1024


class ProxyNotifications:
    """The router's end of LMCache's ProxyNotif channel: a ZMQ PULL socket the prefillers' workers push to.

    A hand-off registers its `req_id` before its prefill call is sent, so no notification can
    arrive unexpected; notifications for ids nobody waits for (late ones, after a timeout) are
    dropped. What is held is bounded by the prefill calls in flight.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._waiting: dict[str, _Expected] = {}
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.received = 0
        self.ignored = 0

    async def start(self) -> None:
        """Bind the PULL socket (raises zmq.ZMQError when the address is taken) and start receiving."""
        if self._context is not None:
            return
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.PULL)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_NOTIFICATION_BYTES)
        try:
            socket.bind(self.address)
        except zmq.ZMQError:
            socket.close(linger=0)
            self._context.term()
            self._context = None
            raise
        self._socket = socket
        self._task = asyncio.create_task(self._receive(), name="lmcache-notifications")
        log.info("waiting for LMCache ProxyNotif messages on %s", self.address)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None
        for expected in self._waiting.values():
            expected.landed.set()
        self._waiting.clear()

    def expect(self, req_id: str, count: int) -> None:
        """Wait for `count` notifications for `req_id` from now on."""
        self._waiting[req_id] = _Expected(count)

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)

    async def wait(self, req_id: str, within: float) -> bool:
        """Whether every expected notification for `req_id` arrived within `within` seconds."""
        expected = self._waiting.get(req_id)
        if expected is None:
            return False
        try:
            async with asyncio.timeout(within):
                await expected.landed.wait()
        except TimeoutError:
            return False
        return expected.seen >= expected.count

    def arrived(self, payload: bytes) -> None:
        """Count one message; anything but a ProxyNotif for an awaited id is ignored."""
        try:
            message = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.UnpackException):
            message = None
        req_id = message.get("req_id") if isinstance(message, dict) and message.get("type") == "ProxyNotif" else None
        expected = self._waiting.get(req_id) if isinstance(req_id, str) else None
        if expected is None:
            self.ignored += 1
            log.debug("ignored a message on the LMCache notification socket: %r", message)
            return
        self.received += 1
        expected.seen += 1
        if expected.seen >= expected.count:
            expected.landed.set()

    async def _receive(self) -> None:
        assert self._socket is not None
        try:
            while True:
                self.arrived(await self._socket.recv())
        except zmq.ZMQError as exc:
            log.error("the LMCache notification socket %s stopped: %s", self.address, exc)


class _Expected:
    __slots__ = ("count", "landed", "seen")

    def __init__(self, count: int) -> None:
        self.count = max(count, 1)
        self.seen = 0
        self.landed = asyncio.Event()
