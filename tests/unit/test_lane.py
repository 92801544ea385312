"""The completions lane's own parts: request ids, the answer's head as Starlette wrote it, the client's
departure, its head and body read from raw ASGI, the log writer that keeps stderr off the event loop, and the
collector's settings while serving."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from dpd_router.api.answers import raw_headers
from dpd_router.api.departure import ON_LOST, Departure
from dpd_router.api.openai import LaneHeaders, LaneRequest, RequestIds, read_body
from dpd_router.app import YOUNG_COLLECTION_AFTER, frozen_heap
from dpd_router.request.errors import PayloadTooLarge


def test_a_request_keeps_its_clients_id_and_gets_a_unique_one_otherwise() -> None:
    ids, other = RequestIds(), RequestIds()
    assert ids.of({"x-request-id": "client-7"}) == "client-7"
    made = [ids.of({}) for _ in range(1000)] + [other.of({}) for _ in range(1000)]
    assert len(set(made)) == 2000, "unique within a process and between two (two replicas on one engine)"
    assert all(len(made_id) == len("dpd-") + 32 and made_id.startswith("dpd-") for made_id in made)


def test_an_answers_head_is_the_one_starlette_writes() -> None:
    headers = {"X-Request-Id": "r-1"}
    whole = Response(b'{"a":1}', media_type="application/json", headers=headers)
    assert sorted(raw_headers(headers, "application/json", 7)) == sorted(whole.raw_headers)
    stream = StreamingResponse(iter([b""]), media_type="text/event-stream", headers=headers)
    assert sorted(raw_headers(headers, "text/event-stream", None)) == sorted(stream.raw_headers)
    own_type = {"X-Request-Id": "r-1", "Content-Type": "text/plain"}
    assert sorted(raw_headers(own_type, "application/json", 2)) == sorted(
        Response(b"ab", media_type="application/json", headers=own_type).raw_headers
    )


async def test_the_listener_call_cancels_the_request_until_it_is_stopped() -> None:
    scope: dict[str, Any] = {"type": "http", ON_LOST: None}

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def serving() -> bool:
        departure = Departure(scope, never)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            departure.absorb()
            current = asyncio.current_task()
            assert current is not None and current.cancelling() == 0, "the task goes on as one never cancelled"
            return departure.left
        return False

    task = asyncio.ensure_future(serving())
    await asyncio.sleep(0)
    scope[ON_LOST]()  # the connection is lost
    assert await task is True

    async def finished() -> None:
        departure = Departure(scope, never)
        departure.stop()
        assert scope[ON_LOST] is None, "a stopped departure is not called"

    await finished()


async def test_without_the_listener_a_disconnect_message_cancels_the_request() -> None:
    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def serving() -> bool:
        departure = Departure({"type": "http"}, receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return departure.left
        return False

    assert await asyncio.wait_for(serving(), 5) is True


def test_while_the_router_serves_its_startup_heap_is_frozen_and_young_collections_wait_longer() -> None:
    before = gc.get_threshold()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (max(before[0], YOUNG_COLLECTION_AFTER), *before[1:])
        alive = weakref.ref(_Cyclic())  # garbage in a cycle, made while serving: still collected
        assert alive() is not None
        gc.collect()
        assert alive() is None
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


@given(
    raw=st.lists(
        st.tuples(st.sampled_from(["x-request-id", "authorization", "x-api-key", "x-session", "accept"]), st.text()),
        max_size=8,
    ),
    asked=st.sampled_from(["x-request-id", "Authorization", "X-API-KEY", "x-session", "content-length", "x-séssion"]),
)
def test_the_lanes_headers_read_as_starlettes(raw: list[tuple[str, str]], asked: str) -> None:
    encoded = [
        (name.encode("latin-1"), value.encode("utf-8").decode("latin-1").encode("latin-1")) for name, value in raw
    ]
    lane, starlette = LaneHeaders(encoded), Headers(raw=encoded)
    assert lane.get(asked) == starlette.get(asked)
    assert lane.get(asked, "none") == starlette.get(asked, "none")
    assert (asked in lane) == (asked in starlette)
    assert lane.getlist(asked) == starlette.getlist(asked)
    assert lane.get("x-session-€") is None and "x-session-€" not in lane  # no header can have that name


def received(*messages: dict[str, Any]) -> Any:
    """An ASGI receive that hands out `messages` in turn."""
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


def lane_request(receive: Any, **headers: str) -> LaneRequest:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    return LaneRequest(scope, receive)


def test_a_body_is_read_whole_from_one_message_or_many_and_refused_past_its_limit() -> None:
    one = lane_request(received({"type": "http.request", "body": b'{"a":1}'}))
    assert asyncio.run(read_body(one, 100)) == b'{"a":1}'
    parts = [{"type": "http.request", "body": part, "more_body": True} for part in (b"ab", b"", b"cd")]
    many = lane_request(received(*parts, {"type": "http.request", "body": b"e"}))
    assert asyncio.run(read_body(many, 100)) == b"abcde"
    for request in (
        lane_request(received({"type": "http.request", "body": b"x" * 101})),
        lane_request(received(*parts, {"type": "http.request", "body": b"x" * 100})),
        lane_request(received(), **{"content-length": "101"}),  # refused before anything is read
    ):
        with pytest.raises(PayloadTooLarge):
            asyncio.run(read_body(request, 100))


def test_a_client_that_leaves_before_its_body_ends_is_told_apart() -> None:
    for messages in (
        [{"type": "http.disconnect"}],
        [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}],
    ):
        with pytest.raises(ClientDisconnect):
            asyncio.run(read_body(lane_request(received(*messages)), 100))
