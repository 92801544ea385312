"""The HTTP/1.1 listener: uvicorn on httptools, with the limits a proxy's listener has.

uvicorn bounds neither the size of a request's head nor the time it may take to arrive, and it
waits for a body as long as the client likes: a 32 MB header is parsed, and a thousand connections
that never finish their request stay open for good. The protocol here (a uvicorn `http` class)
adds nginx's client_header_timeout, client_body_timeout and header buffer limits: a head must
arrive within `header_timeout` seconds in at most `max_header_bytes` and `max_headers` lines, and a
body within `body_timeout` seconds of its head. A connection that misses one is answered 408 or
431 (when no answer has begun) and closed, and counted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dpd_router.api.errors import error_body
from dpd_router.config import Settings

REASONS = {
    "header_timeout": (408, "The request's headers did not arrive in time."),
    "body_timeout": (408, "The request's body did not arrive in time."),
    "header_too_large": (431, "The request's headers are too large."),
    "too_many_headers": (431, "The request has too many header lines."),
}


@dataclass(frozen=True)
class ListenerLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100

    @classmethod
    def from_settings(cls, settings: Settings) -> ListenerLimits:
        return cls(
            header_timeout=settings.client_header_timeout,
            body_timeout=settings.client_body_timeout,
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
        )


class RefusedConnections:
    """How many connections the listener closed, by reason (the metrics read it)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()


class _TooManyHeaders(Exception):
    pass


def _send_without_delay(transport: asyncio.Transport) -> None:
    """Turn Nagle's algorithm off, whichever loop runs and whichever socket the connection came from.

    uvloop does so for every TCP connection; asyncio's own loop only for sockets whose `proto` says TCP,
    which a listener made with `socket.socket()` (the supervisor's, or one given to `serve(sockets=...)`)
    does not. There, an answer written in two parts (its head, then its body) waited for the client's
    delayed acknowledgement, 40 ms on Linux, on every kept-alive request after the first few."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # the connection is already gone
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def guarded_protocol(limits: ListenerLimits, refused: RefusedConnections) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with `limits` enforced, counting into `refused`."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._in_head = True  # the bytes arriving belong to a request's line and headers
            self._head_bytes = 0
            self._head_lines = 0
            self._refusal: str | None = None

        # uvicorn's connection_made narrows asyncio's BaseTransport to Transport (it ignores that as well).
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
            super().connection_made(transport)
            _send_without_delay(transport)
            self._arm(limits.header_timeout, "header_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._in_head:
                super().data_received(data)
                return
            room = limits.max_header_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                super().data_received(data)
                return
            # More than a head may hold: the head must end within what fits, the rest is body.
            self._head_bytes += room
            super().data_received(data[:room])
            if self._in_head:
                self._refuse("header_too_large")
            elif not self.transport.is_closing():
                self.data_received(data[room:])

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_lines = 0
            if self._timer is None:
                self._arm(limits.header_timeout, "header_timeout")

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_lines += 1
            if self._head_lines > limits.max_headers:
                self._refusal = "too_many_headers"
                raise _TooManyHeaders  # httptools ends the parse; send_400_response answers it
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._arm(limits.body_timeout, "body_timeout")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            self._in_head = True  # what comes next is the next request's head
            self._head_bytes = 0
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            if self._refusal is not None:
                self._refuse(self._refusal)
            else:
                super().send_400_response(msg)

        def _arm(self, seconds: float, reason: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._refuse, reason)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _refuse(self, reason: str) -> None:
            """Answer (if no answer began) and close the connection; the request, if running, sees a disconnect."""
            self._disarm()
            if self.transport.is_closing():
                return
            refused.counts[reason] += 1
            # The request being served, if any (a finished one's cycle stays until the next begins).
            cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
            if cycle is None or not cycle.response_started:
                status, message = REASONS[reason]
                body = error_body(message, "BadRequestError", status)
                self.transport.write(
                    b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s"
                    % (
                        status,
                        b"Request Timeout" if status == 408 else b"Request Header Fields Too Large",
                        len(body),
                        body,
                    )
                )
            if cycle is not None:
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

    return GuardedHttpToolsProtocol
