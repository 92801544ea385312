"""A concurrent connector's prefill call, running beside the decode call that waits on it for the KV.

A prefill that fails before the decoder's first token cancels the decode call and counts as a failed
prefill hop; a decode call that fails while the prefill cannot be shown to have done its part is a
failed hand-off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from dpd_router.gateway.errors import HANDOFF_FAILED, DecodeFailed
from dpd_router.request.errors import PrefillFailed
from dpd_router.transfer.base import StagedKV

# Seconds a concurrent decode call that failed before its first token waits for its prefill's outcome.
HANDOFF_GRACE = 2.0

T = TypeVar("T")


async def unless_prefill_fails(
    work: Coroutine[Any, Any, T], pending: asyncio.Task[StagedKV], *, grace: float = HANDOFF_GRACE
) -> T:
    """Run `work` (a decode call up to its first token) beside `pending`, its concurrent prefill call.

    A prefill that fails first cancels `work` and raises its PrefillFailed; one that succeeds
    changes nothing. `work` failing (DecodeFailed) while the prefill still runs may be the
    prefill's doing (the decoder waits on it for the KV), so the prefill gets `grace` seconds to
    show it: failed, its PrefillFailed; still running, PrefillFailed("handoff_failed") (the caller
    cancels it); done, the decoder's own DecodeFailed. A cancellation of the caller propagates.
    """
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, pending}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() or not prefill_failed(pending):
            return await task
    except DecodeFailed as exc:
        raise await _failure_to_blame(exc, pending, grace) from None
    finally:
        if not task.done():
            task.cancel()
            # Wait for it to end without taking its CancelledError for one aimed at the caller.
            await asyncio.wait({task})
    failure = pending.exception()
    assert failure is not None
    raise failure


async def _failure_to_blame(failure: DecodeFailed, pending: asyncio.Task[StagedKV], grace: float) -> BaseException:
    """The decode call failed before its first token: the prefill's failure if it has one (or has
    not finished within `grace` seconds: a failed hand-off), else the decoder's."""
    if not pending.done():
        await asyncio.wait({pending}, timeout=grace)
    if prefill_failed(pending):
        prefill_failure = pending.exception()
        assert prefill_failure is not None
        return prefill_failure
    if not pending.done():
        return PrefillFailed(
            HANDOFF_FAILED, f"the decoder failed ({failure.detail}) while the prefill call was still running"
        )
    return failure


def prefill_failed(pending: asyncio.Task[StagedKV]) -> bool:
    return pending.done() and not pending.cancelled() and pending.exception() is not None


def prefiller_cached_tokens(staged: StagedKV | None) -> int | None:
    """The prefiller's cache hit, reported to the client (None: not known, the decoder's view stands)."""
    if staged is None:
        return None
    pending = staged.pending
    if pending is None:
        return staged.cached_tokens
    if pending.done() and not prefill_failed(pending) and not pending.cancelled():
        return pending.result().cached_tokens
    return None


def abandon(staged: StagedKV) -> None:
    """Give up staged KV: a concurrent prefill still running for it is cancelled."""
    if staged.pending is not None:
        staged.pending.cancel()
