"""A simulated vLLM engine: the HTTP surface (vLLM's formats), its lifespan, and its command line."""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.routing import Route

from dpd_sim.completion_request import Api, InvalidRequest, load_object
from dpd_sim.config import ROLES, Role, SimConfig
from dpd_sim.core import EngineCore
from dpd_sim.faults import FAULT_MODES, FaultMode
from dpd_sim.gpu import TimingModel
from dpd_sim.kv_events import EVENT_FORMATS, EventFormat
from dpd_sim.messages import messages_endpoint
from dpd_sim.nixl import NOTIFY_PATH, TRANSFER_PATH
from dpd_sim.openai_format import error_body
from dpd_sim.responses import responses_endpoint
from dpd_sim.serving import CompletionsEndpoint
from dpd_sim.tokenizer_kit import ensure_tokenizer

__all__ = ["SimConfig", "build_arg_parser", "config_from_args", "create_app", "main"]


def create_app(config: SimConfig) -> FastAPI:
    """Build one engine. Its state lives in an EngineCore at `app.state.core`, started by the lifespan."""
    core = EngineCore(config)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await core.start()
        try:
            yield
        finally:
            await core.close()

    app = FastAPI(title=f"dpd-router sim engine ({config.role})", lifespan=lifespan, openapi_url=None)
    app.state.core = core

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if core.faults.failing_probes else 200)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": config.model,
            "object": "model",
            "created": started,
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
            "max_model_len": config.max_model_len,
            "permission": [],
        }
        # As vLLM lists a LoRA adapter: its path as root, the base model as parent, no max_model_len.
        adapters: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": started,
                "owned_by": "vllm",
                "root": path,
                "parent": config.model,
                "max_model_len": None,
                "permission": [],
            }
            for name, path in core.parser.adapters.items()
        ]
        return _json({"object": "list", "data": [card, *adapters]})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING): the adapter serves from now on."""
        try:
            body = load_object(await request.body())
        except InvalidRequest as exc:
            return _error(exc)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error(InvalidRequest("Both 'lora_name' and 'lora_path' must be provided."))
        if name in core.parser.adapters:
            return _error(InvalidRequest(f"The lora adapter '{name}' has already been loaded."))
        core.parser.adapters[name] = path
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        try:
            body = load_object(await request.body())
        except InvalidRequest as exc:
            return _error(exc)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in core.parser.adapters:
            missing = error_body(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
            return Response(missing, status_code=404, media_type="application/json")
        del core.parser.adapters[name]
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        core.stats.tokenize_requests += 1
        try:
            tokens, strs = core.parser.tokenize(await request.body())
        except InvalidRequest as exc:
            return _error(exc)
        return _json(
            {"count": len(tokens), "max_model_len": config.max_model_len, "tokens": tokens, "token_strs": strs}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            text = core.parser.detokenize(await request.body())
        except InvalidRequest as exc:
            return _error(exc)
        return _json({"prompt": text})

    @app.get("/load")
    async def load() -> Response:
        return _json({"server_load": core.in_flight})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(core.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/sim/stats")
    async def stats() -> Response:
        return _json(core.stats_snapshot())

    @app.post("/sim/fault")
    async def fault(request: Request) -> Response:
        try:
            body = load_object(await request.body())
        except InvalidRequest as exc:
            return _error(exc)
        mode, count = body.get("mode"), body.get("count")
        if mode not in FAULT_MODES:
            return _error(InvalidRequest(f"mode must be one of {', '.join(FAULT_MODES)}"))
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
            return _error(InvalidRequest("count must be a non-negative integer or null"))
        core.faults.set(cast(FaultMode, mode), count)
        return _json(core.faults.describe())

    async def reset_prefix_cache() -> Response:
        """Forget every cached block (the engine publishes AllBlocksCleared), as vLLM's dev endpoint does."""
        core.prefix_cache.clear()
        return Response(status_code=200)

    app.add_api_route("/sim/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])

    async def side_channel(
        request: Request, handle: Callable[[dict[str, Any]], Awaitable[tuple[int, Any]]]
    ) -> Response:
        """A NIXL side-channel call (a transfer or a notification): refused while dead, its body an object."""
        if core.faults.dead:
            return _json({"error": "the engine is dead"}, status_code=503)
        try:
            body = load_object(await request.body())
        except InvalidRequest as exc:
            return _json({"error": exc.message}, status_code=400)
        status, answer = await handle(body)
        return _json(answer, status_code=status)

    async def notified(body: dict[str, Any]) -> tuple[int, Any]:
        return core.side_channel.notified(body)

    @app.post(TRANSFER_PATH)
    async def nixl_transfer(request: Request) -> Response:
        return await side_channel(request, core.side_channel.transfer)

    @app.post(NOTIFY_PATH)
    async def nixl_notify(request: Request) -> Response:
        return await side_channel(request, notified)

    for path, api in (("/v1/completions", "text"), ("/v1/chat/completions", "chat")):
        app.router.routes.append(Route(path, CompletionsEndpoint(core, cast(Api, api)), methods=["POST"]))
    app.router.routes.append(Route("/v1/messages", messages_endpoint(core), methods=["POST"]))
    app.router.routes.append(Route("/v1/responses", responses_endpoint(core), methods=["POST"]))
    return app


def _json(payload: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status_code, media_type="application/json")


def _error(exc: InvalidRequest) -> Response:
    body = error_body(exc.message, exc.error_type, exc.status_code, exc.param)
    return Response(body, status_code=exc.status_code, media_type="application/json")


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dpd_sim",
        description="Run one simulated vLLM engine (NIXL, LMCache and SGLang P/D semantics).",
    )
    parser.add_argument("--role", choices=ROLES, default="both")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="sim-model")
    parser.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        type=_lora_module,
        metavar="NAME=PATH",
        help="LoRA adapters served from the start, as vLLM's --lora-modules",
    )
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: built-in)")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--lease-seconds", type=float, default=30.0, help="how long prefilled KV is held")
    parser.add_argument("--engine-id", default=None, help="NIXL engine id (default: a new uuid)")
    parser.add_argument("--side-channel-host", default=None, help="remote_host given to decoders")
    parser.add_argument("--seed", type=int, default=0, help="engine seed mixed into the output text")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument(
        "--prefix-cache-blocks", type=_positive, default=65536, help="blocks of 16 tokens in the prefix cache (LRU)"
    )
    parser.add_argument(
        "--kv-events-port", type=_port, default=None, help="publish vLLM KV events on a ZMQ PUB socket on this port"
    )
    parser.add_argument("--kv-events-topic", default="kv-events", help="the KV events' ZMQ topic frame")
    parser.add_argument(
        "--kv-events-format",
        choices=EVENT_FORMATS,
        default="map",
        help="map: events as current vLLM encodes them (tagged maps); array: as vLLM 0.23 and earlier (tagged arrays)",
    )
    parser.add_argument(
        "--kv-events-replay-port",
        type=_port,
        default=None,
        help="a ZMQ ROUTER socket replaying recent KV event batches",
    )
    parser.add_argument(
        "--lmcache-receiver-port",
        type=_port,
        action="append",
        default=[],
        help="LMCache PD: take pushed KV on a ZMQ REP socket on this port (repeat: one per decoder TP rank)",
    )
    parser.add_argument(
        "--lmcache-notify-url",
        default=None,
        help="LMCache PD: push ProxyNotif messages here (the router's PULL socket, tcp://host:port)",
    )
    parser.add_argument(
        "--lmcache-buffer-tokens",
        type=int,
        default=1_000_000,
        help="LMCache PD: prompt tokens the receive buffer holds (never evicted; a push that does not fit is refused)",
    )
    parser.add_argument(
        "--bootstrap-port", type=_port, default=None, help="SGLang PD: serve bootstrap rooms on this port (prefill)"
    )
    parser.add_argument(
        "--bootstrap-required",
        action="store_true",
        help="SGLang PD decode mode: abort a request without bootstrap fields with a 500, as SGLang does",
    )
    parser.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=30.0,
        help="seconds a decoder waits for its bootstrap room's KV, and a prefiller for its decoder",
    )
    parser.add_argument("--timing", choices=("default", "realistic"), default="default")
    for name in TimingModel.__dataclass_fields__:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=float, default=None, help=f"seconds; overrides the --timing preset's {name}")
    parser.add_argument("--log-level", default="warning")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError("must be NAME=PATH")
    return name, path


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be a port number (1-65535)")
    return value


