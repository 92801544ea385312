"""`dpd-router serve --workers 2` as a real supervisor process in front of simulated engines: both
workers serve, /metrics counts every request once, a killed worker is replaced without losing the
other's requests, SIGHUP reaches every worker, SIGTERM drains."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from dpd_router.api.auth import hash_key
from dpd_router.change_log import CHANGE_LOG_ENV
from dpd_sim.cluster import SimCluster
from dpd_sim.ports import free_port
from tests.redis_server import RedisServer

from .conftest import MODEL, chat_body, metric

ROOT = Path(__file__).resolve().parents[2]
THRESHOLD = 100_000  # every prompt goes straight to a decoder
LONG_STREAM = 200  # tokens: seconds at the engines' 10 ms a token
# Sent to /admin/state always: ignored while no key is configured, the admin key of a test that configures keys.
ADMIN = {"Authorization": "Bearer workers-admin-key"}


@pytest.fixture(scope="module")
async def engines(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    """Decoders slow enough (10 ms a token) that a long stream is still running when a test acts."""
    slow = ["--decode-step-base", "0.01"]
    async with SimCluster(
        in_process=True, prefill=1, decode=2, tokenizer=tokenizer_dir, model=MODEL, extra_args=slow
    ) as cluster:
        yield cluster


@dataclass
class Supervised:
    process: subprocess.Popen[bytes]
    base_url: str
    config: Path
    log: Path


@asynccontextmanager
async def supervised_router(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path, **settings: Any
) -> AsyncIterator[Supervised]:
    """`python -m dpd_router.cli serve --workers 2` on a free port (with these extra settings); yields once
    both workers answer."""
    port = free_port()
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "host": "127.0.0.1",
                "port": port,
                "prefill_urls": engines.prefill_urls,
                "decode_urls": engines.decode_urls,
                "tokenizer": str(tokenizer_dir),
                "routing_threshold": THRESHOLD,
                "threshold_mode": "static",
                "health_interval": 0.5,
                "config_watch_interval": 0,  # only SIGHUP rereads the file
                **settings,
            }
        )
    )
    log = tmp_path / "router.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with log.open("wb") as sink:
        process = subprocess.Popen(  # noqa: ASYNC220 - started once, before the test's work begins
            [sys.executable, "-m", "dpd_router.cli", "serve", "--config", str(config), "--workers", "2"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    router = Supervised(process, f"http://127.0.0.1:{port}", config, log)
    try:
        await worker_states(router, count=2, within=60)
        yield router
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def state_of_a_worker(base_url: str) -> dict[str, Any]:
    """/admin/state from whichever worker accepts a fresh connection."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        response = await client.get("/admin/state", headers=ADMIN)
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state


async def worker_states(router: Supervised, *, count: int, within: float = 30.0) -> dict[int, dict[str, Any]]:
    """The /admin/state of `count` different workers, asked on fresh connections until that many answered."""
    states: dict[int, dict[str, Any]] = {}
    async with asyncio.timeout(within):
        while len(states) < count:
            assert router.process.poll() is None, router.log.read_text()
            try:
                state = await state_of_a_worker(router.base_url)
            except httpx.TransportError:
                await asyncio.sleep(0.1)
                continue
            states[state["router"]["worker"]] = state
    return states


@asynccontextmanager
async def clients_on_each_worker(
    base_url: str, *, each: int = 1, within: float = 30.0
) -> AsyncIterator[dict[int, list[httpx.AsyncClient]]]:
    """`each` clients on each of the two workers, by worker, each client of one keep-alive connection, so
    its requests all reach the worker it first reached.

    The kernel picks the worker of each connection, and while one worker waits in accept it may take
    every connection in a row: clients are opened in concurrent batches until both workers hold `each`.
    """
    limits = httpx.Limits(max_connections=1, keepalive_expiry=60)  # not httpx's 5 s: a later request would reconnect
    opened: list[httpx.AsyncClient] = []
    by_worker: dict[int, list[httpx.AsyncClient]] = {}
    try:
        async with asyncio.timeout(within):
            while len(by_worker) < 2 or any(len(group) < each for group in by_worker.values()):
                batch = [httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) for _ in range(8)]
                opened.extend(batch)
                for client, worker in zip(batch, await asyncio.gather(*map(worker_of, batch)), strict=True):
                    group = by_worker.setdefault(worker, [])
                    if len(group) < each:
                        group.append(client)
        yield by_worker
    finally:
        for client in opened:
            await client.aclose()


