"""OpenAI-style error bodies, and the one place router errors become HTTP statuses."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from dpd_router.request.errors import RouterError


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status}})


def error_response(
    message: str,
    error_type: str,
    status: int,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        error_body(message, error_type, status, param),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def response_for(exc: RouterError, headers: dict[str, str] | None = None) -> Response:
    return error_response(exc.message, exc.error_type, exc.status_code, param=exc.param, headers=headers)
