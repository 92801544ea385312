"""The aiohttp transport speaks httpx: answers, streams, pooled connections and, above all, the exceptions
the gateway decides on (only a failed connect means the engine never saw the request)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx
import pytest

from dpd_router.pool.transport import AiohttpTransport, EngineCalls

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A raw HTTP/1.1 server on 127.0.0.1 whose every byte the test decides."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request's head and body (Content-Length bodies only), or None at the end of the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


@asynccontextmanager
async def serving(handler_for: Callable[[Server], Handler]) -> AsyncIterator[tuple[Server, str]]:
    server = Server(lambda r, w: asyncio.sleep(0))
    server.handler = handler_for(server)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        listener.close()


@asynccontextmanager
async def client(**timeouts: float) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=10, keepalive_expiry=4.0)
    async with httpx.AsyncClient(
        transport=AiohttpTransport(limits), timeout=httpx.Timeout(5.0, **timeouts), trust_env=False
    ) as http:
        yield http


def answer_once(sent: bytes) -> Callable[[Server], Handler]:
    """A server that reads one request, sends `sent` as its answer and closes the connection."""

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(sent)
            await writer.drain()

        return handler

    return handler_for


def keep_answering(body: bytes = b'{"ok": true}') -> Callable[[Server], Handler]:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await server.read_request(reader) is not None:
                head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                writer.write(head.encode() + body)
                await writer.drain()

        return handler

    return handler_for


async def test_a_post_arrives_whole_and_its_answer_comes_back() -> None:
    async with serving(keep_answering()) as (server, url), client() as http:
        answer = await http.post(f"{url}/v1/completions", content=b'{"prompt": "hi"}', headers={"X-Request-Id": "r1"})
    assert answer.status_code == 200
    assert answer.json() == {"ok": True}
    assert answer.headers["content-type"] == "application/json"
    sent = server.requests[0]
    assert sent.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nx-request-id: r1\r\n" in sent.lower()
    assert sent.endswith(b'\r\n\r\n{"prompt": "hi"}')
    assert sent.lower().count(b"content-length:") == 1


async def test_sequential_requests_share_one_kept_alive_connection() -> None:
    async with serving(keep_answering()) as (server, url), client() as http:
        for _ in range(5):
            assert (await http.get(f"{url}/health")).status_code == 200
    assert server.connections == 1


async def test_a_stream_is_relayed_chunk_by_chunk_as_the_engine_sends_it() -> None:
    second_chunk = asyncio.Event()

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"7\r\ndata: 1\r\n")
            await writer.drain()
            await second_chunk.wait()
            writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
            await writer.drain()

        return handler

    async with serving(handler_for) as (_, url), client() as http, http.stream("POST", url, content=b"{}") as answer:
        chunks = answer.aiter_raw()
        assert await anext(chunks) == b"data: 1"  # before the engine has sent the rest
        second_chunk.set()
        assert [chunk async for chunk in chunks] == [b"data: 2"]


async def test_a_stream_closed_early_gives_up_its_connection_and_the_next_call_still_works() -> None:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await server.read_request(reader)
            if request is not None and request.startswith(b"POST"):
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
                await writer.drain()
                await reader.read()  # hold the stream open until the client goes
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

        return handler

    async with serving(handler_for) as (server, url), client() as http:
        async with http.stream("POST", url, content=b"{}") as answer:
            assert await anext(answer.aiter_raw()) == b"first"
        assert (await http.get(url)).text == "ok"
    assert server.connections == 2


async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before the call: refused
    async with client() as http:
        with pytest.raises(httpx.ConnectError):
            await http.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{}")


@contextmanager
def unaccepted_address() -> Iterator[tuple[str, int]]:
    """An address whose listener never accepts and whose accept queue is full: a connect there hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        fillers = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(address)
            fillers.append(filler)
        try:
            yield address
        finally:
            for filler in fillers:
                filler.close()


async def test_a_full_accept_queue_is_a_connect_timeout() -> None:
    with unaccepted_address() as (host, port):
        async with client(connect=0.3) as http:
            with pytest.raises(httpx.ConnectTimeout):
                await http.post(f"http://{host}:{port}/", content=b"{}")


async def test_an_engine_that_never_answers_is_a_read_timeout() -> None:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            await reader.read()

        return handler

    async with serving(handler_for) as (server, url), client(read=0.2) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(url, content=b"{}")
    assert server.requests, "the request was sent: not a connect failure"


async def test_a_connection_closed_before_the_answer_is_a_protocol_error_not_a_connect_error() -> None:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)

        return handler

    async with serving(handler_for) as (_, url), client() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(url, content=b"{}")


async def test_a_body_cut_off_midway_is_a_read_error() -> None:
    sent = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part"
    async with serving(answer_once(sent)) as (_, url), client() as http:
        with pytest.raises(httpx.ReadError):
            await http.post(url, content=b"{}")


async def test_every_failure_is_an_httpx_error_the_router_can_catch() -> None:
    async with serving(answer_once(b"this is not HTTP\r\n\r\n")) as (_, url), client() as http:
        with pytest.raises(httpx.HTTPError) as failure:
            await http.post(url, content=b"{}")
    assert not isinstance(failure.value, httpx.ConnectError | httpx.ConnectTimeout)


@asynccontextmanager
async def engine_calls() -> AsyncIterator[EngineCalls]:
    transport = AiohttpTransport(httpx.Limits(max_connections=10, keepalive_expiry=4.0))
    try:
        yield EngineCalls(transport, {"Authorization": "Bearer engine-key"})
    finally:
        await transport.aclose()


async def test_a_connectors_call_reads_the_whole_answer_on_the_request_paths_pool() -> None:
    async with serving(keep_answering(b'{"kv_transfer_params": {}}')) as (server, url), engine_calls() as calls:
        limits = httpx.Timeout(5.0, connect=1.0)
        first = await calls.whole(f"{url}/v1/completions", b'{"prompt": "hi"}', {"X-Request-Id": "r1"}, limits=limits)
        second = await calls.whole(f"{url}/v1/completions", b"{}", {}, limits=limits)
    assert (first.status_code, first.content, second.content) == (200, b'{"kv_transfer_params": {}}', first.content)
    assert server.connections == 1, "the second call reused the first call's connection"
    head = server.requests[0].lower()
    assert b"x-request-id: r1" in head and b"authorization: bearer engine-key" in head
    assert server.requests[0].endswith(b'{"prompt": "hi"}')


async def test_a_connectors_call_past_its_deadline_is_a_timeout_and_its_connection_is_not_reused() -> None:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if len(server.requests) == 0:  # the first call: its answer's head, then nothing
                await server.read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\npart")
                await reader.read()
                return
            await keep_answering()(server)(reader, writer)

        return handler

    async with serving(handler_for) as (server, url), engine_calls() as calls:
        with pytest.raises(httpx.ReadTimeout):
            await calls.whole(url, b"{}", {}, limits=httpx.Timeout(0.3, connect=1.0))
        answer = await calls.whole(url, b"{}", {}, limits=httpx.Timeout(5.0))
    assert answer.content == b'{"ok": true}' and server.connections == 2
