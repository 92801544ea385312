"""Per-key limits shared through a real Redis (`limits_store`) by two routers in front of the same engines."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import chat_body, cluster_settings, metric, running_router
from tests.redis_server import RedisServer

THRESHOLD = 64
SHORT = "Hi there."
ERRORS = "dpd_router_limits_store_errors_total"


async def test_one_keys_budget_holds_across_two_routers_and_survives_redis_going_away(
    cluster: SimCluster, tokenizer_dir: Path, tmp_path: Path, redis: RedisServer
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - sha256: {hash_key('three-a-minute')}\n    requests_per_minute: 3\n"
        f"  - sha256: {hash_key('unlimited')}\n"
    )
    settings = cluster_settings(
        cluster, tokenizer_dir, threshold=THRESHOLD, api_keys_file=str(keys), limits_store=redis.url
    )
    limited = {"Authorization": "Bearer three-a-minute"}
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(running_router(**settings))
        second = await stack.enter_async_context(running_router(**settings))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))

        async def ask(base_url: str, headers: dict[str, str] = limited) -> httpx.Response:
            return await client.post(f"{base_url}/v1/chat/completions", json=chat_body(SHORT), headers=headers)

        for base_url in (first, second, first):
            assert (await ask(base_url)).status_code == 200
        for base_url in (second, first):  # the fourth, on either, is one too many for the deployment
            refused = await ask(base_url)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "RateLimitError" and int(refused.headers["Retry-After"]) >= 1
        assert await metric(first, ERRORS) == 0 and await metric(second, ERRORS) == 0

        # Redis gone: each router decides on its own buckets (here one worker each: the whole limit),
        # never a 500, and counts what the store could not answer.
        await redis.kill()
        started = time.perf_counter()
        answers = [(await ask(first)).status_code for _ in range(4)]
        spent = time.perf_counter() - started
        assert answers == [200, 200, 200, 429], answers
        assert (await ask(second)).status_code == 200
        assert (await ask(first, {"Authorization": "Bearer unlimited"})).status_code == 200
        assert await metric(first, ERRORS) >= 1 and await metric(second, ERRORS) >= 1
        assert spent < 5, f"requests waited {spent:.1f} s on a Redis that is gone"
