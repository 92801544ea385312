"""One request's life inside an engine: load remote KV, run on the GPU, hand out tokens, keep books.

Remote KV comes three ways: pulled from a NIXL prefiller named in `kv_transfer_params`, fetched
from an SGLang prefiller's bootstrap room, or found in this engine's LMCache receive buffer, where
a prefiller pushed it before the request came. A prefill for a remote decoder leaves KV behind the
matching way: a NIXL lease, a pushed copy and a ProxyNotif (LMCache), or an open bootstrap room.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dpd_sim.bootstrap import BootstrapError, fetch_kv
from dpd_sim.completion_request import GenerationRequest
from dpd_sim.gpu import ABORTED, Sequence
from dpd_sim.kv import block_hashes, prompt_digest
from dpd_sim.lmcache_pd import DisaggSpec
from dpd_sim.nixl import KvTransferFailed, RemotePrefill, prefill_answer_params
from dpd_sim.openai_format import Usage
from dpd_sim.stats import RequestKind, RequestRecord, RequestStatus

if TYPE_CHECKING:
    from dpd_sim.core import EngineCore


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
        withhold_first_token: bool = False,
        withhold_notification: bool = False,
        withhold_bootstrap: bool = False,
    ) -> None:
        self.core = core
        self.request = request
        self.protocol = core.protocol(request)
        # One entry per choice: each prompt n times, in vLLM's order (prompt i's children are i*n .. i*n+n-1).
        self.prompts = [prompt for prompt in request.prompts for _ in range(request.n)]
        # A decoder whose connector is misconfigured drops the transfer parameters and recomputes.
        self.kind: RequestKind = "local" if ignore_kv and kind == "kv_decode" else kind
        self.request_id = request_id
        self.reject_kv = reject_kv
        self.ignore_kv = ignore_kv
        self.withhold_kv_params = withhold_kv_params
        self.withhold_first_token = withhold_first_token
        self.withhold_notification = withhold_notification
        self.withhold_bootstrap = withhold_bootstrap
        self.settle_error = ""
        self.max_tokens = 1 if kind == "remote_prefill" else request.max_tokens
        self.cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.failed = False
        self.record: RequestRecord | None = None
        self._sink: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        # As vLLM's children of a seeded request: child j samples with seed + j.
        self._streams = [
            core.sampler.stream(prompt, request.seed + choice % request.n, request.adapter)
            for choice, prompt in enumerate(self.prompts)
        ]
        self._hashes: list[list[bytes]] = [[] for _ in self.prompts]
        # Prompt tokens of each choice whose KV came from elsewhere (all of them for NIXL and SGLang).
        self._loaded = [0] * len(self.prompts)
        self._generated = [0] * len(self.prompts)
        # The stop token that ended each choice early (vLLM's stop_token_ids), if one did.
        self._stopped_by: list[int | None] = [None] * len(self.prompts)
        self._ended = [False] * len(self.prompts)
        self._unfinished = len(self.prompts)
        self._sequences: list[Sequence] = []
        self._arrived = time.perf_counter()
        self._first_token_seen = False

    def __enter__(self) -> Generation:
        self.record = self.core.stats.open(
            self.request_id, self.kind, self.request.prompt_tokens, model=self.request.adapter
        )
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
        if self.kind == "remote_prefill" and self.protocol == "sglang":
            core.rooms.discard(self._rooms)  # a decoder still waiting for a room learns it is given up
        if self.record is not None:
            self.record.status = status
            self.record.cached_tokens = self.cached_tokens
        if status == "ok":
            core.metrics.request_success.inc()
        core.in_flight -= 1

    @property
    def choices(self) -> int:
        return len(self.prompts)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.request.prompt_tokens,
            completion_tokens=sum(self._generated),
            cached_tokens=self.cached_tokens,
        )

    @property
    def _rooms(self) -> list[int]:
        return [bootstrap.room for bootstrap in self.request.bootstraps or ()]

    async def load_kv(self) -> bool:
        """Get the prompt's KV from where the request says it is; False if that failed."""
        if self.kind == "local":
            return self._take_pushed_kv()
        if self.kind != "kv_decode":
            return True
        core = self.core
        prompts = self.prompts
        started = time.perf_counter()
        try:
            if self.reject_kv:
                raise KvTransferFailed("kv_transfer_params rejected by this engine")
            if self.protocol == "sglang":
                await self._fetch_from_rooms()
            else:
                remote = RemotePrefill.from_params(self.request.kv_transfer_params or {})
                # vLLM's n children each pull the same remote blocks, which the prefiller frees after
                # the first read (it logs "Potentially invalid KV blocks" for the next): the
                # simulator fails the later pulls instead.
                for _ in range(self.request.n):
                    await core.kv_puller.pull(remote, prompt_digest(prompts[0]))
        except KvTransferFailed as exc:
            self._transfer_failed(exc)
            return False
        core.metrics.nixl_xfer_time.observe(time.perf_counter() - started)
        self._kv_arrived([len(prompt) for prompt in prompts])
        return True

    async def _fetch_from_rooms(self) -> None:
        """SGLang: every prompt's KV from its bootstrap room on the prefiller."""
        wait = self.core.config.bootstrap_timeout
        bootstraps = self.request.bootstraps or []
        try:
            await asyncio.gather(
                *(
                    fetch_kv(bootstrap, prompt_digest(prompt), wait)
                    for bootstrap, prompt in zip(bootstraps, self.request.prompts, strict=True)
                )
            )
        except BootstrapError as exc:
            raise KvTransferFailed(str(exc)) from None

    def _take_pushed_kv(self) -> bool:
        """LMCache: a plain request whose prompt, but for its last token, was pushed here by a
        prefiller takes that KV out of the receive buffer; False if it could not be loaded."""
        core = self.core
        if core.lmcache_receiver is None or self.ignore_kv:
            return True
        loaded = [core.lmcache_buffer.take(prompt) for prompt in self.prompts]
        if not any(loaded):
            return True
        self.kind = "kv_decode"
        if self.record is not None:
            self.record.kind = "kv_decode"
        if self.reject_kv:
            self._transfer_failed(KvTransferFailed("the pushed KV could not be loaded"))
            return False
        self._kv_arrived(loaded)
        return True

    def _kv_arrived(self, loaded: list[int]) -> None:
        """Remote KV for the first `loaded[choice]` tokens of each prompt is here: cache its blocks."""
        core = self.core
        core.metrics.kv_transfers.inc()
        core.stats.kv_transfers += 1
        for choice, (prompt, tokens) in enumerate(zip(self.prompts, loaded, strict=True)):
            self._loaded[choice] = tokens
            if tokens == len(prompt):
                self._hashes[choice] = block_hashes(prompt)
                core.prefix_cache.insert(self._hashes[choice], prompt)
            elif tokens:
                core.prefix_cache.insert(block_hashes(prompt[:tokens]), prompt[:tokens])

    def schedule(self) -> None:
        """Put every prompt on the GPU; only prompt tokens neither cached nor transferred cost prefill time."""
        core = self.core
        for choice, prompt in enumerate(self.prompts):
            hashes = self._hashes[choice] or block_hashes(prompt)
            self._hashes[choice] = hashes
            local_hit = core.prefix_cache.cached_tokens(hashes, len(prompt))
            core.metrics.prefix_cache_queries.inc(len(prompt))
            core.metrics.prefix_cache_hits.inc(local_hit)
            loaded = self._loaded[choice]
            needs_prefill = loaded < len(prompt)
            hit = max(local_hit, loaded)
            self.cached_tokens += hit
            seq = core.scheduler.submit(
                prompt_tokens=len(prompt),
                uncached_tokens=len(prompt) - hit,
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
        tokens: list[tuple[int, int, bool]] = []
        stop_ids = self.request.stop_token_ids
        for choice, index in items:
            if index == ABORTED:
                raise EngineShutdown("the engine stopped")
            if self._ended[choice]:
                continue  # a stop token ended it; the scheduler had stepped it once more
            if index == 0:
                self._prefilled(choice)
            self._generated[choice] = index + 1
            # As vLLM's min_tokens: no stop token may be drawn before that many tokens.
            token_id = self._streams[choice].token(index, banned=stop_ids if index < self.request.min_tokens else ())
            stopped = token_id in stop_ids
            last = stopped or index + 1 == self.max_tokens
            if stopped:
                self._stopped_by[choice] = token_id
                self.core.scheduler.cancel(self._sequences[choice])
            if last:
                self._ended[choice] = True
                self._finished(choice, token_id)
            tokens.append((choice, token_id, last))
        self.core.metrics.generation_tokens.inc(len(tokens))
        return tokens

    def stopped_by(self, choice: int) -> int | None:
        """The stop token that ended `choice` (its text is not output, as in vLLM), else None."""
        return self._stopped_by[choice]

    def finish_reason(self, choice: int) -> str:
        return "length" if self._stopped_by[choice] is None else "stop"

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
        if self._loaded[choice] < len(self.prompts[choice]):  # else its KV came whole, and is cached
            core.prefix_cache.insert(self._hashes[choice], self.prompts[choice])

    def _finished(self, choice: int, last_token: int) -> None:
        self._unfinished -= 1
        if self.kind != "remote_prefill":
            return
        prompt = self.prompts[choice]
        if self.protocol == "lmcache":
            self._push_kv(prompt, last_token)
        elif self.protocol == "sglang":
            if not self.withhold_bootstrap:
                self.core.rooms.computed(self._rooms[choice], prompt_digest(prompt), len(prompt))
        elif not self.withhold_kv_params:
            self._stage_kv(prompt)

    def _push_kv(self, prompt: list[int], first_token: int) -> None:
        """LMCache: push the prompt's KV to the decoder's receiver, answer with the first token."""
        params = self.request.kv_transfer_params or {}
        if not self.withhold_kv_params:
            returned: dict[str, Any] = {}
            if "ret_first_tok" in params and not self.withhold_first_token:
                returned["first_tok"] = first_token
            self.kv_transfer_params = returned
        spec = DisaggSpec.from_params(params)
        self.core.lmcache_sender.send(spec, prompt, notify=not self.withhold_notification)

    async def settle(self) -> bool:
        """SGLang: a prefill's answer waits until its decoder took the KV from every room (bounded)."""
        if self.kind != "remote_prefill" or self.protocol != "sglang":
            return True
        wait = self.core.config.bootstrap_timeout
        if await self.core.rooms.handed_over(self._rooms, wait):
            return True
        self.failed = True
        self.settle_error = f"no decoder took the KV of bootstrap rooms {self._rooms} within {wait:g} s"
        return False

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
