"""Shadow copies: queued without waiting, sent by a fixed set of workers, timed, and dropped.

The client's request only ever pays for `Shadow.offer`: a length check, a hash, and a put on a
bounded queue that drops (and counts) a copy rather than wait. Workers send the copies as streams
(whatever the client asked for) so the shadow's first token and inter-token gaps can be timed, on
an HTTP session of their own: a hung shadow holds its own connections, never the engines'.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from dpd_router.config import ShadowSettings
from dpd_router.gateway.wires import OPENAI_WIRE, Wire, wire_for
from dpd_router.prompt.tokenizer import LARGE_REQUEST_BYTES
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Ending, Observer, Output, RequestTrace
from dpd_router.request.client_request import ClientRequest, RequestKind
from dpd_router.routing.request import session_key
from dpd_router.shadow.choice import ShadowChoice
from dpd_router.startup.tasks import cancel_and_wait
from dpd_router.transfer.base import ENGINE_PATHS

log = logging.getLogger("dpd_router.shadow")

# The `arm` label of the shadow's request metrics.
SHADOW_ARM = "shadow"
# Marks a copy, so a staging dpd-router behind the shadow can tell it (and never copies it again).
SHADOW_HEADER = "x-dpd-shadow"
# A shadow's failures are logged at most once in this many seconds (they are all counted).
FAILURE_LOG_INTERVAL = 60.0
# An event longer than this is not an answer the shadow means to give: the copy fails.
MAX_EVENT_BYTES = 1 << 20

_EVENT_END = b"\n\n"
_DATA = b"data: "
_DONE = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class ShadowCopy:
    """What a worker needs to send one copy: the client's body as it arrived, and what the router knew."""

    request_id: str
    kind: RequestKind
    raw: bytes
    # The live request's model: the router may have filled it in, and then `raw` lacks it.
    model: str | None
    prompt_tokens: int


class ShadowAnswerUnreadable(ValueError):
    """The shadow's answer is not an event stream the worker can read."""


class Shadow:
    """Copies chosen requests to the shadow from `start` to `close`; nothing it does reaches a client."""

    def __init__(
        self,
        settings: ShadowSettings,
        observer: Observer,
        metrics: RouterMetrics,
        *,
        session_header: str | None = None,
    ) -> None:
        self._settings = settings
        self._observer = observer
        self._metrics = metrics
        self._session_header = session_header
        self._choice = ShadowChoice(settings)
        self._queue: asyncio.Queue[ShadowCopy] = asyncio.Queue(maxsize=settings.queue)
        self._headers = shadow_headers(settings)
        self._dropped_full = metrics.shadow_dropped.labels("queue_full")
        self._session: aiohttp.ClientSession | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._unlogged_failures = 0
        self._last_logged = -math.inf

    @property
    def url(self) -> str:
        return self._settings.url

    def offer(self, request: ClientRequest, request_id: str, prompt_tokens: int, headers: Mapping[str, str]) -> None:
        """Queue a copy of the request if it is chosen; never waits (a full queue drops the copy)."""
        if self._session is None or headers.get(SHADOW_HEADER):
            return  # not running, or a copy itself (this router is the staging one)
        if not self._choice.eligible(prompt_tokens):
            return
        key = session_key(headers, request.body, header=self._session_header) or request_id
        if not self._choice.chosen(key):
            return
        model = request.body.get("model")
        # A Responses request as the engines get it: its history expanded, stored nowhere (responses.history).
        raw = request.encoded() if request.kind == "responses" else request.raw
        copy = ShadowCopy(request_id, request.kind, raw, model if isinstance(model, str) else None, prompt_tokens)
        try:
            self._queue.put_nowait(copy)
        except asyncio.QueueFull:
            self._dropped_full.inc()

    def start(self) -> None:
        """Open the shadow's own session and start `max_concurrent` workers (inside the running loop)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._settings.max_concurrent, limit_per_host=0),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._workers = [
            asyncio.create_task(self._work(), name=f"shadow-{number}")
            for number in range(self._settings.max_concurrent)
        ]
        log.info(
            "shadowing to %s (%s): share %g, prompts of at least %d tokens%s, %d calls at once",
            self.url,
            self._settings.kind,
            self._settings.share,
            self._settings.min_prompt_tokens,
            ""
            if self._settings.longest_percentile is None
            else f" longer than the p{self._settings.longest_percentile:g} of the last {self._settings.window}",
            self._settings.max_concurrent,
        )

    async def close(self) -> None:
        """Stop the workers (their calls cut short) and count the copies still queued as dropped."""
        session, self._session = self._session, None
        await cancel_and_wait(self._workers)
        self._workers = []
        left = self._queue.qsize()
        while not self._queue.empty():
            self._queue.get_nowait()
        if left:
            self._metrics.shadow_dropped.labels("closed").inc(left)
        if session is not None:
            await session.close()

    async def _work(self) -> None:
        while True:
            copy = await self._queue.get()
            await self._send(copy)

    async def _send(self, copy: ShadowCopy) -> None:
        """Send one copy and record it under the shadow's arm; whatever happens, nothing is raised."""
        trace = RequestTrace(request_id=copy.request_id, kind=copy.kind, stream=True)
        trace.arm = SHADOW_ARM
        trace.path = self._settings.kind
        trace.reason = SHADOW_ARM
        trace.prompt_tokens = copy.prompt_tokens
        ending = Ending()
        answer = ShadowAnswer(ending, wire_for(copy.kind))
        try:
            body = await self._body(copy)
            async with asyncio.timeout(self._settings.timeout):
                await self._call(copy, body, trace, answer)
        except TimeoutError:
            ending.fail("timeout", f"no whole answer within {self._settings.timeout:g} s")
        except Exception as exc:  # a shadow's failure is counted and logged, never raised
            ending.fail("error", f"{type(exc).__name__}: {exc}")
        trace.take(answer.output, ending=ending)  # what came before a timeout too
        self._observer.record(trace, time.perf_counter())
        self._metrics.shadow_requests.labels(trace.outcome).inc()
        if trace.outcome != "ok":
            self._note_failure(trace)

    async def _body(self, copy: ShadowCopy) -> bytes:
        if len(copy.raw) > LARGE_REQUEST_BYTES:  # decoding megabytes of JSON would hold up every request
            return await asyncio.to_thread(shadow_body, copy, self._settings.model)
        return shadow_body(copy, self._settings.model)

    async def _call(self, copy: ShadowCopy, body: bytes, trace: RequestTrace, answer: ShadowAnswer) -> None:
        assert self._session is not None
        headers = {**self._headers, "x-request-id": copy.request_id}
        # Timed from the call: the wait in the router's queue is not the shadow's latency.
        trace.started = answer.output.decode_started = time.perf_counter()
        async with self._session.post(self.url + ENGINE_PATHS[copy.kind], data=body, headers=headers) as response:
            if response.status >= 400:
                status = response.status
                answer.ending.fail(f"status_{status // 100}xx", f"the shadow answered {status}", status=status)
                return
            async for chunk in response.content.iter_any():
                answer.feed(chunk, time.perf_counter())
            answer.end()

    def _note_failure(self, trace: RequestTrace) -> None:
        """Log the failures at most once a minute: a shadow that is down must not flood the log."""
        self._unlogged_failures += 1
        now = time.monotonic()
        if now - self._last_logged < FAILURE_LOG_INTERVAL:
            return
        log.warning(
            "shadow %s: %d copies failed since the last report; the last (request %s): %s",
            self.url,
            self._unlogged_failures,
            trace.request_id,
            trace.error,
            extra={"fields": {"event": "shadow_failed", "outcome": trace.outcome}},
        )
        self._unlogged_failures = 0
        self._last_logged = now


