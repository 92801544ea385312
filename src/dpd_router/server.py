"""The HTTP/1.1 listener: uvicorn on httptools, with the limits a proxy's listener has.

uvicorn bounds neither the size of a request's head nor the time it may take to arrive, and it
waits for a body as long as the client likes: a 32 MB header is parsed, and a thousand connections
that never finish their request stay open for good. The protocol here (a uvicorn `http` class)
adds nginx's client_header_timeout, client_body_timeout and header buffer limits: a head must
arrive within `header_timeout` seconds in at most `max_header_bytes` and `max_headers` lines, and a
body within `body_timeout` seconds of its head. A connection that misses one is answered 408, 414 or
431 (when no answer has begun) and closed, and counted; so is a request httptools cannot parse (an
OpenAI-shaped 400, where uvicorn writes plain text) and one that asks to switch protocols with a body
the parser then leaves unread (the router serves no other protocol; uvicorn would leave it waiting).

Closing is lingering, as nginx's: the answer is sent, the sending side shut, and whatever the client
still sends is read and dropped for a moment before the connection closes. Closing with unread bytes
makes the kernel reset the connection, and a reset discards the answer before the client reads it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dpd_router.api.departure import ON_LOST
from dpd_router.api.errors import error_body
from dpd_router.config import Settings

REASONS = {
    "header_timeout": (408, "The request's headers did not arrive in time."),
    "body_timeout": (408, "The request's body did not arrive in time."),
    "uri_too_long": (414, "The request's target (its path and query) is too long."),
    "header_too_large": (431, "The request's headers are too large."),
    "too_many_headers": (431, "The request has too many header lines."),
    "malformed": (400, "The request is not valid HTTP/1.1."),
    "upgrade": (400, "This server does not switch protocols: send the request without an Upgrade header."),
}
# After a refusal, how long and how much of what the client still sends is read (and dropped) before
# the connection closes, so that the refusal is read rather than reset away.
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 * 1024 * 1024
# How early a deadline's timer may go off and still count as on time (uvloop's go off to the millisecond).
TIMER_SLACK = 0.001


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


def _declares_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


def guarded_protocol(limits: ListenerLimits, refused: RefusedConnections) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with `limits` enforced, counting into `refused`."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # One timer for the connection's deadline (see _arm); `_due` is when, None while nothing is due.
            self._timer: asyncio.TimerHandle | None = None
            self._due: float | None = None
            self._reason = "header_timeout"
            self._in_head = True  # the bytes arriving belong to a request's line and headers
            self._head_bytes = 0
            self._head_lines = 0
            self._refusal: str | None = None
            self._line_ended = False  # the request line of the head being read has arrived whole
            self._lingering = -1  # bytes dropped since a refusal (-1: not refused)

        # uvicorn's connection_made narrows asyncio's BaseTransport to Transport (it ignores that as well).
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
            super().connection_made(transport)
            _send_without_delay(transport)
            self._arm(limits.header_timeout, "header_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._timer is not None:
                self._timer.cancel()  # nothing is due on a closed connection: the timer need not keep it
                self._timer = None
            cycle = self.cycle
            scope = None if cycle is None or cycle.response_complete else cast(dict[str, Any], cycle.scope)
            lost = None if scope is None else scope.get(ON_LOST)
            super().connection_lost(exc)
            if lost is not None:
                lost()  # the request's serving stops (api/departure.py)

        def data_received(self, data: bytes) -> None:
            if self._lingering >= 0:
                self._lingering += len(data)
                if self._lingering > LINGER_BYTES:
                    self.transport.close()
                return
            if not self._in_head:
                self._feed(data)
                return
            room = limits.max_header_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                self._line_ended = self._line_ended or b"\n" in data
                self._feed(data)
                return
            # More than a head may hold: the head must end within what fits, the rest is body.
            self._head_bytes += room
            self._line_ended = self._line_ended or b"\n" in data[:room]
            self._feed(data[:room])
            if self._in_head and self._lingering < 0:
                self._refuse("header_too_large" if self._line_ended else "uri_too_long")
            elif self._lingering < 0 and not self.transport.is_closing():
                self.data_received(data[room:])

        def _feed(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if self._lingering >= 0 or cycle is None or not self.parser.should_upgrade():
                return
            # httptools parses nothing past the head of a request that asks to switch protocols: its body
            # would reach the app as empty, and a next request on the connection not at all.
            if _declares_body(cycle.scope["headers"]) and not cycle.response_started:
                self._refuse("upgrade")
            else:
                cycle.keep_alive = False  # answered as plain HTTP, then closed

        def eof_received(self) -> None:
            if self._lingering >= 0:  # the client has sent all it will: the refusal has been read
                self.transport.close()
                return
            super().eof_received()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_lines = 0
            if self._due is None:
                self._arm(limits.header_timeout, "header_timeout")

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_lines += 1
            if self._head_lines > limits.max_headers:
                self._refusal = "too_many_headers"
                raise _TooManyHeaders  # httptools ends the parse; send_400_response answers it
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            # This listener calls back when the connection is lost (api/departure.py).
            cast(dict[str, Any], self.scope)[ON_LOST] = None
            self._arm(limits.body_timeout, "body_timeout")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            self._in_head = True  # what comes next is the next request's head
            self._head_bytes = 0
            self._line_ended = False
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            self._refuse(self._refusal or "malformed")

        def _arm(self, seconds: float, reason: str) -> None:
            """Refuse the connection for `reason` unless disarmed within `seconds`.

            One timer serves the connection's deadlines. A deadline moved later leaves the timer set: when
            it goes off it finds the new time and is set again for it. A kept-alive connection sets two
            deadlines a request and clears one; a timer made and cancelled for each (1.7 us on uvloop)
            cost every request 3.4 us, where this sets about one per connection every `header_timeout`."""
            due = self.loop.time() + seconds
            self._due, self._reason = due, reason
            timer = self._timer
            if timer is None or timer.when() > due:
                if timer is not None:
                    timer.cancel()
                self._timer = self.loop.call_at(due, self._expire)

        def _disarm(self) -> None:
            self._due = None  # a timer set finds nothing due when it goes off

        def _expire(self) -> None:
            self._timer = None
            due = self._due
            if due is None:
                return
            if self.loop.time() < due - TIMER_SLACK:  # moved later since the timer was set
                self._timer = self.loop.call_at(due, self._expire)
                return
            self._refuse(self._reason)

        def _refuse(self, reason: str) -> None:
            """Answer (if no answer began) and close the connection; the request, if running, sees a disconnect."""
            self._disarm()
            if self.transport.is_closing() or self._lingering >= 0:
                return
            refused.counts[reason] += 1
            # The request being served, if any (a finished one's cycle stays until the next begins).
            cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
            if cycle is None or not cycle.response_started:
                status, message = REASONS[reason]
                body = error_body(message, "BadRequestError", status)
                self.transport.write(
                    b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s" % (status, HTTPStatus(status).phrase.encode(), len(body), body)
                )
            if cycle is not None:
                cycle.disconnected = True
                cycle.message_event.set()
            self._linger()

        def _linger(self) -> None:
            """Shut the sending side after the answer, drop what still arrives, close within a bound."""
            transport = self.transport
            if not transport.can_write_eof():
                transport.close()
                return
            self._lingering = 0
            transport.write_eof()
            transport.resume_reading()  # uvicorn pauses it under a body it has not handed on yet
            self.loop.call_later(LINGER_SECONDS, transport.close)

    return GuardedHttpToolsProtocol
