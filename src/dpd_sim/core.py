"""One simulated engine's state, built at startup: tokenizer, GPU, KV cache and leases, metrics."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import httpx
from transformers import AutoTokenizer

from dpd_sim.bootstrap import BootstrapRooms, BootstrapServer
from dpd_sim.completion_request import GenerationRequest, InvalidRequest, RequestParser
from dpd_sim.config import SimConfig
from dpd_sim.faults import FaultInjector
from dpd_sim.gpu import Scheduler
from dpd_sim.kv import KvLease, LeaseTable, PrefixCache
from dpd_sim.kv_events import KvEventPublisher
from dpd_sim.lmcache_pd import DisaggSpec, DisaggSpecError, PdReceiver, PdSender, ReceiveBuffer
from dpd_sim.metrics import EngineMetrics
from dpd_sim.nixl import KvPuller, NixlSideChannel
from dpd_sim.sampler import Sampler
from dpd_sim.stats import RequestKind, RequestLog
from dpd_sim.tasks import cancel_and_wait

Protocol = Literal["nixl", "lmcache", "sglang"]


class EngineCore:
    """Everything one engine owns; `start()` and `close()` run its background work."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(str(config.tokenizer), local_files_only=True)
        self.parser = RequestParser(
            self.tokenizer,
            model=config.model,
            max_model_len=config.max_model_len,
            adapters=dict(config.lora_modules),
        )
        self.sampler = Sampler(self.tokenizer.backend_tokenizer, engine_seed=config.seed)
        self.scheduler = Scheduler(config.timing, max_batch_size=config.max_batch_size)
        self.kv_events: KvEventPublisher | None = None
        if config.kv_events_port is not None:
            self.kv_events = KvEventPublisher(
                config.host,
                config.kv_events_port,
                topic=config.kv_events_topic,
                event_format=config.kv_events_format,
                replay_port=config.kv_events_replay_port,
            )
        self.prefix_cache = PrefixCache(config.prefix_cache_blocks, listener=self.kv_events)
        self.metrics = EngineMetrics(config.model)
        self.leases = LeaseTable(config.lease_seconds, on_expire=self._lease_expired)
        self.side_channel = NixlSideChannel(config.engine_id, self.leases, config.timing)
        self.stats = RequestLog()
        self.faults = FaultInjector()
        self.in_flight = 0
        self.kv_puller = KvPuller(
            httpx.AsyncClient(
                timeout=httpx.Timeout(30.0, connect=2.0),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
            )
        )
        # LMCache PD: a decoder's receiver of pushed KV, a prefiller's sender of it.
        self.lmcache_buffer = ReceiveBuffer(
            len(config.lmcache_receiver_ports) or 1, capacity_tokens=config.lmcache_buffer_tokens
        )
        self.lmcache_receiver = (
            PdReceiver(config.host, config.lmcache_receiver_ports, self.lmcache_buffer)
            if config.lmcache_receiver_ports
            else None
        )
        self.lmcache_sender = PdSender(config.lmcache_notify_url, config.timing)
        # SGLang: a prefiller's bootstrap rooms and the server decoders ask them on.
        self.rooms = BootstrapRooms()
        self.bootstrap_server = (
            BootstrapServer(config.host, config.bootstrap_port, self.rooms, config.timing, config.bootstrap_timeout)
            if config.bootstrap_port is not None and config.can_prefill_for_remote
            else None
        )
        self._reaper: asyncio.Task[None] | None = None
        self.metrics.watch(
            running=lambda: self.scheduler.running,
            waiting=lambda: self.scheduler.waiting,
            kv_cache_usage=self.kv_cache_usage,
        )

    async def start(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.start()
        if self.lmcache_receiver is not None:
            await self.lmcache_receiver.start()
        if self.bootstrap_server is not None:
            await self.bootstrap_server.start()
        self.scheduler.start()
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_leases(), name="sim-lease-reaper")

    async def close(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            await cancel_and_wait([reaper])
        await self.scheduler.close()
        await self.kv_puller.client.aclose()
        await self.lmcache_sender.close()
        if self.lmcache_receiver is not None:
            await self.lmcache_receiver.close()
        if self.bootstrap_server is not None:
            await self.bootstrap_server.close()
        if self.kv_events is not None:
            await self.kv_events.close()

    def protocol(self, request: GenerationRequest) -> Protocol:
        """The P/D protocol the request speaks: LMCache's disagg_spec, SGLang's bootstrap fields, else NIXL."""
        if "disagg_spec" in (request.kv_transfer_params or {}):
            return "lmcache"
        if request.bootstraps is not None:
            return "sglang"
        return "nixl"

    def refuses(self, request: GenerationRequest) -> str | None:
        """Why this engine aborts the request outright (None: it does not): an SGLang decode-mode
        server cannot serve a request that names no bootstrap room; a poisoned request fails anywhere."""
        if self.config.bootstrap_required and self.config.role == "decode" and request.bootstraps is None:
            return "this decode-mode server needs bootstrap_host, bootstrap_port and bootstrap_room"
        if request.poisoned:
            return "simulated engine bug: this request fails on every engine"
        return None

    def holds_pushed_kv(self, request: GenerationRequest) -> bool:
        """Whether a plain request finds its prompt's KV pushed here by an LMCache prefiller."""
        if self.lmcache_receiver is None or request.kv_transfer_params is not None or request.bootstraps is not None:
            return False
        return any(self.lmcache_buffer.holds(prompt) for prompt in request.prompts)

    def classify(self, request: GenerationRequest) -> RequestKind:
        """Which path this request takes here, from its P/D fields and this engine's role."""
        protocol = self.protocol(request)
        if protocol == "lmcache":
            return self._classify_lmcache(request)
        if protocol == "sglang":
            return self._classify_sglang(request)
        params = request.kv_transfer_params or {}
        kind: RequestKind = "local"
        if params.get("do_remote_decode") is True:
            if not self.config.can_prefill_for_remote:
                raise InvalidRequest(
                    f"this engine's role is {self.config.role}: it does not prefill for a remote decoder "
                    "(kv_transfer_params.do_remote_decode)"
                )
            kind = "remote_prefill"
        elif params.get("do_remote_prefill") is True:
            if not self.config.can_decode_remote_kv:
                raise InvalidRequest(
                    f"this engine's role is {self.config.role}: it does not load remote KV "
                    "(kv_transfer_params.do_remote_prefill)"
                )
            kind = "kv_decode"
        if kind != "local" and len(request.prompts) != 1:
            raise InvalidRequest("kv_transfer_params apply to a single prompt")
        return kind

    def _classify_lmcache(self, request: GenerationRequest) -> RequestKind:
        if not self.config.can_prefill_for_remote:
            raise InvalidRequest(
                f"this engine's role is {self.config.role}: it does not prefill for a remote decoder "
                "(kv_transfer_params.disagg_spec)"
            )
        if len(request.prompts) != 1:
            raise InvalidRequest("kv_transfer_params apply to a single prompt")
        try:
            DisaggSpec.from_params(request.kv_transfer_params or {})
        except DisaggSpecError as exc:
            raise InvalidRequest(str(exc)) from None
        return "remote_prefill"

    def _classify_sglang(self, request: GenerationRequest) -> RequestKind:
        role = self.config.role
        if role == "decode":
            return "kv_decode"
        if role != "prefill":
            raise InvalidRequest("bootstrap fields are for a prefill or a decode engine, not one of role both")
        port = self.config.bootstrap_port
        if port is None:
            raise InvalidRequest("this prefill engine serves no bootstrap rooms (started without --bootstrap-port)")
        for bootstrap in request.bootstraps or ():
            if bootstrap.port != port:
                raise InvalidRequest(f"bootstrap_port {bootstrap.port} is not this engine's bootstrap port ({port})")
        return "remote_prefill"

    def kv_cache_usage(self) -> float:
        used = self.scheduler.context_tokens + self.leases.leased_tokens
        return min(used / self.config.kv_capacity_tokens, 1.0)

    def stats_snapshot(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return {
            "role": self.config.role,
            "engine_id": self.config.engine_id,
            **self.stats.counters(),
            "running": scheduler.running,
            "waiting": scheduler.waiting,
            "leases_active": self.leases.active,
            "leases_released": self.leases.released,
            "in_flight": self.in_flight,
            "prefill_steps": scheduler.prefill_steps,
            "decode_steps": scheduler.decode_steps,
            "stalling_prefill_steps": scheduler.stalling_prefill_steps,
            "fault": self.faults.describe(),
            "lmcache_buffer": {
                "entries": len(self.lmcache_buffer),
                "tokens": self.lmcache_buffer.tokens,
                "refused": self.lmcache_buffer.refused,
            },
            "recent": [record.as_dict() for record in self.stats.recent],
        }

    def _lease_expired(self, _lease: KvLease) -> None:
        self.metrics.nixl_num_kv_expired_reqs.inc()

    async def _reap_leases(self) -> None:
        interval = min(max(self.config.lease_seconds / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(interval)
            self.leases.reap()
