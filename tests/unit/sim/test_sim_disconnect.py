"""A client that goes away cancels its request on the engine at once; nothing is left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest

EngineFactory = Callable[..., AbstractAsyncContextManager[Any]]


async def settled(engine: Any) -> dict[str, Any]:
    """The engine's stats once no request is in flight (fails after 3 s)."""
    for _ in range(300):
        stats: dict[str, Any] = (await engine.client.get("/sim/stats")).json()
        if stats["in_flight"] == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"requests still in flight: {stats}")


async def test_closing_a_stream_cancels_the_request(live_engine: EngineFactory) -> None:
    async with live_engine(role="both") as e:
        body = {"prompt": "hi", "max_tokens": 5000, "stream": True}
        async with (
            httpx.AsyncClient(base_url=e.url) as client,
            client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "gone"}) as response,
        ):
            chunks = response.aiter_lines()
            assert (await anext(chunks)).startswith("data: ")
            assert e.core.scheduler.running == 1
        stats = await settled(e)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["recent"][-1] == {
        "request_id": "gone",
        "kind": "local",
        "prompt_tokens": 2,
        "cached_tokens": 0,
        "status": "cancelled",
        "adapter": None,
    }


async def test_giving_up_on_a_whole_answer_cancels_it(live_engine: EngineFactory) -> None:
    async with live_engine(role="both") as e:
        with pytest.raises(httpx.ReadTimeout):
            await e.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000}, timeout=0.3)
        stats = await settled(e)
    assert stats["running"] == 0 and stats["recent"][-1]["status"] == "cancelled"


async def test_hang_fault_holds_until_the_client_leaves(live_engine: EngineFactory) -> None:
    async with live_engine(role="both") as e:
        await e.client.post("/sim/fault", json={"mode": "hang", "count": 1})
        with pytest.raises(httpx.ReadTimeout):
            await e.client.post("/v1/completions", json={"prompt": "hi", "stream": True}, timeout=0.3)
        stats = await settled(e)
        hanging = [task for task in asyncio.all_tasks() if getattr(task.get_coro(), "__qualname__", "") == "_hang"]
        after = await e.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert stats["recent"][-1]["status"] == "cancelled" and stats["fault"]["mode"] == "none"
    assert hanging == []
    assert after.status_code == 200
