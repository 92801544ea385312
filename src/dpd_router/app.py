"""create_app(settings): the FastAPI app, and the Router object its lifespan builds and closes."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from dpd_router import __version__
from dpd_router.api import admin, console, openai, ops
from dpd_router.api.admission import Admissions
from dpd_router.api.auth import Gatekeeper, KeyRing
from dpd_router.api.errors import error_response
from dpd_router.api.guards import ErrorBoundary
from dpd_router.config import Settings
from dpd_router.gateway import Gateway, PhaseTimeouts, RetryPolicy
from dpd_router.live import LiveConfig
from dpd_router.metrics import RouterMetrics
from dpd_router.observe import Observer
from dpd_router.pool.breaker import BreakerPolicy
from dpd_router.pool.discovery import Discovery
from dpd_router.pool.health import HealthChecker
from dpd_router.pool.pool import Pool
from dpd_router.pool.scrape import LoadScraper
from dpd_router.pool.served_model import ServedModel
from dpd_router.routing.adaptive import AdaptiveModel
from dpd_router.routing.kv_sources.lmcache_controller import LMCacheController
from dpd_router.routing.kv_sources.vllm_events import KVEventSubscriber
from dpd_router.routing.planner import Planner, adaptive_policy, build_planner
from dpd_router.server import REASONS as REFUSAL_REASONS
from dpd_router.server import ListenerLimits, RefusedConnections, guarded_protocol
from dpd_router.tasks import cancel_and_wait
from dpd_router.template_sandbox import TemplateSandbox
from dpd_router.tokenizer import EngineTokenizer, LocalTokenizer, TokenCounter
from dpd_router.tracing import SpanExporter
from dpd_router.transfer.base import ENGINE_PATHS, Connector
from dpd_router.transfer.lmcache.connector import LMCacheConnector
from dpd_router.transfer.lmcache.notify import ProxyNotifications
from dpd_router.transfer.lmcache.receivers import Receiver, ReceiverMap
from dpd_router.transfer.nixl import NixlConnector
from dpd_router.transfer.sglang import SGLangConnector
from dpd_router.transfer.shared_storage import SharedStorageConnector
from dpd_router.transport import AiohttpTransport

log = logging.getLogger("dpd_router.app")


@dataclass
class Router:
    """Everything one router process holds, built at startup and passed to whoever needs it."""

    settings: Settings
    client: httpx.AsyncClient
    pool: Pool
    metrics: RouterMetrics
    model: ServedModel
    # One a pool (None: the shared pool's); the same local tokenizer for all when one is configured.
    tokenizers: dict[str | None, TokenCounter]
    planner: Planner
    gateway: Gateway
    observer: Observer
    health: HealthChecker
    scraper: LoadScraper
    gatekeeper: Gatekeeper
    admission: Admissions
    live: LiveConfig = field(init=False)
    kv_events: KVEventSubscriber | None = None
    lmcache: LMCacheController | None = None
    connector: Connector | None = None
    discovery: Discovery | None = None
    _maintenance: asyncio.Task[None] | None = None
    _scraping: asyncio.Task[None] | None = None
    _publishing: asyncio.Task[None] | None = None  # a worker's metrics copied to the shared files

    @classmethod
    async def start(cls, settings: Settings) -> Router:
        client = build_client(settings)
        # First, before anything else runs: a notification address that cannot be bound stops the
        # router here, with nothing else to close.
        connector = build_connector(settings, client)
        try:
            await connector.start()
        except BaseException:
            await client.aclose()
            raise
        try:
            return await cls._build(settings, client, connector)
        except BaseException:
            await connector.close()
            await client.aclose()
            raise

    @classmethod
    async def _build(cls, settings: Settings, client: httpx.AsyncClient, connector: Connector) -> Router:
        warn_about_connector(settings)
        breaker = BreakerPolicy(settings.breaker_failures, settings.breaker_cooldown, settings.breaker_max_cooldown)
        pool = Pool(settings.prefill_urls, settings.decode_urls, breaker=breaker)
        tenant_pools = {
            tenant: Pool(pools.prefill_urls, pools.decode_urls, breaker=breaker, name=tenant)
            for tenant, pools in settings.tenants.items()
        }
        every_engine = Pool.union([pool, *tenant_pools.values()])
        metrics = RouterMetrics(multiprocess=settings.workers > 1)
        for endpoint in every_engine.endpoints():
            metrics.watch_endpoint(endpoint)
        discovery = await start_discovery(settings, pool, tenant_pools.values(), metrics)
        metrics.routing_threshold.set(settings.routing_threshold)
        model = ServedModel(settings.model)
        pools_by_tenant: dict[str | None, Pool] = {None: pool}
        pools_by_tenant.update(tenant_pools.items())
        tokenizers = await load_tokenizers(settings, client, pools_by_tenant, model)
        kv_events = KVEventSubscriber.from_settings(settings, every_engine, metrics)
        lmcache = LMCacheController.from_settings(settings, client, metrics)
        kv_sources = [kv_events.index] if kv_events else []
        adaptive = AdaptiveModel(adaptive_policy(settings), settings.routing_threshold)
        planners: dict[str | None, Planner] = {
            tenant: build_planner(
                settings,
                engines,
                metrics,
                kv_sources=kv_sources,
                kv_lookup=lmcache,
                adaptive=adaptive,
                batches=connector.batches,
                serves_direct=connector.serves_direct,
            )
            for tenant, engines in [(None, pool), *tenant_pools.items()]
        }
        planner = planners[None]
        metrics.watch_adaptive(
            lambda: [
                (entry["decoder"], math.inf if entry["threshold_tokens"] is None else entry["threshold_tokens"])
                for entry in planner.adaptive_view()
            ],
            adaptive.cost_rows,
        )
        scraper = LoadScraper(
            every_engine, client, metrics, interval=settings.load_scrape_interval, timeout=settings.health_timeout
        )
        keys = KeyRing.load(
            keys_file=settings.api_keys_file,
            key_hashes=settings.api_key_hashes,
            admin_key_hashes=settings.admin_key_hashes,
            workers=settings.workers,
        )
        unknown_tenants = keys.tenants() - set(tenant_pools)
        if unknown_tenants:
            log.info("tenants %s have no reserved engines: they share the main pool", sorted(unknown_tenants))
        observer = Observer(
            metrics, SpanExporter.create() if settings.otel_tracing else None, listeners=[adaptive.learn_from]
        )
        gateway = Gateway(
            client=client,
            tokenizers=tokenizers,
            planners=planners,
            connector=connector,
            observer=observer,
            metrics=metrics,
            model=model,
            timeouts=PhaseTimeouts.from_settings(settings),
            retries=RetryPolicy.from_settings(settings),
        )
        health = HealthChecker(
            every_engine,
            client,
            metrics,
            timeout=settings.health_timeout,
            unhealthy_after=settings.health_unhealthy_threshold,
            healthy_after=settings.health_healthy_threshold,
        )
        admission = Admissions(metrics, settings)
        router = cls(
            settings=settings,
            client=client,
            pool=every_engine,
            metrics=metrics,
            model=model,
            tokenizers=tokenizers,
            planner=planner,
            gateway=gateway,
            observer=observer,
            health=health,
            scraper=scraper,
            gatekeeper=Gatekeeper(
                keys, metrics, failures_per_minute=settings.auth_failures_per_minute / settings.workers
            ),
            admission=admission,
            kv_events=kv_events,
            lmcache=lmcache,
            discovery=discovery,
            connector=connector,
        )
        router.live = LiveConfig(router)
        router.live.start()
        await router.maintain_once()
        router._maintenance = asyncio.create_task(router._maintain(), name="router-maintenance")
        router._scraping = asyncio.create_task(scraper.run(), name="load-scraper")
        if metrics.multiprocess:
            router._publishing = asyncio.create_task(metrics.publish_every(), name="metrics-publisher")
        if kv_events is not None:
            kv_events.start()
        log.info(
            "dpd-router %s serving %s with %d prefillers and %d decoders (%d tenant pools), threshold %d tokens, "
            "strategy %s, api keys %s",
            __version__,
            model.name or "(model not yet known)",
            len(pool.prefillers),
            len(pool.decoders),
            len(tenant_pools),
            settings.routing_threshold,
            settings.prefill_strategy,
            "on" if keys.enabled else "off",
        )
        return router

    async def maintain_once(self) -> None:
        await self.health.probe_all()
        if self.model.listing is None:
            await self.model.discover(self.client, self.pool, probe_timeout=self.settings.health_timeout)
        if self.lmcache is not None:
            await self.lmcache.learn_instances(self.pool.endpoints())

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            try:
                await self.maintain_once()
            except Exception:
                log.exception("health round failed")

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
        await self.live.close()
        await cancel_and_wait(
            task for task in (self._maintenance, self._scraping, self._publishing) if task is not None
        )
        if self.kv_events is not None:
            await self.kv_events.close()
        await self.gateway.close()
        if self.connector is not None:
            await self.connector.close()
        for tokenizer in {id(tokenizer): tokenizer for tokenizer in self.tokenizers.values()}.values():
            await tokenizer.aclose()
        await self.client.aclose()


async def start_discovery(
    settings: Settings, pool: Pool, tenant_pools: Iterable[Pool], metrics: RouterMetrics
) -> Discovery | None:
    """With `discovery: kubernetes`, watch the shared pool's engine pods (tenants' pools stay static)."""
    if settings.discovery != "kubernetes":
        return None
    reserved = {endpoint.url for tenant_pool in tenant_pools for endpoint in tenant_pool.endpoints()}
    discovery = Discovery.from_settings(settings, pool, metrics, reserved=reserved)
    await discovery.start()
    log.info(
        "discovering %s engines in Kubernetes: %d prefillers and %d decoders ready",
        " and ".join(discovery.roles),
        len(pool.healthy("prefill")),
        len(pool.healthy("decode")),
    )
    return discovery


def build_client(settings: Settings) -> httpx.AsyncClient:
    """The one HTTP client of the process: keep-alive pools sized for thousands of streams."""
    limits = httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_keepalive_connections,
        keepalive_expiry=settings.keepalive_expiry,
    )
    return httpx.AsyncClient(
        transport=AiohttpTransport(limits) if settings.upstream_transport == "aiohttp" else None,
        limits=limits,
        timeout=httpx.Timeout(settings.request_timeout, connect=settings.connect_timeout),
        headers=engine_headers(settings),
        trust_env=False,
    )


def engine_headers(settings: Settings) -> dict[str, str]:
    """Headers every engine call carries: the engines' own credentials, never a client's."""
    if settings.engine_api_key is None:
        return {}
    return {"Authorization": f"Bearer {settings.engine_api_key.get_secret_value()}"}


def build_connector(settings: Settings, client: httpx.AsyncClient) -> Connector:
    timeout = httpx.Timeout(settings.prefill_timeout, connect=settings.connect_timeout)
    if settings.kv_connector == "nixl":
        return NixlConnector(client, timeout=timeout, path_for=ENGINE_PATHS)
    if settings.kv_connector == "shared_storage":
        return SharedStorageConnector(client, timeout=timeout, path_for=ENGINE_PATHS)
    if settings.kv_connector == "lmcache":
        receivers = {
            url: Receiver(
                receiver.host or urlsplit(url).hostname or "127.0.0.1",
                tuple(receiver.init_ports),
                tuple(receiver.alloc_ports),
            )
            for url, receiver in settings.lmcache_receivers.items()
        }
        return LMCacheConnector(
            client,
            timeout=timeout,
            receivers=ReceiverMap(
                settings.lmcache_receiver_init_ports, settings.lmcache_receiver_alloc_ports, receivers
            ),
            notifications=ProxyNotifications(settings.lmcache_notify_address),
            notify_timeout=settings.lmcache_notify_timeout,
            notify_count=settings.lmcache_notify_count,
            local_tokenizer=settings.tokenizer is not None,
        )
    if settings.kv_connector == "sglang":
        return SGLangConnector(
            client,
            timeout=timeout,
            path_for=ENGINE_PATHS,
            bootstrap_port=settings.sglang_bootstrap_port,
            bootstrap_ports=settings.sglang_bootstrap_ports,
        )
    raise ValueError(f"unknown kv_connector {settings.kv_connector!r}")


def warn_about_connector(settings: Settings) -> None:
    """Log what the connector's settings make likely to fail: a notification address on the loopback
    interface that prefillers on other hosts cannot reach."""
    if settings.kv_connector != "lmcache":
        return
    host = urlsplit(settings.lmcache_notify_address.replace("*", "0.0.0.0", 1)).hostname or ""
    if not _is_loopback(host):
        return
    prefillers = _engine_urls(settings, "prefill")
    remote = sorted({url for url in prefillers if not _is_loopback(urlsplit(url).hostname or "")})
    if remote:
        log.warning(
            "lmcache_notify_address %s listens on the loopback interface, but prefillers %s are on other "
            "hosts: their ProxyNotif messages cannot reach it, and every LMCache hand-off will fail. Bind "
            "an address they can reach (for example tcp://0.0.0.0:8500) and name it in their pd_proxy_host.",
            settings.lmcache_notify_address,
            remote,
        )


def _engine_urls(settings: Settings, role: str) -> list[str]:
    urls = list(settings.prefill_urls if role == "prefill" else settings.decode_urls)
    for pools in settings.tenants.values():
        urls.extend(pools.prefill_urls if role == "prefill" else pools.decode_urls)
    return urls


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def load_tokenizers(
    settings: Settings, client: httpx.AsyncClient, pools: Mapping[str | None, Pool], model: ServedModel
) -> dict[str | None, TokenCounter]:
    """The token counter of each pool: the local tokenizer for all, or each pool's own decoders'
    /tokenize, so no prompt of a tenant's reaches an engine not reserved for it."""
    if settings.tokenizer is None:
        log.warning("no tokenizer directory configured: counting tokens with the engines' /tokenize")
        return {tenant: engine_tokenizer(client, pool, model) for tenant, pool in pools.items()}
    sandbox = (
        TemplateSandbox(
            settings.tokenizer, timeout=settings.chat_template_timeout, max_output_chars=settings.max_body_bytes
        )
        if settings.trust_request_chat_template
        else None
    )
    if sandbox is not None:
        await sandbox.start()
    local = await asyncio.to_thread(
        LocalTokenizer.load,
        settings.tokenizer,
        inline_max_chars=settings.tokenize_inline_max_chars,
        threads=settings.tokenizer_threads,
        sandbox=sandbox,
    )
    return {tenant: local for tenant in pools}


