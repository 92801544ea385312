"""Relaying the decoder's answer to the client: bytes in, bytes out, watched on the way.

The stream is passed on event by event as it arrives. Events are parsed only as far as the
metrics need: until the first token (TTFT), and the usage event at the end, whose
`cached_tokens` is reconciled to the prefiller's view on the disaggregated path. A connector whose
decoder answers in another shape (LMCache's continuation) passes a `rewrite`: then every event is
parsed and rewritten before anything else looks at it. The answer's API (OpenAI's chat and completions
chunks, or the Responses and Messages APIs' named events) is its `Wire`: what an event with a token
looks like, where the stream ends, how its usage counts, how an in-band error is written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import anyio
import httpx
import orjson

from dpd_router.gateway.resume import Resumer
from dpd_router.gateway.wires import OPENAI_WIRE, Wire
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineAnswer
from dpd_router.record.observe import Ending, Output
from dpd_router.request.errors import RouterError

log = logging.getLogger("dpd_router.gateway")

Rewrite = Callable[[dict[str, Any]], dict[str, Any]]

_EVENT_END = b"\n\n"
_DATA = b"data: "
_DONE = b"data: [DONE]"


class DecodeFailedEarly(Exception):
    """The decoder failed before anything reached the client, so another decoder may still serve it."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class EventStream:
    """Watches and relays one upstream SSE stream, marking what it produced on `output`; closes it and
    ends the request (`on_close`).

    `prime()` reads until the first token, so a decoder that fails before producing one can be
    replaced before the client has seen a byte; the stream then relays what prime() read, and the
    rest as it arrives. Each read waits at most `idle_timeout` seconds. `cached_tokens` may be set
    later (a concurrent prefill's count arrives while the stream runs).
    """

    def __init__(
        self,
        upstream: EngineAnswer,
        ending: Ending,
        output: Output,
        *,
        request_id: str = "-",
        cached_tokens: int | None,
        on_close: Callable[[], None],
        idle_timeout: float,
        strip_usage: bool = False,
        rewrite: Rewrite | None = None,
        on_disconnect: Callable[[], None] | None = None,
        engine: Endpoint | None = None,
        wire: Wire = OPENAI_WIRE,
        resumer: Resumer | None = None,
        on_first_token: Callable[[], None] | None = None,
    ) -> None:
        self._upstream = upstream
        # Told of this stream's first token (Exchange.first_token: what waits for the request's).
        self._on_first_token = on_first_token
        # Continues the stream on another decoder when this one fails after output (gateway/resume.py).
        self._resumer = resumer
        self._tape = None if resumer is None else resumer.tape
        # How the decoder failed once the client had output: (outcome, detail, the client's message).
        self._broken: tuple[str, str, str] | None = None
        self._wire = wire
        # The decoder whose stream this is: every chunk it sends shows it moving (gateway/watch.py).
        self._engine = engine
        self._on_disconnect = on_disconnect
        self._strip_usage = strip_usage
        self._rewrite = rewrite
        self._chunks = upstream.aiter_raw()
        self._ending = ending
        self._output = output
        self._request_id = request_id
        self.cached_tokens = cached_tokens
        self._on_close = on_close
        self._idle_timeout = idle_timeout
        self._pending = b""
        self._head = b""
        self._early_failure: str | None = None
        # This stream's own first token (the request's may come earlier: a head the router sent itself).
        self._saw_token = False
        self._relaying = False
        self._ended = False
        self._saw_done = False
        self._complete = False
        # This relay ended the request with a failure of the decoder's: a client leaving after it does not end it.
        self._failed = False
        self._closed = False
        # The idle limit of the relay's reads (see _read_within_idle): when the current read started
        # (None: no read under way), and the one timer that checks it.
        self._read_since: float | None = None
        self._idle_check: asyncio.TimerHandle | None = None
        self._idle_cancel: int | None = None  # the task's cancel count before the idle check cancelled it

    @property
    def media_type(self) -> str:
        media_type: str = self._upstream.headers.get("content-type", "text/event-stream")
        return media_type

    async def prime(self, deadline: float) -> None:
        """Read until the first token arrives (by loop time `deadline`); raise DecodeFailedEarly if
        the decoder reports an error before it, TimeoutError if it does not come in time."""
        loop = asyncio.get_running_loop()
        while not self._saw_token and self._early_failure is None and not self._ended:
            chunk = await self._read(deadline - loop.time())
            if chunk is None:
                self._ended = True
                break
            self._head += self._absorb(chunk)
        if self._early_failure is not None:
            await self.discard()  # nothing was relayed: the caller retries or reports
            raise DecodeFailedEarly(self._early_failure)

    async def _read(self, wait: float) -> bytes | None:
        """The next upstream read, or None at its end; TimeoutError after `wait` seconds."""
        try:
            async with asyncio.timeout(max(wait, 0.0)):
                chunk = await anext(self._chunks)
        except StopAsyncIteration:
            return None
        if self._engine is not None:
            self._engine.progressed(asyncio.get_running_loop().time())
        return chunk

    async def _read_within_idle(self) -> bytes | None:
        """The next upstream read, or None at its end; TimeoutError after `idle_timeout` seconds.

        What `_read(idle_timeout)` does, without an asyncio.timeout (a timer scheduled and cancelled)
        for every chunk of a long stream: one timer a stream checks, when it fires, how long the read
        under way has waited, and moves itself to that read's own limit when it is younger.
        """
        loop = asyncio.get_running_loop()
        self._read_since = loop.time()
        if self._engine is not None:
            # Reads follow one another at once: one starting now means the last chunk has just come.
            self._engine.last_moved = self._read_since
        if self._idle_check is None:
            task = asyncio.current_task()
            assert task is not None
            self._idle_check = loop.call_at(self._read_since + self._idle_timeout, self._check_idle, loop, task)
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            cancelled_before, self._idle_cancel = self._idle_cancel, None
            task = asyncio.current_task()
            if cancelled_before is not None and task is not None and task.uncancel() <= cancelled_before:
                raise TimeoutError from None  # the idle check's own cancel, nobody else's
            raise
        finally:
            self._read_since = None

    def _check_idle(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        since = self._read_since
        now = loop.time()
        if since is not None and now - since >= self._idle_timeout:
            self._idle_check = None
            self._idle_cancel = task.cancelling()
            task.cancel()
            return
        # No read under way (the client is taking the last chunk), or a younger one: check again then.
        self._idle_check = loop.call_at(
            (now if since is None else since) + self._idle_timeout, self._check_idle, loop, task
        )

    def _stop_idle_check(self) -> None:
        if self._idle_check is not None:
            self._idle_check.cancel()
            self._idle_check = None

    def _absorb(self, chunk: bytes) -> bytes:
        """Add a read to the partial event; return the complete events, inspected, ready to send."""
        self._pending += chunk
        if _EVENT_END not in self._pending:
            return b""
        *events, self._pending = self._pending.split(_EVENT_END)
        return self._relay_events(events)

    async def discard(self) -> None:
        """Close the upstream without ending the request: it is retried, or fails, elsewhere."""
        if self._closed:
            return
        self._closed = True
        self._stop_idle_check()
        with anyio.CancelScope(shield=True):
            await self._upstream.aclose()

    async def close(self) -> None:
        """Close the upstream response and record the request; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._stop_idle_check()
        if not self._complete and not self._failed:
            self._ending.fail("client_disconnect", "the client disconnected during the stream", status=499)
            if self._on_disconnect is not None:
                self._on_disconnect()
        with anyio.CancelScope(shield=True):
            await self._upstream.aclose()
        self._on_close()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self._relaying = True
        try:
            try:
                async for out in self._relay_own():
                    yield out
            except TimeoutError:
                detail = f"no data from {self._output.decoder} for {self._idle_timeout:g} s"
                message = "The decoder stopped sending tokens before the stream ended."
                self._broken = ("upstream_timeout", detail, message)
            except httpx.HTTPError as exc:
                detail = f"{type(exc).__name__} while streaming from {self._output.decoder}"
                self._broken = (
                    "upstream_error",
                    detail,
                    "The connection to the decoder broke before the stream ended.",
                )
            if self._broken is not None:
                async for out in self._after_failure(*self._broken):
                    yield out
        finally:
            await self.close()

    async def _relay_own(self) -> AsyncIterator[bytes]:
        """This decoder's stream; a failure after output is left in `_broken` (or raised, when it broke)."""
        if self._head:
            head, self._head = self._head, b""
            await self._settle()
            yield head
        while not self._ended and self._broken is None:
            chunk = await self._read_within_idle()
            if chunk is None:
                break
            out = self._absorb(chunk)
            if out:
                await self._settle()
                yield out
        if self._broken is not None:
            return
        if self._pending.strip():
            yield self._pending
        if not self._saw_done and not self._failed:
            detail = "the decoder closed the stream before [DONE]"
            self._broken = ("upstream_truncated", detail, "The decoder ended the stream early.")
        else:
            self._complete = True

    async def _after_failure(self, outcome: str, detail: str, message: str) -> AsyncIterator[bytes]:
        """The rest of a stream whose decoder failed after output: continued on another decoder where it can
        be, else ended with an in-band error."""
        ending, resumer, request_id = self._ending, self._resumer, self._request_id
        reason = "disabled" if resumer is None else resumer.why_not(self._saw_token)
        if resumer is not None and reason is None:
            self._stop_idle_check()
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()  # the broken decoder's call: nothing more comes from it
            try:
                async for out in resumer.relay(detail, self.cached_tokens):
                    yield out
                self._complete = True
                return
            except RouterError as exc:
                resumer.count("failed", "unserved")
                detail = f"{detail}; its continuation failed: {exc.message}"
            except Exception as exc:  # a bug, not the engines: the stream still ends, in-band
                log.exception("request %s: the continuation after a failed decoder failed", request_id)
                resumer.count("failed", "error")
                detail = f"{detail}; its continuation failed: {type(exc).__name__}: {exc}"
        elif resumer is not None:
            resumer.count("not_tried", reason or "")
            ending.continued_after = f"not continued ({reason})"
            end = resumer.ending() if reason == "answer_complete" else None
            if end is not None:
                # The client has the whole answer: it ends as the decoder would have ended it, not with an error,
                # read as the decoder's own end would have been (the broken decoder's partial event is dropped).
                log.warning(
                    "request %s: %s after the answer's last token; its end written from what was kept",
                    request_id,
                    detail,
                )
                self._pending = b""
                out = self._absorb(end)
                await self._settle()
                self._complete = True
                yield out
                return
        log.warning("request %s: %s; the stream ends (%s)", request_id, detail, ending.continued_after)
        self._complete = self._failed = True
        ending.fail(outcome, detail)
        yield self._error_event(message)

    async def _settle(self) -> None:
        """Once the answer has ended, what the wire keeps of it is kept before the client sees the end."""
        if self._saw_done:
            await self._wire.settle()

    def _relay_events(self, events: list[bytes]) -> bytes:
        ending, wire, output = self._ending, self._wire, self._output
        data, ends, only_tokens = wire.data, wire.ends, wire.only_tokens
        now = time.perf_counter()
        tokens = 0  # chunks of output in this read: they reached the router together, so are marked together
        for index, event in enumerate(events):
            start = data(event)
            if start is None:
                continue
            if ends(event):
                self._saw_done = True
                if event.startswith(_DONE):
                    continue  # a Responses stream's last event is the whole response, its usage included
            if self._tape is not None:
                event = events[index] = self._tape.keep(event)
            if self._rewrite is not None:
                event = events[index] = self._rewritten(event)
            first = not self._saw_token
            if not first and only_tokens(event):
                tokens += 1
                continue
            try:
                payload = orjson.loads(event[start:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(payload, dict):
                continue
            if self._tape is not None:
                self._tape.seen(payload)
            failure = wire.errored(payload)
            if failure is not None:
                if first and not self._relaying:
                    self._early_failure = failure
                elif self._resumer is not None and (reason := self._resumer.why_not(self._saw_token)) is None:
                    # Not relayed: the stream goes on from another decoder (or ends with this failure).
                    self._broken = ("upstream_error", failure, failure)
                    events[index:] = [b""] * (len(events) - index)
                    break
                else:
                    if self._resumer is not None:
                        self._resumer.count("not_tried", reason or "")
                        ending.continued_after = f"not continued ({reason})"
                    self._failed = True
                    ending.fail("upstream_error", failure)
            if wire.has_token(payload):
                self._saw_token = True
                tokens += 1
            if wire.reconcile(payload, output, self.cached_tokens):
                events[index] = event[:start] + orjson.dumps(payload)
            if self._strip_usage and "usage" in payload:
                if payload.get("choices"):
                    payload.pop("usage")
                    events[index] = _DATA + orjson.dumps(payload)
                else:
                    events[index] = b""  # the usage-only chunk the router asked for, not the client
        if tokens:
            output.mark_token_chunks(now, tokens)
            if self._on_first_token is not None:
                reached, self._on_first_token = self._on_first_token, None
                reached()
        kept = [event for event in events if event]
        return _EVENT_END.join(kept) + _EVENT_END if kept else b""

    def _rewritten(self, event: bytes) -> bytes:
        try:
            payload = orjson.loads(event[len(_DATA) :])
        except orjson.JSONDecodeError:
            return event
        if not isinstance(payload, dict) or self._rewrite is None:
            return event
        return _DATA + orjson.dumps(self._rewrite(payload))

    def _error_event(self, message: str) -> bytes:
        return self._wire.error_event(message)


def failed_before_output(content: bytes, wire: Wire = OPENAI_WIRE) -> str | None:
    """The in-band failure of a whole (non-streamed) answer that has no output token, as the decoder
    wrote it: another decoder may serve the request. None for anything else."""
    if b'"error"' not in content:
        return None
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    failure = wire.errored(payload)
    if failure is None:
        return None
    return failure if wire.output_tokens(payload) in (None, 0) else None


class RelayedBody(NamedTuple):
    """A whole answer as the client gets it, the output tokens its usage counts (None: it counts none), and
    the failure the engine wrote in it (None: none)."""

    content: bytes
    output_tokens: int | None
    failure: str | None = None


def relay_body(
    content: bytes,
    output: Output,
    cached_tokens: int | None,
    rewrite: Rewrite | None = None,
    wire: Wire = OPENAI_WIRE,
) -> RelayedBody:
    """Inspect a whole (non-streamed) answer, marked on `output` with its usage reconciled; the bytes to send."""
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        return RelayedBody(content, None)
    if not isinstance(payload, dict):
        return RelayedBody(content, None)
    if rewrite is not None:
        payload = rewrite(payload)
        content = orjson.dumps(payload)
    output.mark_token_chunk(time.perf_counter())
    if wire.reconcile(payload, output, cached_tokens):
        content = orjson.dumps(payload)
    return RelayedBody(content, wire.output_tokens(payload), wire.errored(payload))
