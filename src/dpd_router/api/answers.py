"""The gateway's answers as HTTP responses: built here, at the edge, and nowhere else.

Written on raw ASGI: the completion lane sends an answer's head and body itself (no Response object, and
no task group around a stream: the request's Departure stops a stream whose client left).
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import Send

from dpd_router.api.departure import Departure
from dpd_router.gateway.answer import Answer, StreamedAnswer


def raw_headers(headers: Mapping[str, str], media_type: str, length: int | None) -> list[tuple[bytes, bytes]]:
    """An answer's head as Starlette writes a Response's: lower-case names, its length where it has one, and
    its content type with a charset for text."""
    raw = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    if length is not None:
        raw.append((b"content-length", str(length).encode("latin-1")))
    if "content-type" not in headers and "Content-Type" not in headers:
        if media_type.startswith("text/") and "charset=" not in media_type.lower():
            media_type += "; charset=utf-8"
        raw.append((b"content-type", media_type.encode("latin-1")))
    return raw


async def send_answer(answer: Answer, send: Send, departure: Departure | None = None) -> None:
    """Send `answer` to the client; a stream's `close` runs however its sending ends. `departure` watched the
    client while the answer was made and stops once the last byte is on its way."""
    if not isinstance(answer, StreamedAnswer):
        head = raw_headers(answer.headers, answer.media_type, len(answer.content))
        if departure is not None:
            departure.stop()
        await send({"type": "http.response.start", "status": answer.status, "headers": head})
        await send({"type": "http.response.body", "body": answer.content})
        return
    try:
        head = raw_headers(answer.headers, answer.media_type, None)
        await send({"type": "http.response.start", "status": 200, "headers": head})
        async for chunk in answer.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if departure is not None:
            departure.stop()
        await send({"type": "http.response.body", "body": b""})
    finally:
        await answer.close()


async def discard(answer: Answer) -> None:
    """End an answer that will never be sent: a stream's upstream, and the request's record and
    admission slot (a whole answer released them when it was read)."""
    if isinstance(answer, StreamedAnswer):
        await answer.close()
