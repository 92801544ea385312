"""A slow network between the router and one engine: a TCP relay that holds each piece of the answer."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from urllib.parse import urlsplit


class SlowLink:
    """Relays 127.0.0.1 connections to `target`, passing the engine's answers to completion calls on `hold`
    seconds late (every piece of them); other answers (health probes, model listings) pass at once, so the
    router's view of the engine's health does not depend on the hold.

    `answering` is set when an engine's answer to a completion call reached the relay (and is being
    held): the moment the engine has finished the call while the router has not read it yet. `until`, where a
    test sets it, holds such answers until the event is set instead of for `hold` seconds: the test says when
    the router may read them (once it has seen what must come first), however slowly its loop runs.
    """

    def __init__(self, target: str, *, hold: float) -> None:
        parts = urlsplit(target)
        assert parts.hostname is not None and parts.port is not None
        self._target = (parts.hostname, parts.port)
        self.hold = hold
        self.until: asyncio.Event | None = None
        self.answering = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> SlowLink:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        engine_reader, engine_writer = await asyncio.open_connection(*self._target)
        completion_asked = asyncio.Event()  # a completion call went out on this connection
        holding = [False]  # whether the request the connection serves now is a completion call
        try:
            await asyncio.gather(
                self._requests(client_reader, engine_writer, completion_asked, holding),
                self._answers(engine_reader, client_writer, completion_asked, holding),
            )
        except asyncio.CancelledError:
            pass  # the link is closing (__aexit__): the connection ends here, nothing waits on it
        finally:
            for writer in (client_writer, engine_writer):
                writer.close()
            self._tasks.discard(task)

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        completion_asked: asyncio.Event,
        holding: list[bool],
    ) -> None:
        while chunk := await _read(reader):
            if chunk.startswith((b"GET ", b"POST ", b"PUT ", b"DELETE ")):  # a new request on the connection
                holding[0] = chunk.startswith(b"POST /v1/")
            if chunk.startswith(b"POST /v1/"):
                completion_asked.set()
            writer.write(chunk)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    async def _answers(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        completion_asked: asyncio.Event,
        holding: list[bool],
    ) -> None:
        while chunk := await reader.read(65536):
            if completion_asked.is_set():
                completion_asked.clear()
                self.answering.set()
            if holding[0]:
                await (self.until.wait() if self.until is not None else asyncio.sleep(self.hold))
            writer.write(chunk)
            try:
                await writer.drain()
            except ConnectionError:
                return
        # The engine closed its side (its keep-alive ran out): pass it on as a network would, or the
        # router sends its next request into a connection no engine reads and waits for good.
        with contextlib.suppress(OSError):
            writer.write_eof()


async def _read(reader: asyncio.StreamReader) -> bytes:
    """The next bytes the router sent; none once it reset the connection (a call it cut short), as at its end."""
    try:
        return await reader.read(65536)
    except ConnectionError:
        return b""
