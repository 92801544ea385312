"""Two engine processes: the NIXL hop from prefiller to decoder goes over a real socket."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_sim import SimCluster
from dpd_sim import cluster as cluster_module
from dpd_sim.cluster import EngineStartError
from dpd_sim.ports import free_port, free_ports

LEASE_SECONDS = 1.0


async def test_kv_moves_once_from_prefiller_to_decoder_within_its_lease(sim_tokenizer: Path) -> None:
    cluster = SimCluster(
        prefill=1, decode=1, tokenizer=sim_tokenizer, extra_args=["--lease-seconds", str(LEASE_SECONDS)]
    )
    async with cluster, httpx.AsyncClient(timeout=10) as http:
        (prefill_url,), (decode_url,) = cluster.prefill_urls, cluster.decode_urls
        request: dict[str, Any] = {"messages": [{"role": "user", "content": "word " * 60}], "max_tokens": 6}

        async def prefill() -> dict[str, Any]:
            body = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
            answer = await http.post(f"{prefill_url}/v1/chat/completions", json=body)
            params: dict[str, Any] = answer.json()["kv_transfer_params"]
            return params

        async def decode(params: dict[str, Any]) -> dict[str, Any]:
            body = {**request, "kv_transfer_params": params}
            answer = await http.post(f"{decode_url}/v1/chat/completions", json=body)
            assert answer.status_code == 200
            result: dict[str, Any] = answer.json()
            return result

        params = await prefill()
        assert params["remote_port"] == int(prefill_url.rsplit(":", 1)[1])
        transferred = await decode(params)
        decoder_stats = (await http.get(f"{decode_url}/sim/stats")).json()
        direct = (await http.post(f"{decode_url}/v1/chat/completions", json=request)).json()

        prompt_tokens = transferred["usage"]["prompt_tokens"]
        assert transferred["choices"][0]["finish_reason"] == "length"
        assert transferred["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens
        assert params["remote_num_tokens"] == prompt_tokens
        assert decoder_stats["kv_transfers"] == 1 and decoder_stats["prefill_steps"] == 0
        assert transferred["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]

        reused = await decode(params)
        assert reused["choices"][0]["finish_reason"] == "error"
        assert reused["choices"][0]["message"]["content"] == ""

        stale = await prefill()
        await asyncio.sleep(LEASE_SECONDS + 0.3)
        expired = await decode(stale)
        assert expired["choices"][0]["finish_reason"] == "error"

        decoder = (await http.get(f"{decode_url}/sim/stats")).json()
        prefiller = (await http.get(f"{prefill_url}/sim/stats")).json()
        metrics = (await http.get(f"{decode_url}/metrics")).text
    assert (decoder["kv_transfers"], decoder["failed_transfers"], decoder["local_prefills"]) == (1, 2, 1)
    assert [record["kind"] for record in decoder["recent"]] == ["kv_decode", "local", "kv_decode", "kv_decode"]
    assert (prefiller["remote_prefills"], prefiller["leases_active"]) == (2, 0)
    assert 'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="sim-model"} 1.0' in metrics
    assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="sim-model"} 2.0' in metrics
    assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="sim-model"} 1.0' in metrics
    assert all(engine.process is not None and engine.process.returncode is not None for engine in cluster.engines)


async def test_a_killed_engine_restarts_on_its_port(sim_tokenizer: Path) -> None:
    async with SimCluster(prefill=0, decode=1, tokenizer=sim_tokenizer) as cluster, httpx.AsyncClient() as http:
        (engine,) = cluster.engines
        await cluster.kill(engine)
        with pytest.raises(httpx.ConnectError):
            await http.get(f"{engine.url}/health")
        await cluster.restart(engine)
        assert (await http.get(f"{engine.url}/health")).status_code == 200
        assert cluster.decode_urls == [engine.url]


async def test_an_engine_whose_port_was_taken_first_starts_on_a_fresh_one(
    sim_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between choosing a free port and the engine binding it another process can take it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        chosen = iter([[port]])
        monkeypatch.setattr(
            cluster_module, "free_ports", lambda count, **kw: next(chosen, None) or free_ports(count, **kw)
        )
        async with SimCluster(prefill=0, decode=1, tokenizer=sim_tokenizer) as cluster, httpx.AsyncClient() as http:
            (engine,) = cluster.engines
            assert engine.port != port
            assert (await http.get(f"{engine.url}/health")).status_code == 200
            assert "already in use" not in engine.log_tail()


async def test_an_engine_that_dies_at_startup_reports_its_output(sim_tokenizer: Path) -> None:
    cluster = SimCluster(prefill=1, decode=0, tokenizer=sim_tokenizer, extra_args=["--max-model-len", "many"])
    with pytest.raises(EngineStartError, match="invalid int value"):
        await cluster.start()


async def test_engines_in_the_event_loop_serve_the_same_app_and_restart_fresh(sim_tokenizer: Path) -> None:
    cluster = SimCluster(prefill=1, decode=1, tokenizer=sim_tokenizer, in_process=True, extra_args=["--seed", "7"])
    async with cluster, httpx.AsyncClient(timeout=10) as http:
        assert all(engine.process is None and engine.alive for engine in cluster.engines)
        decoder = cluster.engine("decode-0")
        body = {"messages": [{"role": "user", "content": "word " * 20}], "max_tokens": 4}
        first = (await http.post(f"{decoder.url}/v1/chat/completions", json=body)).json()
        assert (await http.get(f"{decoder.url}/sim/stats")).json()["local_prefills"] == 1

        with pytest.raises(RuntimeError, match="needs an engine process"):
            await cluster.kill(decoder)
        await cluster.restart(decoder)
        assert decoder.alive and cluster.decode_urls == [decoder.url]
        assert (await http.get(f"{decoder.url}/sim/stats")).json()["local_prefills"] == 0  # a new engine
        again = (await http.post(f"{decoder.url}/v1/chat/completions", json=body)).json()
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert not any(engine.alive for engine in cluster.engines)
    async with httpx.AsyncClient(timeout=10) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"{decoder.url}/health")


async def test_an_engine_in_the_event_loop_that_refuses_its_arguments_says_why(sim_tokenizer: Path) -> None:
    cluster = SimCluster(
        prefill=1, decode=0, tokenizer=sim_tokenizer, in_process=True, extra_args=["--max-model-len", "many"]
    )
    with pytest.raises(EngineStartError, match="invalid int value"):
        await cluster.start()
