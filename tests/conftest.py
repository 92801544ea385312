"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dpd_sim.tokenizer_kit import ensure_tokenizer
from tests.redis_server import RedisServer, redis_server


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tokenizer trained once for the test run; the router and the engines both load it.

    Under pytest-xdist every worker has a base directory of its own inside the run's: the tokenizer goes
    beside them, where the first worker to train it renames it into place whole (ensure_tokenizer) and
    the others load that copy."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return ensure_tokenizer(root / "tokenizer")


@pytest.fixture(scope="session", autouse=True)
def responses_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Responses store of every router this test process starts (and the engines' and routers' processes
    it runs, which inherit the setting): a file of the run's, never the user's own state directory."""
    path = tmp_path_factory.getbasetemp() / "responses.sqlite3"
    os.environ["DPD_RESPONSES_STORE"] = str(path)
    return path


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
