"""Small ASGI pieces for the completion endpoints, which run below FastAPI to own disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client went away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_start(send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def send_body(send: Send, body: bytes, *, more: bool) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more})


async def send_json(send: Send, status: int, body: bytes) -> None:
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send_start(send, status, headers)
    await send_body(send, body, more=False)


async def run_until_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run `work`; if the client disconnects first, cancel it (its cleanup runs) and return.

    A write failing because the client is gone (OSError) counts as that disconnect.
    """
    worker = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((worker, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        worker.cancel()
        watcher.cancel()
        outcome, _ = await asyncio.gather(worker, watcher, return_exceptions=True)
    if isinstance(outcome, Exception) and not isinstance(outcome, OSError):
        raise outcome


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
