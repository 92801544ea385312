"""Engines whose connection breaks mid-stream: TCP relays that cut the first streamed answer after some events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType
from urllib.parse import urlsplit

_STREAMED = (b'"stream":true', b'"stream": true')


class CutLinks:
    """A 127.0.0.1 relay to each of `targets`; the first streamed completion call's answer through any of
    them is cut (its connections aborted) after `after` SSE events, as a decoder that dies mid-stream
    would leave it. Everything else passes untouched. `cut` is set once it happened.

    A call whose bytes hold `"stream":true` (or `"stream": true`, as a client's own body may) is a streamed one.
    """

    def __init__(self, targets: list[str], *, after: int) -> None:
        self._targets = []
        for target in targets:
            parts = urlsplit(target)
            assert parts.hostname is not None and parts.port is not None
            self._targets.append((parts.hostname, parts.port))
        self.after = after
        self.cut = asyncio.Event()
        # The request lines that went through, and what became of each answer (whether its call was taken as
        # streamed, the events counted, its size and start), for a test to say what it saw where no stream was cut.
        self.requests: list[bytes] = []
        self.answers: list[str] = []
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in self._servers]

    async def __aenter__(self) -> CutLinks:
        for target in self._targets:
            self._servers.append(await asyncio.start_server(self._relay_to(target), "127.0.0.1", 0))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _relay_to(
        self, target: tuple[str, int]
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            engine_reader, engine_writer = await asyncio.open_connection(*target)
            streamed = [False]  # the request the connection carries now is a streamed completion call
            try:
                await asyncio.gather(
                    self._requests(client_reader, engine_writer, streamed),
                    self._answers(engine_reader, client_writer, engine_writer, streamed),
                )
            except (asyncio.CancelledError, ConnectionError):
                pass
            finally:
                for writer in (client_writer, engine_writer):
                    writer.close()
                    with contextlib.suppress(ConnectionError):
                        await writer.wait_closed()
                self._tasks.discard(task)

        return relay

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, streamed: list[bool]) -> None:
        # A read can end inside the marker (a long prompt's body comes in several): the last bytes of the
        # request's previous read are looked at with the next.
        tail = b""
        while data := await reader.read(65536):
            start = data.find(b"POST /v1/")
            if start >= 0:  # a new request on the connection: nothing of the last one counts
                streamed[0] = False
                self.requests.append(bytes(data[start : start + 200]).split(b"\r\n", 1)[0])
                window = data[start:]
            else:
                window = tail + data
            if any(marker in window for marker in _STREAMED):
                streamed[0] = True
            tail = window[-len(_STREAMED[1]) :]
            writer.write(data)
            await writer.drain()
        writer.write_eof()

    async def _answers(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        engine_writer: asyncio.StreamWriter,
        streamed: list[bool],
    ) -> None:
        events = size = 0
        head = b""
        try:
            while data := await reader.read(65536):
                size += len(data)
                head = head or bytes(data[:160])
                if streamed[0] and not self.cut.is_set():
                    end = 0
                    while events < self.after and (at := data.find(b"\n\n", end)) >= 0:
                        events, end = events + 1, at + 2  # an SSE event's end (the headers end in \r\n\r\n)
                    if events >= self.after:
                        self.cut.set()
                        # What the client had: the answer up to the `after`-th event's end, then a connection reset.
                        writer.write(data[:end])
                        await writer.drain()
                        writer.transport.abort()
                        engine_writer.transport.abort()
                        return
                writer.write(data)
                await writer.drain()
        finally:
            self.answers.append(f"streamed={streamed[0]}, {events} events counted, {size} bytes: {head!r}")
