"""create_app(settings): the FastAPI app, and the Router object its lifespan builds and closes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from dpd_router import __version__
from dpd_router.api import openai, ops
from dpd_router.api.errors import error_response
from dpd_router.config import Settings
from dpd_router.gateway import ENGINE_PATHS, Gateway
from dpd_router.metrics import RouterMetrics
from dpd_router.observe import Observer
from dpd_router.pool.health import HealthChecker
from dpd_router.pool.models import ServedModel
from dpd_router.pool.pool import Pool
from dpd_router.pool.scrape import LoadScraper
from dpd_router.routing.kv_events import KVEventSubscriber
from dpd_router.routing.lmcache import LMCacheController
from dpd_router.routing.planner import Planner, build_planner
from dpd_router.tokenizer import EngineTokenizer, LocalTokenizer, TokenCounter
from dpd_router.transfer.base import Connector
from dpd_router.transfer.nixl import NixlConnector

log = logging.getLogger("dpd_router.app")


@dataclass
class Router:
    """Everything one router process holds, built at startup and passed to whoever needs it."""

    settings: Settings
    client: httpx.AsyncClient
    pool: Pool
    metrics: RouterMetrics
    model: ServedModel
    tokenizer: TokenCounter
    planner: Planner
    gateway: Gateway
    health: HealthChecker
    scraper: LoadScraper
    kv_events: KVEventSubscriber | None = None
    lmcache: LMCacheController | None = None
    _maintenance: asyncio.Task[None] | None = None
    _scraping: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, settings: Settings) -> Router:
        client = build_client(settings)
        pool = Pool(settings.prefill_urls, settings.decode_urls)
        metrics = RouterMetrics()
        for endpoint in pool.endpoints():
            metrics.watch_endpoint(endpoint)
        metrics.routing_threshold.set(settings.routing_threshold)
        model = ServedModel(settings.model)
        tokenizer = await load_tokenizer(settings, client, pool, model)
        kv_events = KVEventSubscriber.from_settings(settings, pool, metrics)
        lmcache = LMCacheController.from_settings(settings, client, metrics)
        planner = build_planner(
            settings, pool, metrics, kv_sources=[kv_events.index] if kv_events else [], kv_lookup=lmcache
        )
        scraper = LoadScraper(
            pool, client, metrics, interval=settings.load_scrape_interval, timeout=settings.health_timeout
        )
        gateway = Gateway(
            client=client,
            tokenizer=tokenizer,
            planner=planner,
            connector=build_connector(settings, client),
            observer=Observer(metrics),
            metrics=metrics,
            stream_timeout=httpx.Timeout(
                settings.connect_timeout,
                read=max(settings.first_token_timeout, settings.idle_timeout),
                connect=settings.connect_timeout,
            ),
            body_timeout=httpx.Timeout(settings.connect_timeout, read=settings.request_timeout),
        )
        health = HealthChecker(pool, client, metrics, timeout=settings.health_timeout)
        router = cls(
            settings, client, pool, metrics, model, tokenizer, planner, gateway, health, scraper, kv_events, lmcache
        )
        await router.maintain_once()
        router._maintenance = asyncio.create_task(router._maintain(), name="router-maintenance")
        router._scraping = asyncio.create_task(scraper.run(), name="load-scraper")
        if kv_events is not None:
            kv_events.start()
        log.info(
            "dpd-router %s serving %s with %d prefillers and %d decoders, threshold %d tokens, strategy %s",
            __version__,
            model.name or "(model not yet known)",
            len(pool.prefillers),
            len(pool.decoders),
            settings.routing_threshold,
            settings.prefill_strategy,
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
        for task in (self._maintenance, self._scraping):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.kv_events is not None:
            await self.kv_events.close()
        self.tokenizer.close()
        await self.client.aclose()


def build_client(settings: Settings) -> httpx.AsyncClient:
    """The one HTTP client of the process: keep-alive pools sized for thousands of streams."""
    return httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_keepalive_connections,
            keepalive_expiry=30.0,
        ),
        timeout=httpx.Timeout(settings.request_timeout, connect=settings.connect_timeout),
        trust_env=False,
    )


def build_connector(settings: Settings, client: httpx.AsyncClient) -> Connector:
    if settings.kv_connector == "nixl":
        timeout = httpx.Timeout(settings.prefill_timeout, connect=settings.connect_timeout)
        return NixlConnector(client, timeout=timeout, path_for=ENGINE_PATHS)
    raise ValueError(f"unknown kv_connector {settings.kv_connector!r}")


async def load_tokenizer(settings: Settings, client: httpx.AsyncClient, pool: Pool, model: ServedModel) -> TokenCounter:
    if settings.tokenizer is None:
        log.warning("no tokenizer directory configured: counting tokens with the engines' /tokenize")
        return EngineTokenizer(client, urls=lambda: [e.url for e in pool.healthy("decode")], model=lambda: model.name)
    directory = settings.tokenizer
    return await asyncio.to_thread(
        LocalTokenizer.load,
        directory,
        inline_max_chars=settings.tokenize_inline_max_chars,
        threads=settings.tokenizer_threads,
    )


def create_app(settings: Settings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = await Router.start(settings)
        app.state.router = router
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="dpd-router", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(openai.routes)
    app.include_router(ops.routes)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return error_response(str(exc.detail), error_type, exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error serving %s", request.url.path)
        return error_response("The router failed to serve this request.", "InternalServerError", 500)

    return app
