"""An async OpenAI-compatible load generator: streamed chat completions, fixed concurrency or rate.

Every request records when it was sent, when each content chunk arrived (so TTFT and every
inter-token gap), when it ended, its token counts (from the stream's usage chunk) and its error.
Runs are bounded by a request count and a wall-clock limit; requests still open when the limit
and the drain grace have passed are cancelled and counted as errors.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson

from benchmarks.workload import PromptFactory, Workload

MODEL = "sim-model"


@dataclass
class Request:
    """One request to send: its class, its prompt content and how many tokens to generate."""

    index: int
    cls: str
    content: str
    max_tokens: int
    prompt_tokens: int
    target: int | None = None
    """Which base URL to send to (round robin over the targets when None)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Extra request headers (a session id, say)."""


@dataclass
class Record:
    """What one request did, in seconds from the run's start."""

    index: int
    cls: str
    target: str
    start: float
    prompt_tokens: int
    ttft: float | None = None
    e2e: float | None = None
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    tokens_in: int | None = None
    tokens_out: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, as genai-bench and vLLM define it."""
        if not self.ok or self.tokens_out < 2:
            return None
        assert self.e2e is not None and self.ttft is not None
        return (self.e2e - self.ttft) / (self.tokens_out - 1)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gaps"] = [round(g, 6) for g in self.gaps]
        data["tpot"] = self.tpot
        return data


def token_times(record: Record, t0: float) -> list[float]:
    """When each content chunk of a request arrived, on the perf_counter clock (run start `t0`)."""
    if record.ttft is None:
        return []
    times = [t0 + record.start + record.ttft]
    for gap in record.gaps:
        times.append(times[-1] + gap)
    return times


@dataclass
class RunResult:
    records: list[Record]
    started: float
    wall: float
    """Seconds from the first request sent to the last one finished."""


class Progress:
    """A one-line progress bar on stderr (a line every few seconds when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, limit: float | None = None) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled
        self.limit = limit
        self.done = 0
        self.errors = 0
        self._started = time.monotonic()
        self._last = 0.0
        self._tty = sys.stderr.isatty()

    def advance(self, error: bool) -> None:
        self.done += 1
        self.errors += error
        now = time.monotonic()
        if self.enabled and (now - self._last >= (0.2 if self._tty else 5.0) or self.done == self.total):
            self._last = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            if self.done != self.total:
                self._draw(time.monotonic())
            if self._tty:
                sys.stderr.write("\n")

    def _draw(self, now: float) -> None:
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        elapsed = now - self._started
        limit = f"/{self.limit:.0f}" if self.limit else ""
        line = (
            f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"err={self.errors} {elapsed:5.1f}{limit}s"
        )
        sys.stderr.write(("\r" + line) if self._tty else (line + "\n"))
        sys.stderr.flush()


def chat_body(request: Request, *, model: str = MODEL) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": request.content}],
            "max_tokens": request.max_tokens,
            "min_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def send_one(client: httpx.AsyncClient, url: str, request: Request, record: Record, t0: float) -> None:
    """Stream one chat completion into `record` (times relative to t0)."""
    clock = time.perf_counter
    sent = clock()
    record.start = sent - t0
    last: float | None = None
    buffer = b""
    try:
        async with client.stream(
            "POST",
            url + "/v1/chat/completions",
            content=chat_body(request),
            headers={"Content-Type": "application/json", **request.headers},
        ) as response:
            if response.status_code != 200:
                body = await response.aread()
                record.error = f"HTTP {response.status_code}: {body[:200].decode(errors='replace')}"
                return
            async for data in response.aiter_raw():
                now = clock()
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        record.e2e = now - sent
                        continue
                    chunk = orjson.loads(payload)
                    if "error" in chunk:
                        record.error = f"in-band: {str(chunk['error'])[:200]}"
                        continue
                    usage = chunk.get("usage")
                    if usage:
                        record.tokens_in = usage.get("prompt_tokens")
                        record.tokens_out = usage.get("completion_tokens") or record.tokens_out
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("content") or choice.get("text"):
                            record.chunks += 1
                            if last is None:
                                record.ttft = now - sent
                            else:
                                record.gaps.append(now - last)
                            last = now
                        if choice.get("finish_reason") == "error":
                            record.error = "finish_reason=error"
        if record.e2e is None and record.error is None:
            record.error = "stream ended without [DONE]"
        if record.tokens_out == 0:
            record.tokens_out = record.chunks
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]