async def worker_of(client: httpx.AsyncClient) -> int:
    response = await client.get("/admin/state", headers=ADMIN)
    response.raise_for_status()
    return int(response.json()["router"]["worker"])


async def stream_tokens(client: httpx.AsyncClient, content: str, first: asyncio.Event | None = None) -> int:
    """Stream a long completion; the number of content chunks received, once [DONE] has arrived."""
    chunks = 0
    async with client.stream(
        "POST", "/v1/chat/completions", json=chat_body(content, max_tokens=LONG_STREAM, stream=True)
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return chunks
            event = orjson.loads(line[6:])
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                chunks += 1
                if first is not None:
                    first.set()
    raise AssertionError("the stream ended without [DONE]")


async def test_both_workers_serve_and_metrics_count_every_request_once(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    async with supervised_router(engines, tokenizer_dir, tmp_path) as router:
        sent = 0

        async def one(i: int) -> None:
            async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:  # a fresh connection each
                response = await client.post("/v1/chat/completions", json=chat_body(f"hello {i}"))
                assert response.status_code == 200, response.text

        # The kernel gives each connection to whichever worker accepts first: send until both have served.
        served: dict[int, int] = {}
        while sent < 200 and not (len(served) == 2 and all(served.values())):
            await asyncio.gather(*(one(sent + i) for i in range(20)))
            sent += 20
            states = await worker_states(router, count=2)
            served = {pid: len(state["recent"]) for pid, state in states.items()}
        assert len(served) == 2 and all(served.values()), f"a worker served nothing: {served}"
        for _ in range(8):  # fresh connections: the scrapes land on either worker
            assert await metric(router.base_url, "dpd_router_requests_total") == sent
            assert await metric(router.base_url, "dpd_router_in_flight_requests") == 0


async def test_a_killed_worker_is_replaced_and_the_other_loses_nothing(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    async with supervised_router(engines, tokenizer_dir, tmp_path) as router:
        async with clients_on_each_worker(router.base_url, each=3) as by_worker:
            victim, survivor = sorted(by_worker)
            started = {pid: [asyncio.Event() for _ in group] for pid, group in by_worker.items()}
            streams = {
                pid: [
                    asyncio.create_task(stream_tokens(client, f"story {pid} {n}", event))
                    for n, (client, event) in enumerate(zip(group, started[pid], strict=True))
                ]
                for pid, group in by_worker.items()
            }
            async with asyncio.timeout(30):
                await asyncio.gather(*(event.wait() for events in started.values() for event in events))
            os.kill(victim, signal.SIGKILL)
            finished = await asyncio.gather(*streams[survivor])
            assert finished == [LONG_STREAM] * len(streams[survivor])
            killed = await asyncio.gather(*streams[victim], return_exceptions=True)
            assert all(isinstance(result, BaseException) for result in killed)
        # Replaced: two workers again, the victim not among them, and new requests all served.
        states = await worker_states(router, count=2, within=30)
        assert victim not in states and survivor in states
        async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
            for i in range(5):
                assert (await client.post("/v1/chat/completions", json=chat_body(f"after {i}"))).status_code == 200
        assert "died with exit code -9" in router.log.read_text()


async def test_sighup_reaches_every_worker(engines: SimCluster, tokenizer_dir: Path, tmp_path: Path) -> None:
    async with supervised_router(engines, tokenizer_dir, tmp_path) as router:
        settings = yaml.safe_load(router.config.read_text())
        settings["routing_threshold"] = 2048
        router.config.write_text(yaml.safe_dump(settings))
        router.process.send_signal(signal.SIGHUP)
        async with asyncio.timeout(20):
            while True:
                states = await worker_states(router, count=2)
                if all(state["router"]["routing_threshold"] == 2048 for state in states.values()):
                    break
                await asyncio.sleep(0.1)
        reloads = {"source": "sighup", "outcome": "applied"}
        for _ in range(4):
            assert await metric(router.base_url, "dpd_router_config_reloads_total", reloads) == 2
            assert await metric(router.base_url, "dpd_router_routing_threshold_tokens") == 2048


async def test_sigterm_drains_a_stream_in_flight(engines: SimCluster, tokenizer_dir: Path, tmp_path: Path) -> None:
    async with supervised_router(engines, tokenizer_dir, tmp_path) as router:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=60) as client:
            first = asyncio.Event()
            stream = asyncio.create_task(stream_tokens(client, "a long story", first))
            async with asyncio.timeout(30):
                await first.wait()
            router.process.send_signal(signal.SIGTERM)
            assert await stream == LONG_STREAM
        assert await asyncio.to_thread(router.process.wait, 30) == 0
        assert "every router worker has stopped" in router.log.read_text()


async def test_a_shared_limits_store_holds_each_keys_whole_limit_across_workers(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path, redis: RedisServer
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - sha256: {hash_key('four-a-minute')}\n    requests_per_minute: 4\n"
        f"  - sha256: {hash_key('workers-admin-key')}\n    admin: true\n"
    )
    settings = {"api_keys_file": str(keys), "limits_store": redis.url}
    headers = {"Authorization": "Bearer four-a-minute"}
    async with (
        supervised_router(engines, tokenizer_dir, tmp_path, **settings) as router,
        clients_on_each_worker(router.base_url) as by_worker,
    ):
        (first,), (second,) = by_worker.values()

        async def ask(client: httpx.AsyncClient) -> int:
            response = await client.post("/v1/chat/completions", json=chat_body("hello"), headers=headers)
            return response.status_code

        # Each worker's own share would be 2: the third on one worker passing shows the whole limit is
        # the store's, and the fifth, refused by the other worker, that both spend the one budget.
        assert [await ask(first) for _ in range(3)] == [200, 200, 200]
        assert [await ask(second) for _ in range(2)] == [200, 429]
        assert await metric(router.base_url, "dpd_router_limits_store_errors_total") == 0


def with_admin_key(tmp_path: Path) -> dict[str, str]:
    """The settings of a router whose admin key is ADMIN's (PUT /admin/config needs one)."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - sha256: {hash_key('workers-admin-key')}\n    admin: true\n")
    return {"api_keys_file": str(keys)}


async def thresholds_become(router: Supervised, value: int) -> dict[int, int]:
    """Waits until two workers run `value`; their thresholds by pid."""
    async with asyncio.timeout(30):
        while True:
            states = await worker_states(router, count=2)
            thresholds = {pid: state["router"]["routing_threshold"] for pid, state in states.items()}
            if all(threshold == value for threshold in thresholds.values()):
                return thresholds
            await asyncio.sleep(0.2)


async def kill_and_await_replacement(router: Supervised, victim: int) -> dict[int, int]:
    """SIGKILL a worker; once its replacement answers, the two workers' thresholds by pid (a replacement
    applies the log before it serves: no waiting for its value)."""
    os.kill(victim, signal.SIGKILL)
    async with asyncio.timeout(30):
        while True:
            states = await worker_states(router, count=2)
            if victim not in states:
                break
            await asyncio.sleep(0.2)
    return {pid: state["router"]["routing_threshold"] for pid, state in states.items()}


async def test_a_put_to_one_worker_reaches_every_worker_and_a_replacement(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    async with (
        supervised_router(engines, tokenizer_dir, tmp_path, **with_admin_key(tmp_path)) as router,
        clients_on_each_worker(router.base_url) as by_worker,
    ):
        (taker, (taker_client,)), (sibling, (sibling_client,)) = by_worker.items()
        response = await taker_client.put("/admin/config", json={"routing_threshold": 3000}, headers=ADMIN)
        assert response.status_code == 200, response.text
        # The answer is the worker's that took the PUT: what it changed.
        assert response.json()["changed"] == {"routing_threshold": {"from": THRESHOLD, "to": 3000}}
        async with asyncio.timeout(20):
            while True:
                config = (await sibling_client.get("/admin/config", headers=ADMIN)).json()
                if config["routing_threshold"] == 3000:
                    break
                await asyncio.sleep(0.1)
        assert (await taker_client.get("/admin/config", headers=ADMIN)).json()["routing_threshold"] == 3000
        for _ in range(4):  # counted once as the admin's, once as the sibling's peer change
            for source in ("admin", "peer"):
                labels = {"source": source, "outcome": "applied"}
                assert await metric(router.base_url, "dpd_router_config_reloads_total", labels) == 1
        assert await worker_of(sibling_client) == sibling
        # The worker that took it dies: its replacement reads the PUT from the log, not from it.
        thresholds = await kill_and_await_replacement(router, taker)
        assert sibling in thresholds and set(thresholds.values()) == {3000}, thresholds


async def test_a_sighup_after_a_put_sets_the_files_value_on_every_worker_and_a_later_replacement(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    async with supervised_router(engines, tokenizer_dir, tmp_path, **with_admin_key(tmp_path)) as router:
        async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
            response = await client.put("/admin/config", json={"routing_threshold": 3000}, headers=ADMIN)
            assert response.status_code == 200, response.text
        await thresholds_become(router, 3000)
        settings = yaml.safe_load(router.config.read_text())
        settings["routing_threshold"] = 2048
        router.config.write_text(yaml.safe_dump(settings))
        router.process.send_signal(signal.SIGHUP)
        victim = min(await thresholds_become(router, 2048))
        # A worker started now reads the file (2048) and skips the PUT before the reload (3000).
        thresholds = await kill_and_await_replacement(router, victim)
        assert set(thresholds.values()) == {2048}, thresholds
        # ...and a PUT after the reload still reaches every worker.
        async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
            response = await client.put("/admin/config", json={"routing_threshold": 4000}, headers=ADMIN)
            assert response.status_code == 200, response.text
        await thresholds_become(router, 4000)


async def test_an_admin_reload_on_one_worker_reloads_every_worker(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    async with supervised_router(engines, tokenizer_dir, tmp_path, **with_admin_key(tmp_path)) as router:
        settings = yaml.safe_load(router.config.read_text())
        settings["routing_threshold"] = 2500
        router.config.write_text(yaml.safe_dump(settings))  # no SIGHUP: the admin asks one worker
        async with httpx.AsyncClient(base_url=router.base_url, timeout=30) as client:
            response = await client.post("/admin/reload", headers=ADMIN)
            assert response.status_code == 200, response.text
            assert response.json()["changed"]["routing_threshold"]["to"] == 2500
        await thresholds_become(router, 2500)


def change_log_of(worker: int) -> Path:
    """The change log the supervisor named to a worker (its environment, as the worker read it)."""
    environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    (value,) = (item.partition(b"=")[2] for item in environ if item.startswith(f"{CHANGE_LOG_ENV}=".encode()))
    return Path(value.decode())


async def test_a_shadow_put_reaches_the_sibling_with_its_key_through_a_private_log(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    shadow = {"url": engines.decode_urls[0], "share": 0, "api_key": "sk-shadow-secret"}
    async with (
        supervised_router(engines, tokenizer_dir, tmp_path, **with_admin_key(tmp_path)) as router,
        clients_on_each_worker(router.base_url) as by_worker,
    ):
        (_, (taker_client,)), (sibling, (sibling_client,)) = by_worker.items()
        response = await taker_client.put("/admin/config", json={"shadow": shadow}, headers=ADMIN)
        assert response.status_code == 200, response.text
        async with asyncio.timeout(20):
            while True:
                config = (await sibling_client.get("/admin/config", headers=ADMIN)).json()
                if config["shadow"] is not None:
                    break
                await asyncio.sleep(0.1)
        assert config["shadow"]["url"] == shadow["url"]
        assert config["shadow"]["api_key"] is not None, "the sibling's shadow has the key too"
        assert "sk-shadow-secret" not in str(config), "shown redacted"
        # The key is in the log, for the siblings: a file only the router's user may read.
        log_path = change_log_of(sibling)
        assert b"sk-shadow-secret" in log_path.read_bytes()
        assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(log_path.parent.stat().st_mode) == 0o700
    assert not log_path.parent.exists(), "the supervisor removes the log when it stops"


async def test_a_response_one_worker_stored_is_continued_by_the_other(
    engines: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The default store is one SQLite file every worker process reads and writes."""
    store = tmp_path / "responses.sqlite3"
    async with (
        supervised_router(engines, tokenizer_dir, tmp_path, responses_store=str(store)) as router,
        clients_on_each_worker(router.base_url) as by_worker,
    ):
        (first,), (second,) = by_worker.values()
        made = await first.post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 3})
        assert made.status_code == 200, made.text
        response_id = made.json()["id"]
        kept = await second.get(f"/v1/responses/{response_id}")
        assert kept.status_code == 200 and kept.json()["id"] == response_id
        follow = await second.post(
            "/v1/responses",
            json={"model": MODEL, "input": "and?", "previous_response_id": response_id, "max_output_tokens": 3},
        )
        assert follow.status_code == 200 and follow.json()["previous_response_id"] == response_id
        listed = await first.get(f"/v1/responses/{follow.json()['id']}/input_items", params={"order": "asc"})
        assert [item.get("role") for item in listed.json()["data"]] == ["user", "assistant", "user"]
