"""vLLM's `POST /tokenize` and `POST /detokenize`, answered by an engine of the caller's pool.

Benchmark tools and clients count and decode tokens with these. An engine answers them exactly as it
will read a generation request (its chat template, tools, multimodal parts, `max_model_len`), so the
router relays the body to one and its answer back, as sent: the caller's key, request rate and body size
are checked as for chat, and a tenant's prompts reach only the engines reserved for it. An engine that
cannot be reached, or leaves a call unanswered for `tokenize_timeout`, is passed over for the next; any answer
it gives (a 400 included) is the caller's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING

import httpx
import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from dpd_router.api.openai import RequestIds, error_response, read_body
from dpd_router.prompt.tokenizer import LARGE_REQUEST_BYTES
from dpd_router.request.errors import NoHealthyDecoder, RouterError, UpstreamError

if TYPE_CHECKING:
    from dpd_router.api.auth import Gatekeeper
    from dpd_router.gateway.models import Models, ServingModel
    from dpd_router.live import LiveConfig
    from dpd_router.pool.endpoint import Endpoint
    from dpd_router.pool.pool import Pool
    from dpd_router.record.metrics import RouterMetrics

log = logging.getLogger("dpd_router.tokenize")


class TokenizeApi:
    """`/tokenize` and `/detokenize`, relayed to the engines of the caller's pool of the model the body names."""

    def __init__(
        self,
        *,
        gatekeeper: Gatekeeper,
        models: Models,
        client: httpx.AsyncClient,
        live: LiveConfig,
        metrics: RouterMetrics,
    ) -> None:
        self._gatekeeper = gatekeeper
        self._ids = RequestIds()
        self._models = models
        self._client = client
        self._live = live
        self._metrics = metrics
        # Where the next call starts in its pool's list: one engine does not take every such call.
        self._turn = itertools.count()

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        routes.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        return routes

    async def tokenize(self, request: Request) -> Response:
        return await self._relay(request, "/tokenize")

    async def detokenize(self, request: Request) -> Response:
        return await self._relay(request, "/detokenize")

    async def _relay(self, request: Request, path: str) -> Response:
        request_id = self._ids.of(request.headers)
        try:
            principal = self._gatekeeper.caller(request)
            await principal.limits.take_request()
            raw = await read_body(request, self._live.settings.max_body_bytes)
            pools = (await self._model_of(raw)).pools
            pool = pools.get(principal.tenant) or pools[None]
            return await self._ask(pool, path, raw, request, request_id)
        except RouterError as exc:
            return error_response(exc, request_id, self._metrics)

    async def _model_of(self, raw: bytes) -> ServingModel:
        """The model whose engines answer: the one the body names, when the router serves several (a large
        body parsed on another thread); a lone model's engines judge the body themselves."""
        if len(self._models) == 1:
            return self._models.default
        named = await asyncio.to_thread(_model_named, raw) if len(raw) > LARGE_REQUEST_BYTES else _model_named(raw)
        return self._models.named(named)

    async def _ask(self, pool: Pool, path: str, raw: bytes, request: Request, request_id: str) -> Response:
        engines = _in_turn(pool.healthy("decode"), next(self._turn)) + pool.healthy("prefill")
        if not engines:
            raise NoHealthyDecoder(f"No engine is available to answer {path}; retry shortly.")
        headers = {"X-Request-Id": request_id}
        if (content_type := request.headers.get("content-type")) is not None:
            headers["Content-Type"] = content_type  # vLLM refuses a body not sent as JSON: so may it here
        failures = []
        settings = self._live.settings
        limits = httpx.Timeout(
            settings.tokenize_timeout, connect=min(settings.connect_timeout, settings.tokenize_timeout)
        )
        for endpoint in engines:
            try:
                answer = await self._client.post(f"{endpoint.url}{path}", content=raw, headers=headers, timeout=limits)
            except httpx.HTTPError as exc:
                failures.append(f"{endpoint.url}: {type(exc).__name__}")
                log.warning("%s %s: %s", path, endpoint.url, type(exc).__name__)
                continue
            return Response(
                answer.content,
                status_code=answer.status_code,
                media_type=answer.headers.get("content-type", "application/json"),
                headers={"X-Request-Id": request_id},
            )
        raise UpstreamError(f"No engine answered {path}: {'; '.join(failures)}")


def _model_named(raw: bytes) -> str | None:
    """The model a tokenize body names (None: none, or a body the engine will refuse as it reads it)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _in_turn(endpoints: list[Endpoint], turn: int) -> list[Endpoint]:
    if not endpoints:
        return endpoints
    start = turn % len(endpoints)
    return endpoints[start:] + endpoints[:start]
