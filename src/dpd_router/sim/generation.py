"""One request's life inside an engine: load remote KV, run on the GPU, hand out tokens, keep books."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dpd_router.sim.completion_request import GenerationRequest
from dpd_router.sim.gpu import ABORTED, Sequence
from dpd_router.sim.kv import block_hashes, prompt_digest
from dpd_router.sim.nixl import KvTransferFailed, RemotePrefill, prefill_answer_params
from dpd_router.sim.openai_format import Usage
from dpd_router.sim.stats import RequestKind, RequestRecord, RequestStatus

if TYPE_CHECKING:
    from dpd_router.sim.core import EngineCore


class EngineShutdown(Exception):
    """The scheduler stopped while the request was on it."""


class Generation:
    """A request on its way through the engine; use as a context manager so its outcome is recorded.

    Leaving the block cancelled (the client went away) takes its sequences off the GPU at once.
    """

    def __init__(
        self,
        core: EngineCore,
        request: GenerationRequest,
        kind: RequestKind,
        request_id: str,
        *,
        reject_kv: bool = False,
        withhold_kv_params: bool = False,
        ignore_kv: bool = False,
    ) -> None:
        self.core = core
        self.request = request
        # A decoder whose connector is misconfigured drops the transfer parameters and recomputes.
        self.kind: RequestKind = "local" if ignore_kv and kind == "kv_decode" else kind
        self.request_id = request_id
        self.reject_kv = reject_kv
        self.withhold_kv_params = withhold_kv_params
        self.max_tokens = 1 if kind == "remote_prefill" else request.max_tokens
        self.cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.failed = False
        self.record: RequestRecord | None = None
        self._sink: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self._keys = [core.sampler.key(prompt, request.seed) for prompt in request.prompts]
        self._hashes: list[list[bytes]] = [[] for _ in request.prompts]
        self._generated = [0] * len(request.prompts)
        self._unfinished = len(request.prompts)
        self._sequences: list[Sequence] = []
        self._arrived = time.perf_counter()
        self._first_token_seen = False

    def __enter__(self) -> Generation:
        self.record = self.core.stats.open(self.request_id, self.kind, self.request.prompt_tokens)
        self.core.in_flight += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        status: RequestStatus = "ok"
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError | OSError):
            status = "cancelled"
        elif exc_type is not None or self.failed:
            status = "error"
        self._close(status)

    def _close(self, status: RequestStatus) -> None:
        core = self.core
        for seq in self._sequences:
            core.scheduler.cancel(seq)
        self._sequences.clear()
        if self.record is not None:
            self.record.status = status
            self.record.cached_tokens = self.cached_tokens
        if status == "ok":
            core.metrics.request_success.inc()
        core.in_flight -= 1

    @property
    def choices(self) -> int:
        return len(self.request.prompts)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.request.prompt_tokens,
            completion_tokens=sum(self._generated),
            cached_tokens=self.cached_tokens,
        )

    async def load_kv(self) -> bool:
        """Pull the prompt's KV from the prefiller, if this is a remote decode; False if that failed."""
        if self.kind != "kv_decode":
            return True
        core = self.core
        prompt = self.request.prompts[0]
        started = time.perf_counter()
        try:
            if self.reject_kv:
                raise KvTransferFailed("kv_transfer_params rejected by this engine")
            remote = RemotePrefill.from_params(self.request.kv_transfer_params or {})
            await core.kv_puller.pull(remote, prompt_digest(prompt))
        except KvTransferFailed as exc:
            self._transfer_failed(exc)
            return False
        core.metrics.nixl_xfer_time.observe(time.perf_counter() - started)
        core.metrics.kv_transfers.inc()
        core.stats.kv_transfers += 1
        self._hashes[0] = block_hashes(prompt)
        core.prefix_cache.insert(self._hashes[0], prompt)
        self.cached_tokens = len(prompt)
        return True

    def schedule(self) -> None:
        """Put every prompt on the GPU; only prompt tokens missing from the prefix cache cost prefill time."""
        core = self.core
        needs_prefill = self.kind != "kv_decode"
        for choice, prompt in enumerate(self.request.prompts):
            hashes = self._hashes[choice] or block_hashes(prompt)
            self._hashes[choice] = hashes
            local_hit = core.prefix_cache.cached_tokens(hashes, len(prompt))
            core.metrics.prefix_cache_queries.inc(len(prompt))
            core.metrics.prefix_cache_hits.inc(local_hit)
            if needs_prefill:
                self.cached_tokens += local_hit
            seq = core.scheduler.submit(
                prompt_tokens=len(prompt),
                uncached_tokens=len(prompt) - local_hit,
                max_tokens=self.max_tokens,
                needs_prefill=needs_prefill,
                sink=self._sink,
                choice=choice,
            )
            self._sequences.append(seq)
        core.metrics.prompt_tokens.inc(self.request.prompt_tokens)

    async def next_tokens(self) -> list[tuple[int, int, bool]]:
        """Tokens produced since the last call as (choice, token id, last of its choice); [] when done."""
        if self._unfinished == 0:
            return []
        items = [await self._sink.get()]
        while not self._sink.empty():
            items.append(self._sink.get_nowait())
        sampler = self.core.sampler
        tokens: list[tuple[int, int, bool]] = []
        for choice, index in items:
            if index == ABORTED:
                raise EngineShutdown("the engine stopped")
            if index == 0:
                self._prefilled(choice)
            self._generated[choice] = index + 1
            last = index + 1 == self.max_tokens
            if last:
                self._finished(choice)
            tokens.append((choice, sampler.token(self._keys[choice], index), last))
        self.core.metrics.generation_tokens.inc(len(tokens))
        return tokens

    def _prefilled(self, choice: int) -> None:
        """The first token is out: the prompt's KV exists here now."""
        core = self.core
        if not self._first_token_seen:
            self._first_token_seen = True
            core.metrics.time_to_first_token.observe(time.perf_counter() - self._arrived)
            if self.kind == "local":
                core.stats.local_prefills += 1
                core.metrics.local_prefills.inc()
            elif self.kind == "remote_prefill":
                core.stats.remote_prefills += 1
                core.metrics.remote_prefills.inc()
        if self.kind != "kv_decode":
            core.prefix_cache.insert(self._hashes[choice], self.request.prompts[choice])

    def _finished(self, choice: int) -> None:
        self._unfinished -= 1
        if self.kind == "remote_prefill" and not self.withhold_kv_params:
            self._stage_kv(self.request.prompts[choice])

    def _stage_kv(self, prompt: list[int]) -> None:
        """Hold the prompt's blocks for a decoder, and say where to find them."""
        config = self.core.config
        lease = self.core.leases.grant(f"cmpl-{uuid.uuid4().hex}", prompt_digest(prompt), len(prompt))
        self.kv_transfer_params = prefill_answer_params(
            lease, engine_id=config.engine_id, host=config.advertised_host, port=config.port
        )

    def _transfer_failed(self, exc: KvTransferFailed) -> None:
        core = self.core
        self.failed = True
        core.stats.failed_transfers += 1
        core.metrics.nixl_num_failed_transfers.inc()
        if exc.expired:
            core.metrics.nixl_num_kv_expired_reqs.inc()
