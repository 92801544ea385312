"""The client-facing surface: OpenAI's chat and text completions, Responses API and model list, and
Anthropic's Messages API (`/v1/messages`, its `count_tokens`).

Each completion request passes, in order: body size limit, API key, per-key request rate,
admission (in-flight cap and queue), body validation; then the gateway serves it. A Messages
request's refusals are written as that API writes its errors.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from dpd_router.api.answers import discard, send_answer
from dpd_router.api.auth import ANONYMOUS, Gatekeeper, Principal
from dpd_router.api.departure import Departure
from dpd_router.api.errors import response_for
from dpd_router.api.guards import internal_error
from dpd_router.api.limits import count_refusal
from dpd_router.messages import api as messages_api
from dpd_router.prompt.tokenizer import LARGE_REQUEST_BYTES
from dpd_router.request.client_request import (
    MANY_CONTAINERS,
    ClientRequest,
    RequestKind,
    clean_request_id,
    free_in_pieces,
    parse_request,
)
from dpd_router.request.errors import (
    AdmissionRejected,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RouterError,
    Unauthorized,
)
from dpd_router.routing.request import session_key

if TYPE_CHECKING:
    from dpd_router.api.admission import Admissions
    from dpd_router.gateway.answer import Answer
    from dpd_router.gateway.models import Models
    from dpd_router.live import LiveConfig
    from dpd_router.record.metrics import RouterMetrics
    from dpd_router.responses.history import ResponsesHistory


class OpenAIApi:
    """The OpenAI-compatible routes, over the parts they use."""

    def __init__(
        self,
        *,
        gatekeeper: Gatekeeper,
        admission: Admissions,
        models: Models,
        live: LiveConfig,
        metrics: RouterMetrics,
        responses: ResponsesHistory,
    ) -> None:
        self._responses = responses
        self._ids = RequestIds()
        self._gatekeeper = gatekeeper
        self._admission = admission
        self._models = models
        self._live = live
        self._metrics = metrics

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        routes.add_api_route("/v1/completions", self.completions, methods=["POST"])
        routes.add_api_route("/v1/messages", self.messages, methods=["POST"])
        routes.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])
        routes.add_api_route("/v1/models", self.models, methods=["GET"])
        routes.add_api_route("/v1/responses", self.responses, methods=["POST"])
        routes.add_api_route("/v1/responses/{rest:path}", self.stored_response, methods=["GET", "POST", "DELETE"])
        return routes

    async def chat_completions(self, request: Request) -> Response:
        return LaneResponse(self, "chat")

    async def completions(self, request: Request) -> Response:
        return LaneResponse(self, "completion")

    async def messages(self, request: Request) -> Response:
        return LaneResponse(self, "messages")

    async def count_tokens(self, request: Request) -> Response:
        """The prompt tokens of a Messages body as the engine will count them, by the router's own
        tokenizer (or an engine's /tokenize, where the router has none): no engine generates anything."""
        request_id = self._ids.of(request.headers)
        try:
            principal = self._gatekeeper.caller(request)
            await principal.limits.take_request()
            raw = await read_body(request, self._live.settings.max_body_bytes)
            client_request = await self._parse(raw, "messages", counting=True)
            tokenizer = self._models.resolve(client_request)[0].gateway.tokenizer_for(principal.tenant)
            prompt = await tokenizer.tokenize(client_request)
        except RouterError as exc:
            return self._error(exc, request_id, "messages")
        counted = prompt.num_tokens
        answer = {"input_tokens": counted, "context_management": {"original_input_tokens": counted}}
        return Response(orjson.dumps(answer), media_type="application/json", headers={"X-Request-Id": request_id})

    async def models(self, request: Request) -> Response:
        _, refusal = self._caller(request)
        if refusal is not None:
            return refusal
        return Response(orjson.dumps(self._models.listing()), media_type="application/json")

    async def responses(self, request: Request) -> Response:
        return LaneResponse(self, "responses")

    async def stored_response(self, request: Request) -> Response:
        """A stored response retrieved (GET), deleted (DELETE), listed its input items (GET .../input_items) or
        cancelled (POST .../cancel: only a background response can be, and none is): each the caller's own."""
        request_id = self._ids.of(request.headers)
        response_id, _, rest = request.path_params.get("rest", "").partition("/")
        try:
            principal = self._gatekeeper.caller(request)
            await principal.limits.take_request()
            owner = principal.key_id
            if rest == "" and request.method == "GET":
                answer = await self._responses.retrieve(response_id, owner)
            elif rest == "" and request.method == "DELETE":
                answer = await self._responses.delete(response_id, owner)
            elif rest == "input_items" and request.method == "GET":
                limit, order, after = _listing(request)
                answer = await self._responses.input_items(response_id, owner, limit=limit, order=order, after=after)
            elif rest == "cancel" and request.method == "POST":
                await self._responses.retrieve(response_id, owner)
                raise InvalidRequest("Only a background response can be cancelled, and this one was not.")
            else:
                raise NotFound(f"No such route: {request.method} {request.url.path}")
        except RouterError as exc:
            return self._error(exc, request_id, "responses")
        return Response(orjson.dumps(answer), media_type="application/json", headers={"X-Request-Id": request_id})

    def _caller(self, request: Request) -> tuple[str, Response | None]:
        """The request's id, and the refusal to send when the caller's key is not accepted."""
        request_id = self._ids.of(request.headers)
        try:
            self._gatekeeper.caller(request)
        except RouterError as exc:
            return request_id, self._error(exc, request_id)
        return request_id, None

    async def serve(self, scope: Scope, receive: Receive, send: Send, kind: RequestKind) -> None:
        """One completion request on raw ASGI, from its head to its answer's last byte (the completions lane's
        work: app.CompletionsLane). A client that leaves before its answer is complete cancels this task
        (Departure): the gateway stops both hops, and nothing is sent to nobody."""
        arrived = time.perf_counter()
        request = LaneRequest(scope, receive)
        departure: Departure | None = None
        try:
            made = await self._answer(request, kind, arrived, scope, receive)
            if isinstance(made, Response):  # refused: the error's own response
                await made(scope, receive, send)
                return
            answer, departure = made
            await send_answer(answer, send, departure)
        except asyncio.CancelledError:
            if departure is None or not departure.left:
                raise
            departure.absorb()  # the client left: its request is over, and the task ends as usual
        finally:
            if departure is not None:
                departure.stop()

    async def _answer(
        self, request: Request, kind: RequestKind, arrived: float, scope: Scope, receive: Receive
    ) -> Response | tuple[Answer, Departure]:
        """The gateway's answer, and the departure that watches its client from the body's end; or the response
        of a refusal (an unexpected failure before the answer is a 500, the connection kept)."""
        settings = self._live.settings
        request_id = self._ids.of(request.headers)
        try:
            # Who is asking, from the headers alone: a body nobody may send is never read.
            principal = self._gatekeeper.caller(request)
            await principal.limits.take_request()
            raw = await read_body(request, settings.max_body_bytes)
            client_request = await self._parse(raw, kind)
            sticky = (
                _sticky(request, client_request, principal, settings.session_header) if self._models.aliased else None
            )
            served, adapter = self._models.resolve(client_request, sticky=sticky)
            if kind == "responses":
                await self._responses.begin(client_request, principal.key_id)
            admission_started = time.perf_counter()
            admission = self._admission.for_tenant(principal.tenant)
            await admission.enter()
        except RouterError as exc:
            return self._error(exc, request_id, kind)
        except ClientDisconnect:
            return Response(status_code=499)  # left while its body was read: sent to nobody
        except Exception:
            return internal_error(scope)
        departure = Departure(scope, receive)
        try:
            answer = await served.gateway.handle(
                client_request,
                request_id,
                request.headers,
                principal=principal,
                on_finish=admission.leave,
                arrived=arrived,
                queued=time.perf_counter() - admission_started,
                adapter=adapter,
            )
        except RouterError as exc:
            departure.stop()
            if client_request.brackets > MANY_CONTAINERS:
                _free_apart(client_request)
            return self._error(exc, request_id, kind)
        except asyncio.CancelledError:
            if not departure.left:
                raise
            departure.absorb()
            departure.stop()
            return Response(status_code=499)  # the gateway stopped both hops: nobody to answer
        except Exception:
            departure.stop()
            return internal_error(scope)
        if departure.left:  # it finished its answer after the client left anyway: released, sent to nobody
            departure.absorb()
            await discard(answer)
            return Response(status_code=499)
        if client_request.turn is not None:
            try:
                await client_request.turn.settle()  # a whole answer's response kept before the client has it
            except BaseException:
                await discard(answer)
                raise
        return answer, departure

    async def _parse(self, raw: bytes, kind: RequestKind, *, counting: bool = False) -> ClientRequest:
        """The body parsed and checked; megabytes of JSON on another thread
        (parsed there, they would hold up every other request)."""
        trusted = self._live.settings.trust_request_chat_template
        if len(raw) > LARGE_REQUEST_BYTES:
            client_request = await asyncio.to_thread(
                parse_request, kind, raw, trust_chat_template=trusted, yielding=True, counting=counting
            )
        else:
            client_request = parse_request(kind, raw, trust_chat_template=trusted, counting=counting)
        return client_request

    def _error(self, exc: RouterError, request_id: str, kind: RequestKind = "chat") -> Response:
        return error_response(exc, request_id, self._metrics, kind=kind)


def _free_apart(request: ClientRequest) -> None:
    """Free a refused body of very many containers on another thread, a piece at a time: freed here at
    once, its objects would hold the event loop for as long as freeing them takes."""
    body, request.body = request.body, {}
    asyncio.get_running_loop().run_in_executor(None, free_in_pieces, body)


class LaneResponse(Response):
    """A completion request reached through the app's routes (the lane takes them first): served as the lane
    serves it, on raw ASGI."""

    def __init__(self, api: OpenAIApi, kind: RequestKind) -> None:
        super().__init__()
        self._api = api
        self._kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._api.serve(scope, receive, send, self._kind)


class RequestIds:
    """Request ids: the client's `X-Request-Id` (cleaned), else a new one, sent to the engines and back to the
    client. New ones are this process's random prefix and a count: unique among the router's replicas
    (which share engines) without reading the system's randomness for each request."""

    def __init__(self) -> None:
        self._prefix = f"dpd-{secrets.token_hex(8)}"
        self._count = itertools.count(1)

    def of(self, headers: Mapping[str, str]) -> str:
        return clean_request_id(headers.get("x-request-id")) or f"{self._prefix}{next(self._count):016x}"


def error_response(
    exc: RouterError, request_id: str, metrics: RouterMetrics, *, kind: RequestKind = "chat"
) -> Response:
    """The error for `exc` in its API's shape (OpenAI's; the Messages API's for `kind` messages), with
    the headers a client acts on (when to retry, how to authenticate); a rate-limit refusal is counted."""
    headers = {"X-Request-Id": request_id}
    if isinstance(exc, RateLimited | AdmissionRejected):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    elif exc.status_code == 503:
        headers["Retry-After"] = "1"
    if isinstance(exc, Unauthorized) or exc.status_code == 403:
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, RateLimited):
        count_refusal(metrics, exc)
    if kind == "messages":
        content = messages_api.error_body(exc.status_code, exc.message)
        return Response(content, status_code=exc.status_code, media_type="application/json", headers=headers)
    return response_for(exc, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused past `limit` bytes before more is read (the client's `Content-Length` is
    believed first); ClientDisconnect when the client leaves before its end.

    Read from the ASGI messages themselves, as Starlette's `Request.stream` reads them (without its
    generator and the flags that let the body be read again: it is read once)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
    receive = request.receive
    message = await receive()
    if message["type"] == "http.request" and not message.get("more_body", False):  # all in one message, mostly
        body: bytes = message.get("body", b"")
        if len(body) > limit:
            raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
        return body
    parts = bytearray()
    while True:
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        parts += message.get("body", b"")
        if len(parts) > limit:
            raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
        if not message.get("more_body", False):
            return bytes(parts)
        message = await receive()


