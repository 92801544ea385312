"""The request path's calls to engines (decode calls, the connectors' prefill and release calls):
kept-alive HTTP/1.1 connections, answers parsed by httptools.

Why not aiohttp, which serves the router's other engine calls (probes, scrapes, tokenize): through
aiohttp's client a call builds its request and response objects, timers, tracing hooks and stream
reader, several times the CPU of writing the request on a kept-alive connection and feeding what
comes back to httptools' parser (the C parser uvicorn's server side uses), and the router makes one
or two such calls per request (`docs/benchmarks.md`, router capacity). What aiohttp's pool did is
kept: idle connections per engine reused most recent first and dropped after `keepalive_expiry`; at
most `max_connections` open, a caller waiting for one up to its connect timeout (httpx.PoolTimeout);
an answer read to its end gives its connection back, one cut short closes it; and failures are the
httpx exceptions the gateway decides on, where only ConnectError and ConnectTimeout say the engine
never saw the request.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools
import httpx
from multidict import CIMultiDict, CIMultiDictProxy

# Unread answer bytes past which the connection stops reading from its socket until the reader catches up.
_READ_PAUSE_BYTES = 1 << 20
# Request headers the pool writes itself.
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


@dataclass(frozen=True)
class _Target:
    """What a URL means for a call: the engine to connect to, and the request line's parts."""

    origin: tuple[str, str, int]  # scheme, host, port
    path: bytes
    host_header: bytes
    # Basic credentials written in the URL (user:password@host), sent unless the call has its own.
    authorization: str | None


