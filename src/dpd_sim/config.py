"""Settings of one simulated engine."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dpd_sim.gpu import TimingModel
from dpd_sim.kv_events import EventFormat

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")


@dataclass(frozen=True)
class SimConfig:
    """Everything an engine needs at startup; `port` is also the NIXL side-channel port."""

    role: Role
    port: int
    tokenizer: Path
    host: str = "127.0.0.1"
    model: str = "sim-model"
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters served from the start, as vLLM's `--lora-modules name=path`: (name, path) pairs."""
    max_model_len: int = 32768
    timing: TimingModel = field(default_factory=TimingModel)
    lease_seconds: float = 30.0
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    seed: int = 0
    max_batch_size: int = 256
    kv_capacity_tokens: int = 500_000
    """KV cache size used for `vllm:kv_cache_usage_perc` (about an H100 with an 8B model)."""
    side_channel_host: str | None = None
    """The host decoders reach this engine's KV at (`remote_host`); defaults to `host`."""
    prefix_cache_blocks: int = 65536
    """Blocks of 16 tokens the prefix cache holds before it evicts the least recently used."""
    kv_events_port: int | None = None
    """Publish vLLM KV events on a ZMQ PUB socket bound to tcp://<host>:<port> (None: off)."""
    kv_events_topic: str = "kv-events"
    kv_events_format: EventFormat = "map"
    """`map`: events as current vLLM encodes them (tagged maps); `array`: as vLLM 0.23 and earlier (tagged arrays)."""
    kv_events_replay_port: int | None = None
    """A ZMQ ROUTER socket replaying recent batches from a requested sequence number (None: off)."""
    lmcache_receiver_ports: tuple[int, ...] = ()
    """LMCache PD receiver: a ZMQ REP socket per decoder TP rank taking pushed KV (empty: off)."""
    lmcache_notify_url: str | None = None
    """Where a prefiller's workers push LMCache ProxyNotif messages (the router's PULL socket)."""
    lmcache_buffer_tokens: int = 1_000_000
    """Prompt tokens the LMCache receive buffer holds; it never evicts, a push that does not fit is refused."""
    bootstrap_port: int | None = None
    """SGLang bootstrap server of a prefill engine (None: off)."""
    bootstrap_required: bool = False
    """An SGLang decode-mode server: a request without bootstrap fields is aborted with a 500."""
    bootstrap_timeout: float = 30.0
    """How long a decoder waits for its bootstrap room's KV, and a prefiller for its decoder."""

    @property
    def advertised_host(self) -> str:
        if self.side_channel_host:
            return self.side_channel_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def can_prefill_for_remote(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def can_decode_remote_kv(self) -> bool:
        return self.role in ("decode", "both")
