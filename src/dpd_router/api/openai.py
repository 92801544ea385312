"""The OpenAI-compatible surface: chat and text completions, and the model list."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from dpd_router.api.errors import response_for
from dpd_router.errors import ModelNotFound, RouterError
from dpd_router.request import ClientRequest, RequestKind, clean_request_id, parse_request

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
    router: Router = request.app.state.router
    return Response(orjson.dumps(router.model.models_listing()), media_type="application/json")


async def _serve(request: Request, kind: RequestKind) -> Response:
    router: Router = request.app.state.router
    request_id = clean_request_id(request.headers.get("x-request-id")) or f"dpd-{uuid.uuid4().hex}"
    try:
        client_request = parse_request(kind, await request.body())
        _resolve_model(client_request, router.model.name)
        return await router.gateway.handle(client_request, request_id, request.headers)
    except RouterError as exc:
        headers = {"X-Request-Id": request_id}
        if exc.status_code == 503:
            headers["Retry-After"] = "1"
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
        raise ModelNotFound(f"The model `{asked}` does not exist.", param="model")
