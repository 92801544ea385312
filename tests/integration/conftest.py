"""Loopback fixtures: simulated engines as real processes, and the router on a real socket."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from dpd_router.app import build_server
from dpd_router.config import load_settings
from dpd_sim.cluster import SimCluster
from dpd_sim.ports import free_port

MODEL = "sim-model"

# The helpers' calls go to 127.0.0.1 in plain HTTP, yet httpx builds each new client a TLS context, reading and
# parsing the CA bundle: 20 ms of CPU, stretched past a second on a CI machine whose two cores real CPU engines
# keep busy, and spent on the event loop the router under test shares (its calls and the test's connects wait).
# One context, made once, serves every client the tests make.
LOCAL_TLS = ssl.create_default_context()
# A helper's call waits as long as the router's own engine calls may (a starved CI machine's loop can be held
# up for seconds), not httpx's default of 5 s; what a test waits for is bounded by the test itself.
HELPER_TIMEOUT = 30.0


def local_client(**kwargs: Any) -> httpx.AsyncClient:
    """An httpx client for calls to 127.0.0.1 from a test (no proxies, the shared TLS context)."""
    return httpx.AsyncClient(verify=LOCAL_TLS, trust_env=False, **{"timeout": HELPER_TIMEOUT, **kwargs})


@pytest.fixture(scope="session")
async def cluster(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    """Two prefill engines and two decode engines, shared by the integration tests."""
    async with SimCluster(in_process=True, prefill=2, decode=2, tokenizer=tokenizer_dir, model=MODEL) as engines:
        yield engines


@asynccontextmanager
async def running_router(*, startup_within: float = 30, **settings: Any) -> AsyncIterator[str]:
    """The router app served by uvicorn on a free 127.0.0.1 port, started within `startup_within` seconds;
    yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: asyncio turns Nagle off
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = load_settings(host="127.0.0.1", port=port, health_interval=0.5, **settings)
    async with serving(build_server(config, loop="none", lifespan="on"), sock, within=startup_within):
        yield f"http://127.0.0.1:{port}"


@asynccontextmanager
async def router_process(log: Path, *args: str, env: dict[str, str] | None = None) -> AsyncIterator[str]:
    """`dpd-router serve` with `args` in a process of its own on a free 127.0.0.1 port, its output into `log`
    (and `env` added to its environment); yields its base URL once it is ready, and stops it after."""
    port = free_port()
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dpd_router.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args,
            stdout=output, stderr=output, env={**os.environ, **(env or {})},
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        async with local_client() as http, asyncio.timeout(60):
            while True:
                assert process.returncode is None, f"the router exited before it was ready: see {log}"
                try:
                    if (await http.get(f"{base_url}/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        yield base_url
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()


@asynccontextmanager
async def serving(server: uvicorn.Server, sock: socket.socket, *, within: float = 30) -> AsyncIterator[uvicorn.Server]:
    """`server` serving on `sock` in this event loop, once it has started (within `within` seconds); stopped
    (and `sock` closed) after."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(within):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.02)
        yield server
    finally:
        server.should_exit = True
        await task
        sock.close()


def openai_client(base_url: str, *, api_key: str = "unused", **kwargs: Any) -> AsyncOpenAI:
    """The official client, on an HTTP client of its own kind made with the shared TLS context (see LOCAL_TLS)."""
    http_client = DefaultAsyncHttpxClient(verify=LOCAL_TLS, trust_env=False)
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, http_client=http_client, **kwargs)


def chat_body(content: str, *, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    """A one-message chat completion request for the simulated model."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def cluster_settings(cluster: SimCluster, tokenizer_dir: Path, *, threshold: int, **extra: Any) -> dict[str, Any]:
    """Router settings in front of a simulated cluster: its engines, the local tokenizer, a static threshold."""
    return {
        "prefill_urls": cluster.prefill_urls,
        "decode_urls": cluster.decode_urls,
        "tokenizer": str(tokenizer_dir),
        "routing_threshold": threshold,
        "threshold_mode": "static",
        **extra,
    }


async def engine_stats(url: str) -> dict[str, Any]:
    async with local_client() as client:
        response = await client.get(f"{url}/sim/stats")
        response.raise_for_status()
        return response.json()


async def requests_seen(url: str, request_id: str) -> list[dict[str, Any]]:
    """The engine's record of requests that carried this X-Request-Id."""
    stats = await engine_stats(url)
    return [entry for entry in stats["recent"] if entry["request_id"] == request_id]


def rid() -> str:
    """A fresh X-Request-Id, to find a request in the engines' records."""
    return f"test-{uuid.uuid4().hex[:12]}"


def fresh(text: str) -> str:
    """`text` after a prefix no engine has cached: put first in a prompt, it leaves the prefiller no cache hit,
    whatever ran before."""
    return f"[{uuid.uuid4().hex}] {text}"


async def kinds_seen(urls: list[str], request_id: str) -> list[str]:
    """What the engines at `urls` ran for this request id: `remote_prefill`, `kv_decode`, `local`."""
    return [str(entry["kind"]) for url in urls for entry in await requests_seen(url, request_id)]


async def metric(
    base_url: str, name: str, labels: dict[str, str] | None = None, *, client: httpx.AsyncClient | None = None
) -> float:
    """The sum of a Prometheus endpoint's samples of `name` with these `labels` (0 when absent):
    a label left out is summed over. `client`: one to ask with (else one made for the call)."""
    from prometheus_client.parser import text_string_to_metric_families

    if client is None:
        async with local_client() as own:
            return await metric(base_url, name, labels, client=own)
    text = (await client.get(f"{base_url}/metrics")).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += float(sample.value)
    return total


async def settled(base_url: str, *, within: float = 10.0) -> None:
    """Wait until the router has finished recording every request (a client can see [DONE] first)."""
    async with asyncio.timeout(within), local_client() as client:
        while await metric(base_url, "dpd_router_in_flight_requests", client=client) != 0:  # noqa: ASYNC110 - polling another task's state
            await asyncio.sleep(0.02)
