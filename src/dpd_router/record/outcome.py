"""What a finished request teaches: the small frozen record the observer emits to learners.

The adaptive model learns from this, not from the trace the request's path fills in, so routing
depends on no observability state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request, as far as learning the cost of its path goes."""

    ok: bool
    path: str
    stream: bool
    uncached_tokens: int | None
    prefiller: str | None
    decoder: str | None
    # Streams running on / prompt tokens queued on the chosen engines when the request was planned.
    decoder_streams: float
    decoder_queue: float
    prefiller_queue: float | None
    # The prefill hop's whole call time, and whether it was retried (then its time spans two prefillers).
    prefill_seconds: float | None
    prefill_retried: bool
    # The prefill call ran beside the decode call (a concurrent connector), not before it.
    prefill_overlaps_decode: bool
    # From the (last) decode call's start to the first token; None without a first token.
    first_token_seconds: float | None
    # Gaps between the stream's token chunks (chunks - 1).
    token_gaps: int
    # The experiment arm whose routing settings planned it: its arm's adaptive model learns from it.
    arm: str
    # The served model it was a request of: that model's learner learns from it.
    model: str | None = None
