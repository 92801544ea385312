"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dpd_sim.tokenizer_kit import ensure_tokenizer
from tests.redis_server import RedisServer, redis_server


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tokenizer trained for the test session; the router and the engines both load it."""
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/e2e_vllm runs real vLLM engines: only when named (`make test-vllm`), never in the quick suite."""
    if collection_path.name == "e2e_vllm" and not any("e2e_vllm" in str(arg) for arg in config.args):
        return True
    return None


@pytest.fixture
async def redis() -> AsyncIterator[RedisServer]:
    """A real redis-server of the test's own (tests/redis_server.py); the test may kill it."""
    async with redis_server() as server:
        yield server
