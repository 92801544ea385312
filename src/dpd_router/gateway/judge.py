"""Whose fault a failed hop was: the engine's, or the request's own."""

from __future__ import annotations

from dpd_router.pool.endpoint import Endpoint


class FailureJudge:
    """Tells an engine's failures from a request's own, for one role of one request.

    As Envoy's outlier detection keeps local-origin errors apart from the upstream's answers: an
    engine that cannot be reached, breaks the connection or does not answer in time has failed,
    and it counts against its breaker at once. An engine that answers with an error may have been
    handed a request no engine can serve, so that failure is held until another engine has the
    same request: served there, the held failure was the engine's and counts; failed there with an
    error answer too, it was the request's, and no engine is blamed for it. A failure no other
    engine could judge counts when the request ends (`close`).
    """

    def __init__(self) -> None:
        self._held: list[tuple[Endpoint, str]] = []
        self._request_at_fault = False

    def failed(self, endpoint: Endpoint, failure: str, *, answered: bool) -> None:
        if not answered:
            endpoint.record_failure(failure)
        elif self._request_at_fault:
            return
        elif any(held is not endpoint for held, _ in self._held):
            self._request_at_fault = True  # a second engine failed it with an answer too
            self._held.clear()
        else:
            self._held.append((endpoint, failure))

    def succeeded(self, endpoint: Endpoint) -> None:
        endpoint.record_success()
        self.close()

    def close(self) -> None:
        """Count the failures still held: no other engine could say they were the request's."""
        held, self._held = self._held, []
        for endpoint, failure in held:
            endpoint.record_failure(failure)
