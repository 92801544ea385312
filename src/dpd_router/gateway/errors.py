"""The failures of a hop that the gateway handles itself, before any becomes the client's error.

A prefill hop fails with `dpd_router.request.errors.PrefillFailed` (raised by the connectors too); a decode
call that fails before the client saw a byte fails with `DecodeFailed`, which another decoder may
make good. What reaches the client is a `RouterError` (dpd_router.request.errors), mapped once to HTTP.
"""

from __future__ import annotations

# The PrefillFailed reason of a hand-off whose decoder failed while its prefill call still ran.
HANDOFF_FAILED = "handoff_failed"

# Prefill failures in which the prefiller answered, with an error the request itself may have caused.
ANSWERED_PREFILL_FAILURES = frozenset({"status_5xx", "in_band_error"})


class DecodeFailed(Exception):
    """The decoder failed before the client saw a byte: another decoder may serve the request.

    Not yet counted against the decoder (`failure` is what its breaker would record): a concurrent
    prefill's failure may explain it.
    """

    def __init__(
        self, detail: str, *, kv_consumed: bool, failure: str, answered: bool = False, in_band: bool = False
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        # Whether the decoder may have used (and so released) the staged KV: then it must be staged again.
        self.kv_consumed = kv_consumed
        self.failure = failure
        # The decoder answered with an error (a 5xx, or an error in-band before any output), which the
        # request itself may have caused; else it failed to answer (connection, stream broken).
        self.answered = answered
        # The error came in the answer, before any output: on a call carrying staged KV, the decoder
        # could not load it (vLLM ends such a request with finish_reason "error").
        self.in_band = in_band


def missed_learned_deadline(seconds: float) -> DecodeFailed:
    """A decoder silent far longer than decoders have been for calls of this size: taken for a hang,
    so it counts against the decoder at once (a hung engine may still pass its health probes), and
    another decoder takes the request. It may have begun pulling the staged KV, so that is staged
    again for the next one."""
    detail = f"no answer within its learned deadline of {seconds:.3g} s"
    return DecodeFailed(detail, kv_consumed=True, failure="timeout")