class LaneHeaders(Headers):
    """A request's headers as Starlette's `Headers` reads them, where a name's (first) value is found in a
    table made once, not by a scan of every header, decoding each, per lookup: the lane looks up a handful
    per request (its id, its key, its length, a session), some of them absent."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        super().__init__(raw=raw)
        self._first = {name: value for name, value in reversed(raw)}  # the first of a repeated name wins

    def get(self, key: str, default: Any = None) -> Any:
        value = self._first.get(key.lower().encode("latin-1", "replace"))  # a name no header can have: none
        return default if value is None else value.decode("latin-1")

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower().encode("latin-1", "replace") in self._first


class LaneRequest(Request):
    """A completion request's head as the lane reads it: Starlette's Request, with LaneHeaders."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        super().__init__(scope, receive)
        self._lane_headers = LaneHeaders(scope["headers"])

    @property
    def headers(self) -> Headers:
        return self._lane_headers


def _listing(request: Request) -> tuple[int, str, str | None]:
    """The `limit` (1-100, default 20), `order` (asc or desc, the default) and `after` of an input items listing."""
    query = request.query_params
    given = query.get("limit", "20")
    try:
        limit = int(given)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest(f"'limit' must be an integer from 1 to 100, not '{given[:50]}'.", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"'order' must be 'asc' or 'desc', not '{order[:50]}'.", param="order")
    return limit, order, query.get("after")


def _sticky(request: Request, client_request: ClientRequest, principal: Principal, header: str) -> str | None:
    """What keeps a session on one of a model alias's models: its session key (`header`, else the body's
    `user`), else its API key."""
    key = session_key(request.headers, client_request.body, header=header)
    if key is None and principal.key_id != ANONYMOUS.key_id:
        key = f"api-key {principal.key_id}"
    return key
