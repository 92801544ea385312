"""httpx's client API over aiohttp's connection pool, for the calls the router makes to engines off
the request path (the request path's own calls go through engine_pool.py).

Why: at 64 concurrent streams, httpx's own pool (httpcore) spent about two thirds of the router's
CPU walking every pooled connection (and probing each idle socket with a syscall) on each request
and each response end; the router used 8 ms of CPU per short request. aiohttp keeps its idle
connections per host in a queue and parses HTTP in C: 2.9 ms per request, same requests
(`docs/benchmarks.md`, router overhead). The rest of the router keeps speaking httpx: requests,
responses, timeouts and, above all, exceptions. The mapping is the part that matters: the gateway
resends a request only when the engine can never have seen it, and that is `httpx.ConnectError`
or `httpx.ConnectTimeout` alone.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn, Protocol

import aiohttp
import httpx

from dpd_router.pool.engine_pool import EnginePool, PooledAnswer

# A connection limit of 0 or None: as good as none.
_UNLIMITED = 1 << 30
# Request headers aiohttp writes itself from the body it is given.
_BODY_HEADERS = frozenset({"content-length", "transfer-encoding"})


@contextmanager
def _as_httpx_errors(request: httpx.Request) -> Iterator[None]:
    """Re-raise aiohttp's failures as the httpx exceptions the router handles (most specific first)."""
    try:
        yield
    except (aiohttp.ClientError, TimeoutError) as exc:
        _raise_as_httpx(exc, request)


def _raise_as_httpx(exc: aiohttp.ClientError | TimeoutError, request: httpx.Request) -> NoReturn:
    error: httpx.HTTPError
    if not isinstance(exc, aiohttp.ClientError):  # aiohttp's own deadline for taking a pooled connection
        error = httpx.PoolTimeout("no connection became free in time", request=request)
    elif isinstance(exc, aiohttp.ConnectionTimeoutError):
        error = httpx.ConnectTimeout(str(exc) or "connect timed out", request=request)
    elif isinstance(exc, aiohttp.SocketTimeoutError):
        error = httpx.ReadTimeout(str(exc) or "read timed out", request=request)
    elif isinstance(exc, aiohttp.ClientConnectorError):  # refused, unreachable, DNS: nothing was sent
        error = httpx.ConnectError(str(exc), request=request)
    elif isinstance(exc, aiohttp.ServerDisconnectedError):
        error = httpx.RemoteProtocolError(str(exc) or "server disconnected", request=request)
    elif isinstance(exc, aiohttp.ClientPayloadError):
        error = httpx.ReadError(str(exc), request=request)
    elif isinstance(exc, aiohttp.ClientResponseError):  # a malformed answer
        error = httpx.RemoteProtocolError(str(exc), request=request)
    elif isinstance(exc, aiohttp.InvalidURL):
        error = httpx.UnsupportedProtocol(str(exc), request=request)
    elif isinstance(exc, aiohttp.ClientOSError):  # reset or broken pipe on an established connection
        error = httpx.ReadError(str(exc), request=request)
    else:
        error = httpx.NetworkError(f"{type(exc).__name__}: {exc}", request=request)
    raise error from exc


class _Body(httpx.AsyncByteStream):
    """An engine's response body as it arrives; closing it early drops the connection."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors(self._request):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        _release(self._response)


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    """An engine's answer read to its end."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class EngineAnswer(Protocol):
    """What the request path reads of an engine's answer: an httpx.Response has it all, and so does
    the lighter PooledAnswer of the request path's own pool (engine_pool.py)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def aread(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


def arrived_whole(answer: EngineAnswer) -> bytes | None:
    """The answer's whole body when all of it has arrived (nothing to wait for: no deadline needs to bound
    its read), else None. Only the request path's own pool tells."""
    return answer.arrived_whole() if isinstance(answer, PooledAnswer) else None


