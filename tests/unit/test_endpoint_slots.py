"""What a request holds on an engine is a slot: counted while held, released once however it ends."""

from __future__ import annotations

import pytest

from dpd_router.pool.endpoint import Endpoint


def test_each_slot_counts_while_held_and_releases_once() -> None:
    engine = Endpoint("http://127.0.0.1:8200", "decode")
    calling, queued, staging = engine.calling(), engine.queue_prefill(300), engine.staging_for()
    assert (engine.in_flight, engine.queued_tokens, engine.staging) == (1, 300, 1)
    for slot in (calling, queued, staging):
        slot.release()
        slot.release()  # a second release (the request's end after an early one) changes nothing
    assert (engine.in_flight, engine.queued_tokens, engine.staging) == (0, 0, 0)


def test_a_slot_held_by_a_with_block_is_released_when_it_raises() -> None:
    engine = Endpoint("http://127.0.0.1:8100", "prefill")
    with pytest.raises(TimeoutError), engine.calling(), engine.queue_prefill(64):
        assert (engine.in_flight, engine.queued_tokens) == (1, 64)
        raise TimeoutError
    assert (engine.in_flight, engine.queued_tokens) == (0, 0)