def engine_tokenizer(client: httpx.AsyncClient, pool: Pool, model: ServedModel) -> EngineTokenizer:
    return EngineTokenizer(client, urls=lambda: [e.url for e in pool.healthy("decode")], model=lambda: model.name)


def create_app(settings: Settings, *, refused_connections: RefusedConnections | None = None) -> FastAPI:
    """The router's app; `refused_connections` is the listener's count of connections it closed
    (server.build_server passes it), exported with the other metrics."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = await Router.start(settings)
        if refused_connections is not None:
            router.metrics.watch_refused_connections(refused_connections.counts, REFUSAL_REASONS)
        app.state.router = router
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="dpd-router", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    # A redirect to the path with or without its trailing slash would be built from the client's Host header.
    app.router.redirect_slashes = False
    app.include_router(openai.routes)
    app.include_router(ops.routes)
    app.include_router(admin.routes)
    app.include_router(console.routes)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return error_response(str(exc.detail), error_type, exc.status_code)

    app.add_middleware(ErrorBoundary)
    return app


def build_server(settings: Settings, *, loop: str = "uvloop", **config: Any) -> uvicorn.Server:
    """The router's app behind the guarded listener (server.py), as `dpd-router serve` runs it."""
    refused = RefusedConnections()
    return uvicorn.Server(
        uvicorn.Config(
            create_app(settings, refused_connections=refused),
            host=settings.host,
            port=settings.port,
            loop=loop,
            http=guarded_protocol(ListenerLimits.from_settings(settings), refused),
            log_level="warning",
            access_log=False,
            timeout_keep_alive=settings.client_keepalive_timeout,
            **config,
        )
    )