async def run(
    targets: Sequence[str],
    requests: Sequence[Request],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    duration: float = 300.0,
    drain: float = 60.0,
    label: str = "run",
    progress: bool = True,
    seed: int = 0,
    client: httpx.AsyncClient | None = None,
    on_record: Callable[[Record], None] | None = None,
    stop: asyncio.Event | None = None,
    ramp: float = 0.0,
    think: float = 0.0,
) -> RunResult:
    """Send `requests` at a fixed concurrency (closed loop) or a Poisson rate (open loop).

    No new request starts after `duration` seconds; those still open `drain` seconds later are
    cancelled and recorded as errors. Setting `stop` ends the run early the same way, at once.
    In a closed loop, `ramp` seconds spread the workers' first requests evenly (worker k of n
    starts at k * ramp / n) instead of all at once, and each worker pauses a random think time
    (exponential, mean `think` seconds, drawn from `seed`) between its requests.
    """
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    limit = concurrency or 10_000
    own_client = client is None
    if client is None:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(duration + drain, connect=10.0),
            limits=httpx.Limits(max_connections=limit + 8, max_keepalive_connections=limit + 8),
        )
    bar = Progress(len(requests), label, enabled=progress, limit=duration)
    rr = itertools.cycle(range(len(targets)))
    records: list[Record] = []
    t0 = time.perf_counter()
    deadline = t0 + duration
    queue = iter(requests)

    async def one(request: Request) -> None:
        target = targets[request.target if request.target is not None else next(rr)]
        record = Record(request.index, request.cls, target, 0.0, request.prompt_tokens)
        records.append(record)
        try:
            await send_one(client, target, request, record, t0)
        except asyncio.CancelledError:
            record.error = record.error or "cancelled at the time limit"
            raise
        finally:
            bar.advance(record.error is not None)
            if on_record is not None:
                on_record(record)

    async def worker(delay: float, pauses: random.Random) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        for n, request in enumerate(queue):
            if n and think > 0:  # between requests, not after the last one
                await asyncio.sleep(pauses.expovariate(1.0 / think))
            if time.perf_counter() >= deadline or (stop is not None and stop.is_set()):
                return
            await one(request)

    try:
        if concurrency is not None:
            workers = min(concurrency, len(requests))
            tasks = [
                asyncio.create_task(worker(k * ramp / workers, random.Random(f"{seed}/{k}"))) for k in range(workers)
            ]
        else:
            tasks = []
            rng = random.Random(seed)
            gate = asyncio.Semaphore(limit)

            async def gated(request: Request) -> None:
                async with gate:
                    await one(request)

            for request in queue:
                if time.perf_counter() >= deadline or (stop is not None and stop.is_set()):
                    break
                tasks.append(asyncio.create_task(gated(request)))
                await asyncio.sleep(rng.expovariate(rate))
        if tasks:
            waiter = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
            watchers = [waiter] + ([asyncio.ensure_future(stop.wait())] if stop is not None else [])
            await asyncio.wait(
                watchers, timeout=max(deadline - time.perf_counter(), 0) + drain, return_when=asyncio.FIRST_COMPLETED
            )
            for watcher in watchers[1:]:
                watcher.cancel()
            pending = [task for task in tasks if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        bar.close()
        if own_client:
            await client.aclose()
    finished = [r.start + r.e2e for r in records if r.e2e is not None]
    wall = (max(finished) - min(r.start for r in records)) if finished else time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return RunResult(records, t0, wall)


def build_requests(
    workload: Workload, count: int, factory: PromptFactory, *, seed: int = 0, prompt_seed: int | None = None
) -> list[Request]:
    """`count` requests drawn from `workload`, with their prompts made (deterministic for a seed).

    Prompts differ from their first token across indexes and seeds: give every run its own seed,
    or the engines' prefix caches and the router's prefix index will remember earlier runs.
    `prompt_seed` (default: `seed`) seeds the text alone, so one draw of lengths can get new prompts."""
    key = seed if prompt_seed is None else prompt_seed
    return [
        Request(index, cls, factory.prompt(key * 1_000_000 + index, tokens), out, tokens)
        for index, (cls, tokens, out) in enumerate(workload.draw(count, seed))
    ]
