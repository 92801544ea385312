"""What the gateway gives back: an answer as data. The HTTP edge (api/answers.py) writes it as a
response; the gateway never builds one."""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WholeAnswer:
    """An answer read whole; the request it ends is already over (released and recorded)."""

    content: bytes
    headers: Mapping[str, str]
    status: int = 200
    media_type: str = "application/json"


@dataclass(frozen=True)
class StreamedAnswer:
    """An answer still streaming. `events` yields its bytes; `close` ends the request (closes the
    upstream, records it, releases what it holds) and must run once it is sent or will not be, also
    when it never began."""

    events: AsyncIterable[bytes]
    close: Callable[[], Awaitable[None]]
    headers: Mapping[str, str]
    media_type: str = "text/event-stream"


Answer = WholeAnswer | StreamedAnswer
