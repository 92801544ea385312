"""A Responses request's history, expanded before it is counted or routed: what the engines are sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import ResponseNotFound, StoreUnavailable
from dpd_router.responses.history import ResponsesHistory
from dpd_router.responses.store import SqliteResponses, StoredResponse


def request(body: dict[str, Any]):
    return parse_request("responses", orjson.dumps({"model": "m", **body}))


def earlier(rid: str, said: str, answered: str, previous: str | None = None) -> StoredResponse:
    output = [
        {
            "id": f"msg_{rid}",
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": answered}],
        }
    ]
    given = orjson.dumps([{"type": "message", "role": "user", "content": said}])
    return StoredResponse(rid, "alice", previous, 0.0, given, orjson.dumps({"id": rid, "output": output}))


async def test_a_follow_up_is_sent_as_the_whole_conversation(tmp_path: Path) -> None:
    store = SqliteResponses(tmp_path / "r.sqlite3", ttl=3600, max_bytes=1 << 20)
    history = ResponsesHistory(store, RouterMetrics())
    await store.put(earlier("resp_1", "Hi", "Hello!"))
    await store.put(earlier("resp_2", "Weather?", "Sunny.", previous="resp_1"))
    follow = request({"input": "Tomorrow?", "previous_response_id": "resp_2", "instructions": "Be brief."})
    await history.begin(follow, "alice")
    sent = orjson.loads(follow.encoded())
    assert "previous_response_id" not in sent and sent["store"] is False
    assert [(item["role"], item.get("content")) for item in sent["input"]][0::2] == [
        ("user", "Hi"),
        ("user", "Weather?"),
        ("user", "Tomorrow?"),
    ]
    assert orjson.loads(follow.raw)["input"] == sent["input"], "sized as the whole conversation, not the client's bytes"
    messages = follow.template_body["messages"]
    assert [message["role"] for message in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[4]["content"] == "Sunny."
    assert (
        follow.turn is not None
        and follow.turn.previous == "resp_2"
        and follow.turn.own_input == [{"type": "message", "role": "user", "content": "Tomorrow?"}]
    )
    with pytest.raises(ResponseNotFound):
        await history.begin(request({"input": "x", "previous_response_id": "resp_2"}), "bob")
    await store.aclose()


async def test_a_store_that_fails_is_unavailable_not_empty() -> None:
    class Broken:
        async def chain(self, response_id: str, owner: str) -> None:
            raise OSError("disk gone")

        async def get(self, response_id: str, owner: str) -> None:
            raise OSError("disk gone")

    history = ResponsesHistory(Broken(), RouterMetrics())  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable):
        await history.begin(request({"input": "x", "previous_response_id": "resp_1"}), "alice")
    with pytest.raises(StoreUnavailable):
        await history.retrieve("resp_1", "alice")
