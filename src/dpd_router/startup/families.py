"""The router's components by family, each built by one short function from the settings.

Every function builds what it returns and starts nothing that needs closing, except `build_engines`,
which starts Kubernetes discovery when configured (closed by `Components.close`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from dpd_router.api.admission import Admissions
from dpd_router.api.auth import ClientAddresses, Gatekeeper, KeyRing
from dpd_router.api.console import ConsoleHistory
from dpd_router.config import Settings
from dpd_router.gateway import Gateway, PhaseTimeouts, RetryPolicy
from dpd_router.gateway.models import Models
from dpd_router.pool.adapters import AdapterLoader
from dpd_router.pool.breaker import BreakerPolicy
from dpd_router.pool.discovery import Discovery, EngineOwners
from dpd_router.pool.health import HealthChecker
from dpd_router.pool.pool import Pool
from dpd_router.pool.scrape import LoadScraper
from dpd_router.pool.served_model import ServedModel
from dpd_router.pool.transport import AiohttpTransport, EngineCalls
from dpd_router.prompt.tokenizer import TokenCounter
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Observer
from dpd_router.record.outcome import Outcome
from dpd_router.record.tracing import SpanExporter
from dpd_router.responses.history import ResponsesHistory, default_store_path
from dpd_router.responses.store import open_store
from dpd_router.routing.adapters import AdapterPlanners
from dpd_router.routing.adaptive import AdaptiveModel
from dpd_router.routing.experiments import ExperimentArms
from dpd_router.routing.kv_sources.lmcache_controller import LMCacheController
from dpd_router.routing.kv_sources.vllm_events import KVEventSubscriber
from dpd_router.routing.planner import Planner, adaptive_policy, build_planner
from dpd_router.shadow import LiveShadow
from dpd_router.startup.allocator import MemoryReturn
from dpd_router.startup.upkeep import Upkeep
from dpd_router.transfer.base import Connector

if TYPE_CHECKING:
    from dpd_router.api.redis_limits import RedisBuckets

log = logging.getLogger("dpd_router.app")


@dataclass(frozen=True)
class Engines:
    """The shared pool, the tenants' reserved pools, and all of them as one (what health and load watch)."""

    shared: Pool
    tenants: Mapping[str, Pool]
    every: Pool
    discovery: Discovery | None = None

    @property
    def by_tenant(self) -> dict[str | None, Pool]:
        """Each pool under its tenant; None: the shared pool."""
        pools: dict[str | None, Pool] = {None: self.shared}
        pools.update(self.tenants.items())
        return pools


@dataclass(frozen=True)
class Routing:
    """A planner a pool (None: the shared pool's), the adaptive model they share, and the KV indexes they read."""

    planners: Mapping[str | None, Planner]
    adaptive: AdaptiveModel
    # The LoRA adapters' planners over those pools, made on each adapter's first request.
    adapters: AdapterPlanners
    kv_events: KVEventSubscriber | None = None
    lmcache: LMCacheController | None = None
    # A/B arms over the shared pool's planner; also what routes each finished request to its arm's learner.
    experiments: ExperimentArms | None = None

    @property
    def planner(self) -> Planner:
        """The shared pool's planner (what the admin and console views describe)."""
        return self.planners[None]


@dataclass(frozen=True)
class Access:
    """Who may call (API keys, throttling failed attempts) and how many at once (admission)."""

    gatekeeper: Gatekeeper
    admission: Admissions
    limits_store: RedisBuckets | None = None


@dataclass(frozen=True)
class Serving:
    """What serves the requests of every model: each model's gateway (`models`), the observer that records
    what each request did, and the shadow in force (which gets copies of some requests, when one is configured)."""

    models: Models
    observer: Observer
    shadow: LiveShadow
    # The Responses API's stored responses and the conversations continued from them.
    responses: ResponsesHistory


def build_transport(settings: Settings) -> httpx.AsyncBaseTransport:
    """The process's one connection pool to the engines: keep-alive pools sized for thousands of streams."""
    limits = httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=settings.max_keepalive_connections,
        keepalive_expiry=settings.keepalive_expiry,
    )
    if settings.upstream_transport == "aiohttp":
        return AiohttpTransport(limits)
    return httpx.AsyncHTTPTransport(limits=limits, trust_env=False)


