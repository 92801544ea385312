"""The OpenAI-compatible surface: chat and text completions, and the model list.

Each completion request passes, in order: body size limit, API key, per-key request rate,
admission (in-flight cap and queue), body validation; then the gateway serves it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from dpd_router.api.auth import source_of
from dpd_router.api.errors import response_for
from dpd_router.api.responses import discard, http_response
from dpd_router.client_request import ClientRequest, RequestKind, clean_request_id, parse_request
from dpd_router.errors import (
    AdmissionRejected,
    ModelNotFound,
    NotSupported,
    PayloadTooLarge,
    RateLimited,
    RouterError,
    Unauthorized,
)
from dpd_router.tokenizer import LARGE_REQUEST_BYTES

if TYPE_CHECKING:
    from dpd_router.app import Router

routes = APIRouter()


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, "chat")


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, "completion")


@routes.get("/v1/models")
async def models(request: Request) -> Response:
    router, _, refusal = _caller(request)
    if refusal is not None:
        return refusal
    return Response(orjson.dumps(router.model.models_listing()), media_type="application/json")


@routes.api_route("/v1/responses", methods=["GET", "POST", "DELETE"])
@routes.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"])
async def responses(request: Request) -> Response:
    """The Responses API is refused, clearly: vLLM keeps a stored response (`previous_response_id`,
    background runs, GET/cancel by id) in the memory of the one engine that made it, and a router that
    spreads requests over decoders would send the follow-ups to engines that never saw it."""
    _, request_id, refusal = _caller(request)
    if refusal is not None:
        return refusal
    unsupported = NotSupported(
        "dpd-router does not serve the Responses API (/v1/responses): a stored response lives in the one "
        "engine that made it, and the router spreads requests over several. Use /v1/chat/completions."
    )
    # Not worth retrying (the openai clients honour this header): the answer will not change.
    return response_for(unsupported, headers={"X-Request-Id": request_id, "x-should-retry": "false"})


def _caller(request: Request) -> tuple[Router, str, Response | None]:
    """The router, the request's id, and the refusal to send when the caller's key is not accepted."""
    router: Router = request.app.state.router
    request_id = clean_request_id(request.headers.get("x-request-id")) or f"dpd-{uuid.uuid4().hex}"
    try:
        router.gatekeeper.authenticate(request.headers.get("authorization"), source_of(request))
    except RouterError as exc:
        return router, request_id, _error(router, exc, request_id)
    return router, request_id, None


async def _serve(request: Request, kind: RequestKind) -> Response:
    arrived = time.perf_counter()
    router: Router = request.app.state.router
    request_id = clean_request_id(request.headers.get("x-request-id")) or f"dpd-{uuid.uuid4().hex}"
    try:
        # Who is asking, from the headers alone: a body nobody may send is never read.
        principal = router.gatekeeper.authenticate(request.headers.get("authorization"), source_of(request))
        principal.limits.take_request()
        raw = await _read_body(request, router.settings.max_body_bytes)
        trusted = router.settings.trust_request_chat_template
        if len(raw) > LARGE_REQUEST_BYTES:  # parsing megabytes of JSON would hold up every other request
            client_request = await asyncio.to_thread(parse_request, kind, raw, trust_chat_template=trusted)
        else:
            client_request = parse_request(kind, raw, trust_chat_template=trusted)
        _resolve_model(client_request, router.model.name)
    except RouterError as exc:
        return _error(router, exc, request_id)
    admission_started = time.perf_counter()
    admission = router.admission.for_tenant(principal.tenant)
    try:
        await admission.enter()
    except AdmissionRejected as exc:
        return _error(router, exc, request_id)
    serving = asyncio.ensure_future(
        router.gateway.handle(
            client_request,
            request_id,
            request.headers,
            principal=principal,
            on_finish=admission.leave,
            arrived=arrived,
            queued=time.perf_counter() - admission_started,
        )
    )
    watching = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((serving, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if not serving.done():
        # The client left before its answer began: stop both hops now instead of finishing for nobody.
        serving.cancel()
        await asyncio.wait({serving})  # a cancellation of this handler itself still propagates
        if not serving.cancelled() and serving.exception() is None:
            await discard(serving.result())  # it finished anyway: release what the answer holds
        return Response(status_code=499)
    try:
        return http_response(serving.result())
    except RouterError as exc:
        return _error(router, exc, request_id)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
    return bytes(body)


def _error(router: Router, exc: RouterError, request_id: str) -> Response:
    headers = {"X-Request-Id": request_id}
    if isinstance(exc, RateLimited | AdmissionRejected):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    elif exc.status_code == 503:
        headers["Retry-After"] = "1"
    if isinstance(exc, Unauthorized) or exc.status_code == 403:
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, RateLimited) and "Requests per minute" in exc.message:
        router.metrics.rate_limited.labels("requests").inc()
    return response_for(exc, headers=headers)


def _resolve_model(request: ClientRequest, served: str | None) -> None:
    """Fill in the served model when the client named none; refuse a model we do not serve."""
    asked = request.body.get("model")
    if served is None:
        return
    if asked is None:
        request.body["model"] = served
        request.body_changed = True
    elif asked != served:
        raise ModelNotFound(f"The model `{shortened(asked)}` does not exist.", param="model")


def shortened(text: str, limit: int = 200) -> str:
    """A client's string fit to be echoed in an error: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
