"""ASGI guards around every handler, each about one concern (Starlette's middleware shape)."""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpd_router.api.errors import error_response

log = logging.getLogger("dpd_router.app")


class ErrorBoundary:
    """An exception a handler lets escape becomes an OpenAI-style 500 on a connection that stays open.

    Starlette's outermost error middleware answers 500 and then re-raises, which makes the server
    drop the connection, and with it the client's next request on it. Here the exception stops:
    the answer is complete and the connection can be reused. Once an answer has begun there is no
    honest way to finish it, so the exception goes on and the connection is closed.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except ClientDisconnect:
            return  # the client left (or the listener closed it) while its body was read: nobody to answer
        except Exception:
            response = internal_error(scope)
            if started:
                raise
            await response(scope, receive, send)


def internal_error(scope: Scope) -> Response:
    """Log the exception being handled, and the OpenAI-style 500 a client gets for it."""
    log.exception("unhandled error serving %s", scope.get("path"))
    return error_response("The router failed to serve this request.", "InternalServerError", 500)
