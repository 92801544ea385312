"""Errors the router raises, grouped by family; each maps to one HTTP status in api/errors.py."""

from __future__ import annotations

from typing import Literal

# Which limit refused a request: an API key's requests or prompt tokens per minute, or a source
# address's failed authentications.
RateLimit = Literal["requests", "prompt_tokens", "auth_failures"]


class RouterError(Exception):
    """Base of every error the router turns into an OpenAI-style error body."""

    status_code = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(RouterError):
    """The client's request cannot be served as sent."""

    status_code = 400
    error_type = "BadRequestError"


class ModelNotFound(RouterError):
    """The request names a model this router does not serve."""

    status_code = 404
    error_type = "NotFoundError"


class NotFound(RouterError):
    """No such route."""

    status_code = 404
    error_type = "NotFoundError"


class ResponseNotFound(RouterError):
    """A stored response was asked for that nobody stored (vLLM's status, type and wording)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id[:200]}' not found.", param="response_id")


class UpstreamError(RouterError):
    """An engine failed in a way the router could not recover from."""

    status_code = 502
    error_type = "BadGatewayError"


class UpstreamTimeout(UpstreamError):
    """An engine did not answer within the phase's timeout."""

    status_code = 504
    error_type = "GatewayTimeoutError"


class StoreUnavailable(RouterError):
    """The Responses store could not be read (its file or its Redis failed): nothing is known to say."""

    status_code = 503
    error_type = "ServiceUnavailableError"


class NoHealthyDecoder(RouterError):
    """Every decoder is down or unreachable."""

    status_code = 503
    error_type = "ServiceUnavailableError"


class PrefillFailed(Exception):
    """The prefill hop did not stage KV; the gateway falls back or fails per policy.

    `reason` is a short label for metrics (connect_error, timeout, status_5xx, no_kv_params, ...).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Unauthorized(RouterError):
    """No API key, or one the router does not know."""

    status_code = 401
    error_type = "AuthenticationError"


class Forbidden(RouterError):
    """The key is valid but may not do this (admin endpoints need an admin key)."""

    status_code = 403
    error_type = "PermissionDeniedError"


class PayloadTooLarge(RouterError):
    """The request body is larger than the router accepts."""

    status_code = 413
    error_type = "RequestTooLargeError"


class RateLimited(RouterError):
    """A limit (`kind`) is spent for now; retry after `retry_after` seconds."""

    status_code = 429
    error_type = "RateLimitError"

    def __init__(self, message: str, *, kind: RateLimit, retry_after: float) -> None:
        super().__init__(message)
        self.kind: RateLimit = kind
        self.retry_after = retry_after


class AdmissionRejected(RouterError):
    """The router is at capacity: in-flight cap reached and the queue full, or the wait ran out."""

    status_code = 503
    error_type = "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PrefillUnavailable(RouterError):
    """The prefill hop failed and `prefill_failure_policy` is `fail`."""

    status_code = 503
    error_type = "ServiceUnavailableError"
