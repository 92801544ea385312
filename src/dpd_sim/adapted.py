"""Another API served over the engine's chat endpoint, as vLLM serves the Messages and Responses APIs: the
body converted to a chat request on the way in, the chat answer's bytes rewritten on the way out."""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from dpd_sim.asgi import JSON_HEADERS, Message, Receive, Scope, Send, read_body, send_json
from dpd_sim.completion_request import InvalidRequest, load_object
from dpd_sim.core import EngineCore
from dpd_sim.serving import CompletionsEndpoint


class StreamRewrite(Protocol):
    def event(self, data: bytes) -> bytes:
        """The API's events for one chat stream event's data (`[DONE]` included)."""
        ...


class Api(Protocol):
    """How one API maps onto chat: its request, its whole answer, its refusals, its stream."""

    def chat_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request the body is served as; InvalidRequest for what the engine refuses."""
        ...

    def error(self, error_type: str, message: str, status: int) -> bytes: ...

    def whole(self, answer: dict[str, Any], body: dict[str, Any]) -> bytes:
        """The chat endpoint's whole answer to `body`, in the API."""
        ...

    def stream(self, body: dict[str, Any]) -> StreamRewrite: ...


class AdaptedEndpoint:
    """An ASGI app: a request in `api` served by the chat endpoint, its answer written back in `api`."""

    def __init__(self, core: EngineCore, api: Api) -> None:
        self.chat = CompletionsEndpoint(core, "chat")
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        if raw is None:
            return
        try:
            body = load_object(raw)
            chat = self.api.chat_request(body)
        except InvalidRequest as exc:
            await send_json(send, exc.status_code, self.api.error(exc.error_type, exc.message, exc.status_code))
            return
        given = False

        async def replayed() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": orjson.dumps(chat), "more_body": False}
            return await receive()

        answer = AdaptedAnswer(send, self.api, body, stream=bool(chat.get("stream")))
        await self.chat(scope, replayed, answer.send)


class AdaptedAnswer:
    """The chat endpoint's answer, rewritten: a stream event by event, a whole answer in one piece, a refusal
    (of either) as the API's error."""

    def __init__(self, send: Send, api: Api, body: dict[str, Any], *, stream: bool) -> None:
        self._send = send
        self._api = api
        self._body = body
        self._stream = api.stream(body) if stream else None
        self._status = 200
        self._parts: list[bytes] = []
        self._pending = b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._status = message["status"]
            if self._status == 200 and self._stream is not None:
                await self._send(message)
            else:
                self._stream = None
            return
        if self._stream is not None:
            self._pending += message.get("body", b"")
            *events, self._pending = self._pending.split(b"\n\n")
            out = b"".join(self._stream.event(e[len(b"data: ") :]) for e in events if e.startswith(b"data: "))
            await self._send({"type": "http.response.body", "body": out, "more_body": message.get("more_body", False)})
            return
        self._parts.append(message.get("body", b""))
        if message.get("more_body"):
            return
        payload = orjson.loads(b"".join(self._parts))
        if self._status == 200:
            body = self._api.whole(payload, self._body)
        else:
            error = payload.get("error") or {}
            text = str(error.get("message", ""))
            body = self._api.error(str(error.get("type", "api_error")), text, self._status)
        headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        await self._send({"type": "http.response.start", "status": self._status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