def build_client(settings: Settings, transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    """The client for the engine calls off the request path (health, load, tokenize, metrics scrapes)."""
    return httpx.AsyncClient(
        transport=transport,
        timeout=httpx.Timeout(settings.request_timeout, connect=settings.connect_timeout),
        headers=engine_headers(settings),
        trust_env=False,
    )


def engine_headers(settings: Settings) -> dict[str, str]:
    """Headers every engine call carries: the engines' own credentials, never a client's."""
    if settings.engine_api_key is None:
        return {}
    return {"Authorization": f"Bearer {settings.engine_api_key.get_secret_value()}"}


async def build_engines(
    settings: Settings, metrics: RouterMetrics, *, pool_name: str = "shared", owners: EngineOwners | None = None
) -> Engines:
    """A model's pools: the one its requests share (`pool_name`: a model of several is named after itself) and
    its tenants' reserved ones; `owners`, which model each discovered engine serves, shared by every model."""
    breaker = BreakerPolicy(settings.breaker_failures, settings.breaker_cooldown, settings.breaker_max_cooldown)
    shared = Pool(settings.prefill_urls, settings.decode_urls, breaker=breaker, name=pool_name)
    tenants = {
        tenant: Pool(pools.prefill_urls, pools.decode_urls, breaker=breaker, name=tenant)
        for tenant, pools in settings.tenants.items()
    }
    every = Pool.union([shared, *tenants.values()])
    for endpoint in every.endpoints():
        metrics.watch_endpoint(endpoint)
    discovery = await start_discovery(settings, shared, tenants.values(), metrics, owners)
    return Engines(shared, tenants, every, discovery)


async def start_discovery(
    settings: Settings,
    pool: Pool,
    tenant_pools: Iterable[Pool],
    metrics: RouterMetrics,
    owners: EngineOwners | None = None,
) -> Discovery | None:
    """With `discovery: kubernetes`, watch the shared pool's engine pods (tenants' pools stay static)."""
    if settings.discovery != "kubernetes":
        return None
    reserved = {endpoint.url for tenant_pool in tenant_pools for endpoint in tenant_pool.endpoints()}
    discovery = Discovery.from_settings(settings, pool, metrics, reserved=reserved, owners=owners)
    await discovery.start()
    log.info(
        "discovering %s engines of %s in Kubernetes: %d prefillers and %d decoders ready",
        " and ".join(discovery.roles),
        settings.model or "the model",
        len(pool.healthy("prefill")),
        len(pool.healthy("decode")),
    )
    return discovery


def build_routing(
    settings: Settings, engines: Engines, metrics: RouterMetrics, client: httpx.AsyncClient, connector: Connector
) -> Routing:
    kv_events = KVEventSubscriber.from_settings(settings, engines.every, metrics)
    lmcache = LMCacheController.from_settings(settings, client, metrics)
    adaptive = AdaptiveModel(adaptive_policy(settings), settings.routing_threshold)
    planners = {
        tenant: build_planner(
            settings,
            pool,
            metrics,
            kv_sources=[kv_events.index] if kv_events else [],
            kv_lookup=lmcache,
            adaptive=adaptive,
            batches=connector.batches,
            serves_direct=connector.serves_direct,
        )
        for tenant, pool in engines.by_tenant.items()
    }
    shared = planners[None]
    experiments = ExperimentArms(settings, shared, adaptive)
    return Routing(planners, adaptive, AdapterPlanners(settings), kv_events, lmcache, experiments)


def build_access(settings: Settings, engines: Engines, metrics: RouterMetrics) -> Access:
    # Connects lazily, on the first check: a store down at startup only means local limits for now.
    store = None
    if settings.limits_store:
        # The Redis client (and the telemetry it imports) is a large part of a start-up without it.
        from dpd_router.api.redis_limits import RedisBuckets

        store = RedisBuckets(settings.limits_store, metrics)
    keys = KeyRing.load(
        keys_file=settings.api_keys_file,
        key_hashes=settings.api_key_hashes,
        admin_key_hashes=settings.admin_key_hashes,
        workers=settings.workers,
        store=store,
    )
    unknown_tenants = keys.tenants() - set(engines.tenants)
    if unknown_tenants:
        log.info("tenants %s have no reserved engines: they share the main pool", sorted(unknown_tenants))
    return Access(
        # Each worker process throttles its share of the failures (supervisor.py).
        Gatekeeper(
            keys,
            metrics,
            failures_per_minute=settings.auth_failures_per_minute / settings.workers,
            addresses=ClientAddresses(settings.trusted_proxies),
        ),
        Admissions(metrics, settings),
        store,
    )


def build_gateway(
    settings: Settings,
    *,
    engine_calls: EngineCalls,
    connector: Connector,
    metrics: RouterMetrics,
    model: ServedModel,
    tokenizers: Mapping[str | None, TokenCounter],
    routing: Routing,
    observer: Observer,
    shadow: LiveShadow,
    adapter_loader: AdapterLoader | None = None,
) -> Gateway:
    """One model's gateway, over its engines, token counters and planners."""
    return Gateway(
        engines=engine_calls,
        tokenizers=tokenizers,
        planners=routing.planners,
        connector=connector,
        observer=observer,
        metrics=metrics,
        model=model,
        timeouts=PhaseTimeouts.from_settings(settings),
        retries=RetryPolicy.from_settings(settings),
        experiments=routing.experiments,
        shadow=shadow,
        adapters=routing.adapters,
        adapter_loader=adapter_loader,
    )


def build_observer(settings: Settings, metrics: RouterMetrics, learn: Callable[[Outcome], None]) -> Observer:
    """The observer every request is recorded by; each finished request teaches its model's learner (`learn`)."""
    return Observer(metrics, SpanExporter.create() if settings.otel_tracing else None, listeners=[learn])


def build_responses(settings: Settings, metrics: RouterMetrics) -> ResponsesHistory:
    where = settings.responses_store or str(default_store_path())
    store = open_store(where, ttl=settings.responses_ttl, max_bytes=int(settings.responses_store_max_mb * 1024 * 1024))
    return ResponsesHistory(store, metrics)


def build_upkeep(
    settings: Settings,
    engines: Pool,
    *,
    client: httpx.AsyncClient,
    metrics: RouterMetrics,
    models: Sequence[tuple[ServedModel, Pool]],
    lmcache: Sequence[tuple[LMCacheController, Pool]],
) -> Upkeep:
    """Health and load over every engine (`engines`); each model learnt from its own decoders."""
    return Upkeep(
        engines,
        client,
        metrics=metrics,
        health=HealthChecker(
            engines,
            client,
            metrics,
            timeout=settings.health_timeout,
            unhealthy_after=settings.health_unhealthy_threshold,
            healthy_after=settings.health_healthy_threshold,
        ),
        scraper=LoadScraper(
            engines, client, metrics, interval=settings.load_scrape_interval, timeout=settings.health_timeout
        ),
        models=models,
        lmcache=lmcache,
        interval=settings.health_interval,
        probe_timeout=settings.health_timeout,
        memory=MemoryReturn.for_this_process(),
        history=ConsoleHistory(metrics, models=list(settings.models)),
    )
