"""create_app(settings): the FastAPI app, whose lifespan starts the router's Components, serves their
routes and closes them; build_server: the app behind the guarded listener."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from dpd_router import __version__
from dpd_router.api.admin import AdminApi
from dpd_router.api.console import ConsoleApi
from dpd_router.api.errors import error_response
from dpd_router.api.guards import ErrorBoundary
from dpd_router.api.openai import OpenAIApi
from dpd_router.api.ops import OpsApi
from dpd_router.api.tokenize import TokenizeApi
from dpd_router.config import Settings
from dpd_router.request.client_request import RequestKind
from dpd_router.server import REASONS as REFUSAL_REASONS
from dpd_router.server import ListenerLimits, RefusedConnections, guarded_protocol
from dpd_router.startup.components import Components


def create_app(settings: Settings, *, refused_connections: RefusedConnections | None = None) -> CompletionsLane:
    """The router's app behind its completions lane; `refused_connections` is the listener's count of
    connections it closed (build_server passes it), exported with the other metrics.

    The routes are handlers over the components they use, so they are added once the lifespan has
    built those: the server takes no request before its lifespan has started.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        components = await Components.start(settings)
        if refused_connections is not None:
            components.metrics.watch_refused_connections(refused_connections.counts, REFUSAL_REASONS)
        try:
            lane.open(add_routes(app, components))
            with frozen_heap():
                yield
        finally:
            lane.close()
            await components.close()

    app = FastAPI(title="dpd-router", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    # A redirect to the path with or without its trailing slash would be built from the client's Host header.
    app.router.redirect_slashes = False

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return error_response(str(exc.detail), error_type, exc.status_code)

    app.add_middleware(ErrorBoundary)
    lane = CompletionsLane(app)
    return lane


# Net allocations of container objects (those allocated less those freed) between young collections while the
# router serves (frozen_heap).
YOUNG_COLLECTION_AFTER = 10_000


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """What startup built (the tokenizer, templates, the libraries' modules: hundreds of thousands of objects)
    left out of the cyclic garbage collector's passes while the router serves, given back to it at shutdown.

    Requests allocate enough containers to set off a collection every few requests, and each older
    generation's pass walked that whole startup heap again: about a tenth of the router's CPU per request
    (a short whole request 0.51 -> 0.47 ms, a 1,600-word prompt through both hops 0.81 -> 0.75 ms). Garbage
    that startup left in reference cycles is collected first, and objects made since are collected as before;
    a frozen object dropped later is freed as usual, unless it is part of a reference cycle (a part replaced
    by a live change, say): then it waits for shutdown, so what can wait is bounded by the startup heap.

    The youngest generation is collected after `YOUNG_COLLECTION_AFTER` net allocations rather than
    Python's 700: at 64 requests in flight, the objects of those still being served swing by more than
    700 between their arrivals and ends, which set off a young collection every eight requests or so,
    each walking every live object of every request in flight (17 us of CPU per request on a 1,600-word
    prompt through both hops, 9 us on a short one). Served requests' objects are freed by their reference
    counts, so what reaches the larger count is growth or garbage in cycles, which is collected as before,
    only later."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], YOUNG_COLLECTION_AFTER), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


class CompletionsLane:
    """The completion endpoints straight to the OpenAI API's raw ASGI handler; every other request, and the
    lifespan, to `app`.

    A completion uses none of what FastAPI's stack does per request (routing tables, dependency
    solving, exception-handler and exit-stack middlewares, Request and Response objects), and it is the
    request that arrives hundreds of times a second: it pays for its handler alone, which guards itself
    (OpenAIApi.serve answers an unexpected failure with a 500 and keeps the connection). A path the lane
    does not take (a trailing slash, another method) gets the app's answer as before.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._api: OpenAIApi | None = None

    def open(self, api: OpenAIApi) -> None:
        """Serve the completion endpoints with `api` (once the components are built)."""
        self._api = api

    def close(self) -> None:
        self._api = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self._api
        if api is not None and scope["type"] == "http" and scope["method"] == "POST":
            kind = LANES.get(scope["path"])
            if kind is not None:
                await api.serve(scope, receive, send, kind)
                return
        await self.app(scope, receive, send)


LANES: dict[str, RequestKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}


def add_routes(app: FastAPI, components: Components) -> OpenAIApi:
    """Each family of routes, given the parts it uses and nothing else; the OpenAI API is returned for
    the completions lane."""
    access, serving, live = components.access, components.serving, components.live
    every_engine, metrics, models = components.every_engine, components.metrics, serving.models
    openai = OpenAIApi(
        gatekeeper=access.gatekeeper,
        admission=access.admission,
        models=models,
        live=live,
        metrics=metrics,
        responses=serving.responses,
    )
    app.include_router(openai.routes())
    tokenize = TokenizeApi(
        gatekeeper=access.gatekeeper, models=models, client=components.client, live=live, metrics=metrics
    )
    app.include_router(tokenize.routes())
    app.include_router(OpsApi(pool=every_engine, models=models, metrics=metrics).routes())
    admin = AdminApi(
        gatekeeper=access.gatekeeper,
        live=live,
        models=models,
        metrics=metrics,
    )
    app.include_router(admin.routes())
    console = ConsoleApi(
        gatekeeper=access.gatekeeper,
        live=live,
        metrics=metrics,
        models=models,
        pool=every_engine,
        observer=serving.observer,
        history=components.upkeep.history,
    )
    app.include_router(console.routes())
    return openai


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
            ws="none",  # no WebSocket endpoint: an Upgrade is answered as plain HTTP (server.py)
            # The client is the connection's peer unless `trusted_proxies` names it (ClientAddresses): uvicorn's
            # own reading of X-Forwarded-For (from 127.0.0.1 by default) would let a local caller name any address.
            proxy_headers=False,
            log_level="warning",
            access_log=False,
            # Not uvicorn's logging configuration: applying it closes every handler in the process, the
            # router's own log writer (record/logs.py) among them; configure_logging routes uvicorn's lines.
            log_config=None,
            timeout_keep_alive=settings.client_keepalive_timeout,
            **config,
        )
    )
