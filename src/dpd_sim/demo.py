"""The engines of `dpd-router demo`: simulated ones wired for a KV connector, or a real vLLM pair on this CPU.

The router's command line starts them through `demo_engines`, then runs the router in front of them with
the settings they ask for. Those are given as the router's setting names in a plain dict, so that this
package imports nothing of the router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from dpd_sim.cluster import HOST, SimCluster
from dpd_sim.ports import free_ports

EngineKind = Literal["sim", "vllm"]
SIM_MODEL = "sim-model"


class DemoUnavailable(RuntimeError):
    """The engines asked for cannot run here; the message says why, for the command line."""


class Engines(Protocol):
    """What the demo needs of a set of engines: their URLs, and a start and a stop."""

    @property
    def prefill_urls(self) -> list[str]: ...

    @property
    def decode_urls(self) -> list[str]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class DemoEngines:
    """Engines not yet started, the model they serve, and what the router needs to speak their KV connector."""

    engines: Engines
    model: str
    # Printed before the (possibly long) start.
    announcement: str
    # Settings beyond the engine URLs; called once the engines are up, as some name an engine by its URL.
    router_settings: Callable[[], dict[str, Any]] = field(default=lambda: {})


@dataclass
class SimWiring:
    """What simulated engines and the router need to speak a KV connector's protocol to each other."""

    extra_args: list[str] = field(default_factory=list)
    engine_args: dict[str, list[str]] = field(default_factory=dict)
    settings: Callable[[SimCluster], dict[str, Any]] = lambda _cluster: {}


def sim_wiring(kv_connector: str, prefillers: int, decoders: int) -> SimWiring:
    """LMCache: a receiver port per decoder and the router's notification port; SGLang: a bootstrap
    port per prefiller, and decoders in decode mode. NIXL and shared storage need nothing."""
    if kv_connector == "lmcache":
        notify, *ports = free_ports(1 + 2 * decoders)
        receivers = {f"decode-{i}": (ports[2 * i], ports[2 * i + 1]) for i in range(decoders)}
        return SimWiring(
            extra_args=["--lmcache-notify-url", f"tcp://{HOST}:{notify}"],
            engine_args={name: ["--lmcache-receiver-port", str(init)] for name, (init, _) in receivers.items()},
            settings=lambda cluster: {
                "lmcache_notify_address": f"tcp://{HOST}:{notify}",
                "lmcache_receivers": {
                    cluster.engine(name).url: {"init_ports": [init], "alloc_ports": [alloc]}
                    for name, (init, alloc) in receivers.items()
                },
            },
        )
    if kv_connector == "sglang":
        bootstrap = dict(zip((f"prefill-{i}" for i in range(prefillers)), free_ports(prefillers), strict=True))
        # Decode-mode servers, as SGLang's: a request without a bootstrap room is refused.
        decode_mode = {f"decode-{i}": ["--bootstrap-required"] for i in range(decoders)}
        return SimWiring(
            engine_args={**decode_mode, **{name: ["--bootstrap-port", str(port)] for name, port in bootstrap.items()}},
            settings=lambda cluster: {
                "sglang_bootstrap_ports": {cluster.engine(name).url: port for name, port in bootstrap.items()}
            },
        )
    return SimWiring()


async def demo_engines(
    kind: EngineKind, *, kv_connector: str | None, prefillers: int, decoders: int, tokenizer: Path
) -> DemoEngines:
    """The demo's engines, ready to start. Raises DemoUnavailable when real engines cannot run here."""
    if kind == "vllm":
        return await _vllm_pair(kv_connector, tokenizer)
    wiring = sim_wiring(kv_connector or "nixl", prefillers, decoders)
    cluster = SimCluster(
        prefill=prefillers,
        decode=decoders,
        tokenizer=tokenizer,
        model=SIM_MODEL,
        extra_args=wiring.extra_args,
        engine_args=wiring.engine_args,
    )
    return DemoEngines(
        engines=cluster,
        model=SIM_MODEL,
        announcement=f"starting {prefillers} prefill and {decoders} decode simulated engines ...",
        router_settings=lambda: wiring.settings(cluster),
    )


async def _vllm_pair(kv_connector: str | None, tokenizer: Path) -> DemoEngines:
    # Imported here: the real engines' launcher is needed only when asked for.
    from dpd_sim import vllm_cpu

    if kv_connector not in (None, "nixl"):
        raise DemoUnavailable("the real-engine demo speaks NIXL only")
    try:
        await asyncio.to_thread(vllm_cpu.ensure_env)
        vllm_cpu.check_memory()
    except vllm_cpu.EnvironmentUnavailable as exc:
        raise DemoUnavailable(f"the real engines cannot run here: {exc}") from exc
    pair = vllm_cpu.VllmPair("nixl", tokenizer_dir=tokenizer)
    return DemoEngines(
        engines=pair,
        model=pair.model_name,
        announcement=f"starting a real vLLM prefill and decode engine (about 70 s; logs in {pair.log_dir}) ...",
    )