def config_from_args(args: argparse.Namespace) -> SimConfig:
    timing = TimingModel.realistic() if args.timing == "realistic" else TimingModel()
    overrides = {
        name: getattr(args, name) for name in TimingModel.__dataclass_fields__ if getattr(args, name) is not None
    }
    config = SimConfig(
        role=cast(Role, args.role),
        host=args.host,
        port=args.port,
        model=args.model,
        lora_modules=tuple(args.lora_modules),
        tokenizer=ensure_tokenizer(args.tokenizer),
        max_model_len=args.max_model_len,
        timing=replace(timing, **overrides),
        lease_seconds=args.lease_seconds,
        seed=args.seed,
        max_batch_size=args.max_batch_size,
        side_channel_host=args.side_channel_host,
        prefix_cache_blocks=args.prefix_cache_blocks,
        kv_events_port=args.kv_events_port,
        kv_events_topic=args.kv_events_topic,
        kv_events_format=cast(EventFormat, args.kv_events_format),
        kv_events_replay_port=args.kv_events_replay_port,
        lmcache_receiver_ports=tuple(args.lmcache_receiver_port),
        lmcache_notify_url=args.lmcache_notify_url,
        lmcache_buffer_tokens=args.lmcache_buffer_tokens,
        bootstrap_port=args.bootstrap_port,
        bootstrap_required=args.bootstrap_required,
        bootstrap_timeout=args.bootstrap_timeout,
    )
    if args.engine_id:
        config = replace(config, engine_id=args.engine_id)
    return config


def main(argv: Sequence[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    config = config_from_args(args)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=2,
    )