def shadow_headers(settings: ShadowSettings) -> dict[str, str]:
    """What every copy carries: JSON, the shadow mark, and the shadow's own credentials (never a client's)."""
    headers = {"content-type": "application/json", SHADOW_HEADER: "1"}
    if settings.api_key is not None:
        headers["authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
    headers.update({name.lower(): value.get_secret_value() for name, value in settings.headers.items()})
    return headers


def shadow_body(copy: ShadowCopy, model: str | None) -> bytes:
    """The client's body as a stream that ends with its usage, asking for `model` if given (the Messages and
    Responses APIs' streams carry their usage in their own events)."""
    body: dict[str, Any] = orjson.loads(copy.raw)
    body["stream"] = True
    if copy.kind in ("chat", "completion"):
        options = body.get("stream_options")
        body["stream_options"] = (
            {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
        )
    model = model or copy.model
    if model is not None:
        body["model"] = model
    return orjson.dumps(body)


class ShadowAnswer:
    """Reads a shadow's event stream, in the API it is written in (its `Wire`, as the relay reads a decoder's):
    its first token, gaps and usage into `output`, a failure it reports into its `ending`; the text is dropped."""

    def __init__(self, ending: Ending, wire: Wire = OPENAI_WIRE) -> None:
        self.ending = ending
        self.output = Output()
        self._failed = False
        self._wire = wire
        self._pending = b""
        self._saw_token = False
        self._saw_done = False

    def feed(self, chunk: bytes, now: float) -> None:
        self._pending += chunk
        if _EVENT_END not in self._pending:
            if len(self._pending) > MAX_EVENT_BYTES:
                raise ShadowAnswerUnreadable(f"an event of more than {MAX_EVENT_BYTES} bytes")
            return
        *events, self._pending = self._pending.split(_EVENT_END)
        for event in events:
            self._read(event.strip(), now)

    def end(self) -> None:
        if not self._saw_done:
            self._fail("the shadow ended the stream before its end event ([DONE])")

    def _fail(self, failure: str) -> None:
        """The first failure the stream showed is the shadow's."""
        if not self._failed:
            self._failed = True
            self.ending.fail("error", failure)

    def _read(self, event: bytes, now: float) -> None:
        wire = self._wire
        start = wire.data(event)
        if start is None:
            return
        if wire.ends(event):
            self._saw_done = True
            if event.startswith(_DONE):
                return
        output = self.output
        if self._saw_token and wire.only_tokens(event):
            output.mark_token_chunk(now)  # past the first token, a chunk is a token unless it says otherwise
            return
        try:
            payload = orjson.loads(event[start:])
        except orjson.JSONDecodeError:
            return
        if not isinstance(payload, dict):
            return
        failure = wire.errored(payload)
        if failure is not None:
            self._fail(failure)
        if wire.has_token(payload):
            self._saw_token = True
            output.mark_token_chunk(now)
        wire.reconcile(payload, output, None)