class PooledAnswer:
    """An engine's answer on a pooled connection: status and headers, the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_connection",
        "_done",
        "_error",
        "_head",
        "_headers",
        "_keep_alive",
        "_paused",
        "_released",
        "_until_eof",
        "_waiter",
        "raw_headers",
        "status_code",
    )

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self._head: asyncio.Future[None] = connection.loop.create_future()
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: httpx.HTTPError | None = None
        self._keep_alive = False
        self._released = False
        self._until_eof = False
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.status_code = 0
        self._headers: Mapping[str, str] | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        """The answer's headers (none before they arrived), decoded when first asked for: most answers'
        are never read (a prefill's, a whole answer's), and decoding them cost 2 us an answer."""
        headers = self._headers
        if headers is None:
            if not self.status_code:
                return _NO_HEADERS
            headers = self._headers = CIMultiDictProxy(
                CIMultiDict((name.decode("latin-1"), value.decode("latin-1")) for name, value in self.raw_headers)
            )
        return headers

    # What the connection's parser reports.

    def head_received(self, status: int) -> None:
        self.status_code = status
        # Neither a length nor chunks: the body runs until the engine closes the connection.
        sized = chunked = False
        for name, value in self.raw_headers:
            lowered = name.lower()
            if lowered == b"content-length":
                sized = True
            elif lowered == b"transfer-encoding":
                chunked = chunked or b"chunked" in value.lower()
        self._until_eof = not sized and not chunked
        if not self._head.done():
            self._head.set_result(None)

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _READ_PAUSE_BYTES and not self._paused:
            self._paused = True
            self._connection.pause()
        self._wake()

    def complete(self, keep_alive: bool) -> None:
        # The engine's keep-alive timer starts as it ends its answer, not when the router has read it.
        self._connection.idle_since = self._connection.loop.time()
        self._done = True
        self._keep_alive = keep_alive
        self._wake()

    def fail(self, error: httpx.HTTPError) -> None:
        if self._done:
            return
        if not self._head.done():
            self._head.set_exception(error)
        self._error = error
        self._wake()

    def lost(self, exc: Exception | None) -> None:
        """The connection closed: the end of a body read to the close, else a failure."""
        if self._done:
            return
        if not self._head.done():
            self.fail(
                httpx.ReadError(f"connection reset before the answer: {exc}")
                if exc is not None
                else httpx.RemoteProtocolError("the engine closed the connection without answering")
            )
        elif self._until_eof and exc is None:
            self.complete(keep_alive=False)
        else:
            self.fail(httpx.ReadError(f"the answer was cut off: {exc or 'connection closed'}"))

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # What the request path reads (EngineAnswer).

    async def started(self) -> PooledAnswer:
        """This answer, once its status and headers arrived."""
        await self._head
        return self

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                yield self._take()
            elif self._error is not None:
                raise self._error
            elif self._done:
                self.release()  # read to its end: the connection is free before the caller closes
                return
            else:
                self._waiter = self._connection.loop.create_future()
                await self._waiter

    async def aread(self) -> bytes:
        # aiter_raw's loop without its generator: a whole answer has mostly arrived by the time it is read.
        parts: list[bytes] = []
        while True:
            if self._chunks:
                parts.append(self._take())
            elif self._error is not None:
                raise self._error
            elif self._done:
                self.release()
                return parts[0] if len(parts) == 1 else b"".join(parts)
            else:
                self._waiter = self._connection.loop.create_future()
                await self._waiter

    def arrived_whole(self) -> bytes | None:
        """The whole body, read now, when all of it has arrived (as `aread` would return it without
        waiting); None while some is to come or the answer failed (`aread` then waits, or raises)."""
        if not self._done or self._error is not None:
            return None
        content = self._take() if self._chunks else b""
        self.release()
        return content

    def _take(self) -> bytes:
        """The bytes arrived and not yet read, the connection reading again if it waited for them to be."""
        chunks, self._chunks = self._chunks, []
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._connection.resume()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def aclose(self) -> None:
        self.release()

    def release(self) -> None:
        """Give the connection back when the answer was read to its end and it may be kept, else close it."""
        if self._released:
            return
        self._released = True
        self._connection.done_with(self, reusable=self._done and self._keep_alive and not self._chunks)


_NO_HEADERS: Mapping[str, str] = CIMultiDictProxy(CIMultiDict())


class _Connection(asyncio.Protocol):
    """One connection to an engine; it carries one request at a time."""

    def __init__(self, pool: EnginePool, origin: tuple[str, str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.answer: PooledAnswer | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, though not by class

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # bytes nobody asked for: the connection cannot be trusted with another call
            self.close()
            return
        if self.answer._done:  # bytes after the whole answer: the connection cannot be trusted again
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.answer.fail(httpx.RemoteProtocolError(f"malformed answer from the engine: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.lost(self)
        if self.answer is not None:
            self.answer.lost(exc)

    # httptools' callbacks.

    def on_header(self, name: bytes, value: bytes) -> None:
        if (answer := self._reading()) is not None:
            answer.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if (answer := self._reading()) is not None:
            answer.head_received(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if (answer := self._reading()) is not None:
            answer.feed(body)

    def on_message_complete(self) -> None:
        if (answer := self._reading()) is not None:
            answer.complete(self._parser.should_keep_alive())
        else:
            self.close()  # a second answer in one read: the connection cannot be trusted again

    def _reading(self) -> PooledAnswer | None:
        """The answer being read; None past its end (a second message in the same read is not its)."""
        answer = self.answer
        return answer if answer is not None and not answer._done else None

    # The pool's and the answer's.

    def send(self, head: bytes, body: bytes) -> PooledAnswer:
        assert self.transport is not None
        self.answer = PooledAnswer(self)
        self.transport.writelines((head, body))
        return self.answer

    def done_with(self, answer: PooledAnswer, *, reusable: bool) -> None:
        if self.answer is not answer:
            return
        self.answer = None
        if reusable and not self.closed:
            self.pool.release(self)
        else:
            self.close()

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def closing(self) -> bool:
        return self.closed or self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        self.closed = True  # at once: the pool must not hand it out while its close completes
        if self.transport is not None:
            self.transport.close()


class EnginePool:
    """Connections to every engine, for the request path's POSTs."""

    # Engine URLs parsed once: the pool's endpoints and their few paths, however many requests.
    MAX_TARGETS = 4096

    def __init__(self, *, max_connections: int, keepalive_expiry: float) -> None:
        self._max = max_connections
        self._expiry = keepalive_expiry
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._opening = 0  # connects under way, counted against the limit
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *, connect_timeout: float) -> PooledAnswer:
        """POST `body` to `url`; the answer once its status and headers arrived, its body left to read."""
        target = self._target(url)
        head = _request_head(target, headers, len(body))
        connection = await self._acquire(target.origin, connect_timeout)
        answer = connection.send(head, body)
        try:
            return await answer.started()
        except BaseException:
            connection.done_with(answer, reusable=False)
            raise

    async def _acquire(self, origin: tuple[str, str, int], within: float) -> _Connection:
        """A connection to `origin`: an idle one, a new one, or the first freed within `within` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            idle = self._idle.get(origin)
            while idle:
                connection = idle.pop()
                if connection.closing():  # its loss not reported yet
                    continue
                if loop.time() - connection.idle_since < self._expiry:
                    return connection
                self._open.discard(connection)  # counted out now: its close completes later
                connection.close()  # the engine may be closing it as we send: never reuse it that late
            if len(self._open) + self._opening < self._max or self._evict_idle():
                return await self._connect(origin, deadline - loop.time())
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then timed out or cancelled: the place goes to the next waiter
                if isinstance(exc, TimeoutError):
                    raise httpx.PoolTimeout(f"no connection to the engines became free in {within:g} s") from None
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _evict_idle(self) -> bool:
        """Close the longest idle connection to any engine to make room for another; False: none idle."""
        oldest = min((idle[0] for idle in self._idle.values() if idle), key=lambda c: c.idle_since, default=None)
        if oldest is None:
            return False
        self._idle[oldest.origin].remove(oldest)
        self._open.discard(oldest)  # counted out now: its close completes later
        oldest.close()
        return True

    async def _connect(self, origin: tuple[str, str, int], within: float) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        self._opening += 1
        try:
            async with asyncio.timeout(max(within, 0.0)):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, origin, loop),
                    host,
                    port,
                    ssl=self._ssl_context() if scheme == "https" else None,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:  # refused, unreachable, name not found: nothing was sent
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        finally:
            self._opening -= 1
            self._wake_one()  # a failed connect frees its place; a waiter may take it
        if connection.closed:  # closed as soon as it opened: nothing was sent on it
            raise httpx.ConnectError(f"{host}:{port} closed the connection at once")
        self._open.add(connection)
        return connection

    def release(self, connection: _Connection) -> None:
        self._idle.setdefault(connection.origin, []).append(connection)
        self._wake_one()

    def lost(self, connection: _Connection) -> None:
        if connection in self._open:
            self._open.discard(connection)
            idle = self._idle.get(connection.origin)
            if idle and connection in idle:
                idle.remove(connection)
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise httpx.UnsupportedProtocol(f"cannot call {url!r}: only http:// and https:// engine URLs")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            if len(self._targets) >= self.MAX_TARGETS:  # engines came and went: start over rather than grow
                self._targets.clear()
            credentials = None
            if parts.username is not None:
                pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
                credentials = "Basic " + base64.b64encode(pair).decode("ascii")
            target = self._targets[url] = _Target(
                (parts.scheme, parts.hostname, port),
                path.encode(),
                parts.netloc.rpartition("@")[2].encode(),
                credentials,
            )
        return target

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def aclose(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports finish closing


def _request_head(target: _Target, headers: Mapping[str, str], length: int) -> bytes:
    lines = [b"POST %s HTTP/1.1\r\nHost: %s\r\n" % (target.path, target.host_header)]
    if target.authorization is not None and not any(name.lower() == "authorization" for name in headers):
        lines.append(b"Authorization: %s\r\n" % target.authorization.encode("ascii"))
    for name, value in headers.items():
        if name.lower() in _OWN_HEADERS:
            continue
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise httpx.LocalProtocolError(f"header {name!r} cannot be sent: it holds a line break")
        lines.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("utf-8")))
    lines.append(b"Content-Length: %d\r\n\r\n" % length)
    return b"".join(lines)