def _release(response: aiohttp.ClientResponse) -> None:
    if response.content.at_eof():
        response.release()  # read to the end: the connection goes back to the pool
    else:
        response.close()  # cut short: the connection cannot be reused


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport backed by one aiohttp session (created on first use, inside the loop)."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        # The request path's calls skip aiohttp's client altogether (engine_pool.py says why).
        self._engine_pool = EnginePool(
            max_connections=limits.max_connections or _UNLIMITED, keepalive_expiry=limits.keepalive_expiry or 0.0
        )

    def _open_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self._limits.max_connections or 0,
            limit_per_host=0,
            keepalive_timeout=self._limits.keepalive_expiry or 0.0,
        )
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),  # one client for every user's request: no shared cookies
            auto_decompress=False,  # httpx decodes, from the response headers, as with its own pool
            skip_auto_headers=("User-Agent", "Accept-Encoding"),  # httpx already set what the caller wants
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *, connect_timeout: float) -> PooledAnswer:
        """POST without httpx's request and response models: the request path's engine calls."""
        return await self._engine_pool.post(url, body, headers, connect_timeout=connect_timeout)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._session is None:
            self._session = self._open_session()
        timeouts = request.extensions.get("timeout", {})
        headers = [(key, value) for key, value in request.headers.multi_items() if key.lower() not in _BODY_HEADERS]
        body = await request.aread()
        with _as_httpx_errors(request):
            response = await self._session.request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                compress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=timeouts.get("pool"),  # waiting for a pooled connection, connecting included
                    sock_connect=timeouts.get("connect"),
                    sock_read=timeouts.get("read"),
                ),
            )
        return httpx.Response(
            status_code=response.status,
            headers=list(response.raw_headers),
            stream=_Body(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
        )

    async def aclose(self) -> None:
        await self._engine_pool.aclose()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
            await asyncio.sleep(0)  # let the connector's transports finish closing


class EngineCalls:
    """The request path's calls to engines, made on the transport itself.

    An engine call uses nothing of what httpx's client adds per request (merging a base URL,
    headers and cookies, auth and redirect handling, the cookie jar it fills from every answer):
    beside the aiohttp pool the call and its answer skip httpx's models and aiohttp's client
    altogether (engine_pool.py's PooledAnswer); any other transport (the httpx one, tests' mock
    transports) gets an httpx.Request. The client keeps serving the other calls.
    """

    # Engine URLs parsed once: the pool's endpoints and their few paths, however many requests.
    MAX_URLS = 4096

    def __init__(self, transport: httpx.AsyncBaseTransport, headers: Mapping[str, str]) -> None:
        self._transport = transport
        self._direct = transport if isinstance(transport, AiohttpTransport) else None
        self._headers = dict(headers)
        self._urls: dict[str, httpx.URL] = {}

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *, connect_timeout: float) -> EngineAnswer:
        """POST `body` to `url`; the answer's status and headers, its body left to stream."""
        if self._direct is not None:
            return await self._direct.post(url, body, {**self._headers, **headers}, connect_timeout=connect_timeout)
        request = httpx.Request(
            "POST",
            self._url(url),
            headers={**self._headers, **headers},
            content=body,
            extensions={"timeout": {"connect": connect_timeout, "pool": connect_timeout, "read": None, "write": None}},
        )
        response = await self._transport.handle_async_request(request)
        response.request = request
        return response

    async def whole(self, url: str, body: bytes, headers: Mapping[str, str], *, limits: httpx.Timeout) -> WholeAnswer:
        """POST `body` to `url` and read the whole answer, all within `limits.read` seconds (None:
        no limit), of which at most `limits.connect` go to taking or opening a connection.

        The connectors' calls (a prefill, a release of unused KV): one answer each, read whole. Every
        failure is an httpx exception, as through httpx's client: the deadline past is ReadTimeout (the
        request may have reached the engine).
        """
        connect = next((limit for limit in (limits.connect, limits.read) if limit is not None), math.inf)
        if limits.read is None:  # bounded by the caller (a prefill hop): no scope of its own
            return await self._whole(url, body, headers, connect)
        try:
            async with asyncio.timeout(limits.read):
                return await self._whole(url, body, headers, connect)
        except TimeoutError:
            raise httpx.ReadTimeout(f"no whole answer from {url} within {limits.read:g} s") from None

    async def _whole(self, url: str, body: bytes, headers: Mapping[str, str], connect: float) -> WholeAnswer:
        answer = await self.post(url, body, headers, connect_timeout=connect)
        try:
            return WholeAnswer(answer.status_code, await answer.aread())
        finally:
            await answer.aclose()

    def _url(self, url: str) -> httpx.URL:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= self.MAX_URLS:  # engines came and went: start over rather than grow
                self._urls.clear()
            parsed = self._urls[url] = httpx.URL(url)
        return parsed
