"""The request path's engine pool: requests as sent, answers whole and streamed, kept-alive connections
reused and expired, the connection limit, and failures as the httpx exceptions the gateway decides on
(only a failed connect means the engine never saw the request)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from dpd_router.pool.engine_pool import EnginePool

from .test_transport import Handler, Server, answer_once, keep_answering, serving, unaccepted_address


@asynccontextmanager
async def engine_pool(*, max_connections: int = 10, keepalive_expiry: float = 4.0) -> AsyncIterator[EnginePool]:
    pool = EnginePool(max_connections=max_connections, keepalive_expiry=keepalive_expiry)
    try:
        yield pool
    finally:
        await pool.aclose()


async def test_a_post_is_sent_as_written_and_its_answer_read_whole() -> None:
    async with serving(keep_answering()) as (server, url), engine_pool() as pool:
        answer = await pool.post(
            f"{url}/v1/completions?x=1",
            b'{"prompt": "hi"}',
            {"X-Request-Id": "r1", "Content-Type": "application/json", "content-length": "999"},
            connect_timeout=5,
        )
        assert answer.status_code == 200
        assert answer.headers["Content-Type"] == answer.headers["content-type"] == "application/json"
        assert await answer.aread() == b'{"ok": true}'
        await answer.aclose()
    sent = server.requests[0]
    assert sent.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-Request-Id: r1\r\n" in sent
    assert sent.lower().count(b"content-length:") == 1 and b"Content-Length: 16\r\n" in sent
    assert sent.endswith(b'\r\n\r\n{"prompt": "hi"}')


async def test_answers_read_to_their_end_leave_one_connection_reused() -> None:
    async with serving(keep_answering()) as (server, url), engine_pool() as pool:
        for _ in range(5):
            answer = await pool.post(url, b"{}", {}, connect_timeout=5)
            assert await answer.aread() == b'{"ok": true}'  # read whole: free again before aclose
        await answer.aclose()
    assert server.connections == 1 and len(server.requests) == 5


async def test_an_answer_arrived_whole_is_taken_at_once_and_frees_its_connection() -> None:
    async with serving(keep_answering()) as (server, url), engine_pool() as pool:
        answer = await pool.post(url, b"{}", {}, connect_timeout=5)
        async with asyncio.timeout(5):
            while (content := answer.arrived_whole()) is None:  # noqa: ASYNC110 - the body may come a read after the head
                await asyncio.sleep(0.001)
        assert content == b'{"ok": true}'
        assert await (await pool.post(url, b"{}", {}, connect_timeout=5)).aread() == b'{"ok": true}'
    assert server.connections == 1, "taken whole, it gave its connection back"


@pytest.mark.parametrize(
    "sent",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part",  # more to come, then cut
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n",
    ],
)
async def test_an_answer_not_arrived_whole_is_left_to_be_read(sent: bytes) -> None:
    async with serving(answer_once(sent)) as (_, url), engine_pool() as pool:
        answer = await pool.post(url, b"{}", {}, connect_timeout=5)
        assert answer.arrived_whole() is None
        with pytest.raises(httpx.ReadError):
            await answer.aread()
        assert answer.arrived_whole() is None, "failed: read raises, nothing taken"


async def test_an_idle_connection_past_its_keepalive_expiry_is_not_reused() -> None:
    async with serving(keep_answering()) as (server, url), engine_pool(keepalive_expiry=0.05) as pool:
        for _ in range(2):
            answer = await pool.post(url, b"{}", {}, connect_timeout=5)
            await answer.aread()
            await asyncio.sleep(0.1)
    assert server.connections == 2


async def test_a_chunked_stream_comes_chunk_by_chunk_and_a_stream_cut_short_closes_its_connection() -> None:
    second_chunk = asyncio.Event()

    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while (request := await server.read_request(reader)) is not None:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                writer.write(b"7\r\ndata: 1\r\n")
                await writer.drain()
                if b"cut" in request:
                    await reader.read()  # hold the stream open until the client goes
                    return
                await second_chunk.wait()
                writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
                await writer.drain()

        return handler

    async with serving(handler_for) as (server, url), engine_pool() as pool:
        answer = await pool.post(url, b"{}", {}, connect_timeout=5)
        chunks = answer.aiter_raw()
        assert await anext(chunks) == b"data: 1"  # before the engine has sent the rest
        second_chunk.set()
        assert [chunk async for chunk in chunks] == [b"data: 2"]
        await answer.aclose()
        cut = await pool.post(url, b"cut", {}, connect_timeout=5)
        assert await anext(cut.aiter_raw()) == b"data: 1"
        await cut.aclose()  # cut short: that connection cannot carry another call
        answer = await pool.post(url, b"{}", {}, connect_timeout=5)
        assert await answer.aread() == b"data: 1data: 2"
    assert server.connections == 2


async def test_a_body_without_length_runs_to_the_close() -> None:
    sent = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it"
    async with serving(answer_once(sent)) as (_, url), engine_pool() as pool:
        answer = await pool.post(url, b"{}", {}, connect_timeout=5)
        assert await answer.aread() == b"all of it"


async def test_an_answers_headers_read_as_they_came_in_any_case_repeats_kept() -> None:
    sent = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Part: a\r\nx-part: b\r\n"
        b"CONTENT-LENGTH: 12\r\n\r\nall 12 bytes"
    )
    async with serving(answer_once(sent)) as (_, url), engine_pool() as pool:
        answer = await pool.post(url, b"{}", {}, connect_timeout=5)
        headers = answer.headers
        assert headers["content-type"] == "application/json" and headers.getall("X-PART") == ["a", "b"]  # type: ignore[attr-defined]
        assert answer.headers is headers, "decoded once"
        assert await answer.aread() == b"all 12 bytes"


async def test_a_caller_waits_for_a_free_connection_and_times_out_as_a_pool_timeout() -> None:
    async with serving(keep_answering()) as (server, url), engine_pool(max_connections=1) as pool:
        held = await pool.post(url, b"{}", {}, connect_timeout=5)
        with pytest.raises(httpx.PoolTimeout):
            await pool.post(url, b"{}", {}, connect_timeout=0.1)
        waiting = asyncio.create_task(pool.post(url, b"{}", {}, connect_timeout=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await held.aread()  # the connection is free: the waiting caller takes it
        assert await (await waiting).aread() == b'{"ok": true}'
    assert server.connections == 1


async def test_at_the_limit_an_idle_connection_to_another_engine_makes_room() -> None:
    async with (
        serving(keep_answering()) as (first, first_url),
        serving(keep_answering()) as (second, second_url),
        engine_pool(max_connections=1) as pool,
    ):
        await (await pool.post(first_url, b"{}", {}, connect_timeout=5)).aread()
        assert await (await pool.post(second_url, b"{}", {}, connect_timeout=5)).aread() == b'{"ok": true}'
    assert first.connections == second.connections == 1


async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before the call: refused
    async with engine_pool() as pool:
        with pytest.raises(httpx.ConnectError):
            await pool.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {}, connect_timeout=5)
        # The failed connect gave its place back.
        with pytest.raises(httpx.ConnectError):
            await pool.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {}, connect_timeout=5)


async def test_a_full_accept_queue_is_a_connect_timeout() -> None:
    with unaccepted_address() as (host, port):
        async with engine_pool() as pool:
            with pytest.raises(httpx.ConnectTimeout):
                await pool.post(f"http://{host}:{port}/", b"{}", {}, connect_timeout=0.3)


@pytest.mark.parametrize(
    ("sent", "error"),
    [
        (b"", httpx.RemoteProtocolError),  # closed before any answer
        (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part", httpx.ReadError),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n", httpx.ReadError),
        (b"this is not HTTP\r\n\r\n", httpx.RemoteProtocolError),
    ],
)
async def test_an_engine_failing_after_the_request_is_never_a_connect_error(
    sent: bytes, error: type[httpx.HTTPError]
) -> None:
    async with serving(answer_once(sent)) as (server, url), engine_pool() as pool:
        with pytest.raises(error):
            answer = await pool.post(url, b"{}", {}, connect_timeout=5)
            await answer.aread()
    assert server.requests, "the request was sent"


async def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async with serving(keep_answering()) as (server, url), engine_pool() as pool:
        with pytest.raises(httpx.LocalProtocolError):
            await pool.post(url, b"{}", {"X-Request-Id": "a\r\nX-Injected: 1"}, connect_timeout=5)
    assert server.connections == 0


async def test_a_cancelled_call_closes_its_connection() -> None:
    def handler_for(server: Server) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.read_request(reader)
            await reader.read()  # never answers; sees the close

        return handler

    async with serving(handler_for) as (server, url), engine_pool(max_connections=1) as pool:
        for sent in (1, 2):  # with one connection allowed, the second call gets a place only if the first gave it up
            call = asyncio.create_task(pool.post(url, b"{}", {}, connect_timeout=1))
            async with asyncio.timeout(5):
                while len(server.requests) < sent:  # noqa: ASYNC110 - waiting on the raw server
                    await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
    assert server.connections == 2


async def test_the_keepalive_expiry_counts_from_the_answer_end_not_from_when_it_was_read() -> None:
    async with serving(keep_answering()) as (server, url), engine_pool(keepalive_expiry=0.1) as pool:
        answer = await pool.post(url, b"{}", {}, connect_timeout=5)
        await asyncio.sleep(0.15)  # a slow reader: the engine's keep-alive timer has run meanwhile
        await answer.aread()
        await (await pool.post(url, b"{}", {}, connect_timeout=5)).aread()
    assert server.connections == 2


async def test_credentials_in_the_url_are_sent_as_basic_auth_unless_the_call_has_its_own() -> None:
    async with serving(keep_answering()) as (server, url), engine_pool() as pool:
        with_credentials = url.replace("http://", "http://user:p%40ss@")
        await (await pool.post(with_credentials, b"{}", {}, connect_timeout=5)).aread()
        await (await pool.post(with_credentials, b"{}", {"Authorization": "Bearer k"}, connect_timeout=5)).aread()
    assert b"\r\nAuthorization: Basic dXNlcjpwQHNz\r\n" in server.requests[0]  # user:p@ss
    assert b"Basic" not in server.requests[1] and b"\r\nAuthorization: Bearer k\r\n" in server.requests[1]
    assert b"@" not in server.requests[0].split(b"\r\n")[1]  # the Host header holds no credentials


async def test_a_chunked_body_cut_by_a_clean_close_is_a_read_error_whatever_the_header_case() -> None:
    sent = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n5\r\nfirst\r\n"
    async with serving(answer_once(sent)) as (_, url), engine_pool() as pool:
        answer = await pool.post(url, b"{}", {}, connect_timeout=5)
        with pytest.raises(httpx.ReadError):
            await answer.aread()
