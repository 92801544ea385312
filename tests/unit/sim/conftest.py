"""Fixtures for the simulated engine's tests: one tokenizer per session, engines in-process."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from dpd_sim import SimConfig, create_app
from dpd_sim.core import EngineCore


@dataclass
class Engine:
    """An engine under test: an HTTP client bound to it and its state."""

    client: httpx.AsyncClient
    core: EngineCore
    url: str


EngineFactory = Callable[..., AbstractAsyncContextManager[Engine]]


@pytest.fixture(scope="session")
def sim_tokenizer(tokenizer_dir: Path) -> Path:
    """The session's tokenizer (tests/conftest.py), trained once for the whole run."""
    return tokenizer_dir


@pytest.fixture
def engine(sim_tokenizer: Path) -> EngineFactory:
    """`async with engine(role="both") as e`: an app driven through httpx.ASGITransport."""

    @asynccontextmanager
    async def start(**settings: Any) -> AsyncIterator[Engine]:
        config = SimConfig(**{"role": "both", "port": 8000, "tokenizer": sim_tokenizer, **settings})
        app = create_app(config)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
                yield Engine(client, app.state.core, "http://engine")

    return start


@pytest.fixture
def live_engine(sim_tokenizer: Path) -> EngineFactory:
    """`async with live_engine(role="both") as e`: an app behind a real uvicorn socket, in this process."""

    @asynccontextmanager
    async def start(**settings: Any) -> AsyncIterator[Engine]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: asyncio turns Nagle off
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = SimConfig(**{"role": "both", "port": port, "tokenizer": sim_tokenizer, **settings})
        app = create_app(config)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url) as client:
                yield Engine(client, app.state.core, url)
        finally:
            server.should_exit = True
            await serving
            sock.close()

    return start
