"""One HTTP/1.1 keep-alive connection, spoken with h11 over a raw socket, that notices being dropped.

httpx and the openai client reconnect quietly when a server closes a kept-alive connection; a
test that wants to know whether the router closed a connection it had promised to keep needs a
client that does not. `KeepAliveConnection.request` raises `ConnectionDropped` when the server
closes the connection without having said `Connection: close`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import h11


class ConnectionDropped(Exception):
    """The server closed a connection it had not announced it would close."""


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def closes(self) -> bool:
        """The server announced it closes the connection after this answer."""
        return "close" in self.headers.get("connection", "").lower()


class KeepAliveConnection:
    def __init__(self, host: str, port: int) -> None:
        self._address = (host, port)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._h11 = h11.Connection(h11.CLIENT)
        self.opened = 0

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(*self._address)
        self._h11 = h11.Connection(h11.CLIENT)
        self.opened += 1

    async def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> Answer:
        if self._writer is None:
            await self._connect()
        assert self._reader is not None and self._writer is not None
        fields = [("Host", f"{self._address[0]}:{self._address[1]}"), ("Content-Length", str(len(body)))]
        fields += [("Content-Type", "application/json"), *(headers or {}).items()]
        data = self._h11.send(h11.Request(method=method, target=path, headers=fields))
        data += self._h11.send(h11.Data(data=body)) if body else b""
        data += self._h11.send(h11.EndOfMessage())
        try:
            self._writer.write(data)
            await self._writer.drain()
            answer = await self._read_answer()
        except (ConnectionError, h11.RemoteProtocolError) as exc:
            await self.close()
            raise ConnectionDropped(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if answer.closes:
            await self.close()
        else:
            self._h11.start_next_cycle()
        return answer

    async def _read_answer(self) -> Answer:
        assert self._reader is not None
        status = 0
        headers: dict[str, str] = {}
        body = bytearray()
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                chunk = await self._reader.read(65536)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                self._h11.receive_data(chunk)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return Answer(status, headers, bytes(body))
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection")

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
