"""The simulated GPU: a timing model and a continuous-batching scheduler.

Each engine step is either a prefill or one decode step, never both. A prefill is compute-bound
and takes the whole GPU, so every running stream on that engine gets no token until it ends:
that stall is what disaggregated prefill exists to avoid. A decode step is memory-bound: it
reads the weights once plus the KV cache of every running sequence, and gives each one token.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

ABORTED = -1
"""Token index put on a sequence's sink when the scheduler shuts down under it."""

StepKind = Literal["prefill", "decode"]
SequenceState = Literal["waiting", "prefilling", "running", "finished", "cancelled"]


@dataclass(frozen=True, slots=True)
class TimingModel:
    """How long the simulated GPU takes for each kind of work, in seconds.

    The defaults are fast (about ten times a real GPU) so tests and local benchmarks finish
    quickly while keeping the shape: prefill cost grows with uncached prompt tokens, a decode
    step with the total context of the running batch.
    """

    prefill_overhead: float = 0.002
    prefill_per_token: float = 0.00002
    decode_step_base: float = 0.002
    decode_step_per_kv_token: float = 0.0000002
    kv_transfer_per_token: float = 0.000002

    @classmethod
    def realistic(cls) -> TimingModel:
        """Llama-3.1-8B in bf16 on one H100 SXM with one 400 Gb/s RDMA NIC for KV transfer.

        - prefill: about 12k tokens/s, so 1/12000 s per uncached token, plus 4 ms of scheduling,
          kernel launches and sampling per prefill step;
        - decode step: 8 ms base (16 GB of weights read at about 2.5-3 TB/s, about 6 ms, plus
          about 2 ms of scheduling and sampling), plus reading the batch's KV cache: 128 KiB per
          token (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes) at about 2.6 TB/s,
          which is 5e-8 s per context token;
        - KV transfer: the same 128 KiB per token over about 50 GB/s, 2.6e-6 s per token.
        """
        return cls(
            prefill_overhead=0.004,
            prefill_per_token=1 / 12000,
            decode_step_base=0.008,
            decode_step_per_kv_token=5e-8,
            kv_transfer_per_token=2.6e-6,
        )

    def prefill_seconds(self, uncached_tokens: int) -> float:
        return self.prefill_overhead + self.prefill_per_token * uncached_tokens

    def decode_step_seconds(self, context_tokens: int) -> float:
        return self.decode_step_base + self.decode_step_per_kv_token * context_tokens

    def kv_transfer_seconds(self, tokens: int) -> float:
        return self.kv_transfer_per_token * tokens


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, as it happened."""

    kind: StepKind
    started: float
    duration: float
    batch_size: int
    """Sequences that advanced in this step."""
    tokens: int
    """Prefill: uncached tokens computed. Decode: context tokens read."""
    stalled: int
    """Running sequences that got no token because this step was a prefill."""


class Sequence:
    """One prompt's generation inside the scheduler; its tokens go to `sink` as (choice, index)."""

    __slots__ = (
        "choice",
        "generated",
        "max_tokens",
        "needs_prefill",
        "prompt_tokens",
        "seq_id",
        "sink",
        "state",
        "uncached_tokens",
    )

    def __init__(
        self,
        *,
        seq_id: int,
        choice: int,
        prompt_tokens: int,
        uncached_tokens: int,
        max_tokens: int,
        needs_prefill: bool,
        sink: asyncio.Queue[tuple[int, int]],
    ) -> None:
        self.seq_id = seq_id
        self.choice = choice
        self.prompt_tokens = prompt_tokens
        self.uncached_tokens = uncached_tokens
        self.max_tokens = max_tokens
        self.needs_prefill = needs_prefill
        self.sink = sink
        self.generated = 0
        self.state: SequenceState = "waiting"

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated


class Scheduler:
    """Continuous batching over one simulated GPU, run as a single asyncio task.

    Prefills take priority over decode steps (as in vLLM without chunked prefill), batched up to
    `max_prefill_tokens` uncached tokens. At most `max_batch_size` sequences are prefilling or
    running; the rest wait in arrival order. Work per step is linear in the running batch.
    """

    def __init__(
        self,
        timing: TimingModel,
        *,
        max_batch_size: int = 256,
        max_prefill_tokens: int = 8192,
        history_size: int = 4096,
    ) -> None:
        self.timing = timing
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.steps: deque[StepRecord] = deque(maxlen=history_size)
        self.prefill_steps = 0
        self.decode_steps = 0
        self.stalling_prefill_steps = 0
        self._waiting: OrderedDict[int, Sequence] = OrderedDict()
        self._prefilling: dict[int, Sequence] = {}
        self._running: dict[int, Sequence] = {}
        self._context_tokens = 0
        self._next_seq_id = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> int:
        """Sequences on the GPU: prefilling now or decoding."""
        return len(self._running) + len(self._prefilling)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def context_tokens(self) -> int:
        """Tokens of KV cache held by the decoding batch."""
        return self._context_tokens

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-scheduler")
            self._task.add_done_callback(_log_crash)

    async def close(self) -> None:
        """Stop stepping and tell every sequence still inside that it was aborted."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for queue in (self._waiting, self._prefilling, self._running):
            for seq in queue.values():
                seq.state = "cancelled"
                seq.sink.put_nowait((seq.choice, ABORTED))
            queue.clear()
        self._context_tokens = 0

    def submit(
        self,
        *,
        prompt_tokens: int,
        uncached_tokens: int,
        max_tokens: int,
        needs_prefill: bool,
        sink: asyncio.Queue[tuple[int, int]],
        choice: int = 0,
    ) -> Sequence:
        """Queue a sequence; without `needs_prefill` (its KV arrived) it joins the decode batch directly."""
        seq = Sequence(
            seq_id=self._next_seq_id,
            choice=choice,
            prompt_tokens=prompt_tokens,
            uncached_tokens=uncached_tokens,
            max_tokens=max_tokens,
            needs_prefill=needs_prefill,
            sink=sink,
        )
        self._next_seq_id += 1
        self._waiting[seq.seq_id] = seq
        self._wakeup.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Take a sequence out of the batch at once (its client went away)."""
        if seq.state == "waiting":
            del self._waiting[seq.seq_id]
        elif seq.state == "prefilling":
            del self._prefilling[seq.seq_id]
        elif seq.state == "running":
            del self._running[seq.seq_id]
            self._context_tokens -= seq.context_tokens
        else:
            return
        seq.state = "cancelled"

    async def _run(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            prefill_batch = self._admit()
            if prefill_batch:
                await self._prefill_step(prefill_batch)
            elif self._running:
                await self._decode_step()
            else:
                self._wakeup.clear()
                await self._wakeup.wait()

    def _admit(self) -> list[Sequence]:
        """Move waiting sequences onto the GPU in arrival order; return those that need a prefill."""
        batch: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self._waiting and self.running < self.max_batch_size:
            seq = next(iter(self._waiting.values()))
            if seq.needs_prefill:
                if batch and seq.uncached_tokens > budget:
                    break
                budget -= seq.uncached_tokens
                self._waiting.popitem(last=False)
                seq.state = "prefilling"
                self._prefilling[seq.seq_id] = seq
                batch.append(seq)
            else:
                self._waiting.popitem(last=False)
                self._start_decoding(seq)
        return batch

    async def _prefill_step(self, batch: list[Sequence]) -> None:
        tokens = sum(seq.uncached_tokens for seq in batch)
        duration = self.timing.prefill_seconds(tokens)
        stalled = len(self._running)
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(duration)
        self.steps.append(StepRecord("prefill", started, duration, len(batch), tokens, stalled))
        self.prefill_steps += 1
        if stalled:
            self.stalling_prefill_steps += 1
        for seq in batch:
            if seq.state != "prefilling":
                continue
            del self._prefilling[seq.seq_id]
            seq.sink.put_nowait((seq.choice, 0))
            seq.generated = 1
            if seq.generated >= seq.max_tokens:
                seq.state = "finished"
            else:
                self._start_decoding(seq)

    async def _decode_step(self) -> None:
        context = self._context_tokens
        duration = self.timing.decode_step_seconds(context)
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(duration)
        finished: list[Sequence] = []
        for seq in self._running.values():
            seq.sink.put_nowait((seq.choice, seq.generated))
            seq.generated += 1
            if seq.generated >= seq.max_tokens:
                finished.append(seq)
        advanced = len(self._running)
        self._context_tokens += advanced
        for seq in finished:
            del self._running[seq.seq_id]
            self._context_tokens -= seq.context_tokens
            seq.state = "finished"
        self.steps.append(StepRecord("decode", started, duration, advanced, context, 0))
        self.decode_steps += 1

    def _start_decoding(self, seq: Sequence) -> None:
        seq.state = "running"
        self._running[seq.seq_id] = seq
        self._context_tokens += seq.context_tokens


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("scheduler stopped", exc_info=task.exception())
