"""The simulator's LMCache and SGLang pieces: autoregressive sampling, the receive buffer, bootstrap rooms."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dpd_sim.bootstrap import (
    Bootstrap,
    BootstrapError,
    BootstrapRooms,
    BootstrapServer,
    bootstraps_from_body,
    fetch_kv,
)
from dpd_sim.gpu import TimingModel
from dpd_sim.kv import prompt_digest
from dpd_sim.lmcache_pd import BufferFull, DisaggSpec, DisaggSpecError, ReceiveBuffer
from dpd_sim.ports import free_port
from dpd_sim.sampler import Sampler

from .conftest import EngineFactory
from .test_sim_engine_api import sse_events


def test_a_prompt_extended_by_its_first_token_continues_with_the_same_text(sim_tokenizer: Path) -> None:
    sampler = Sampler(AutoTokenizer.from_pretrained(str(sim_tokenizer)).backend_tokenizer, engine_seed=0)
    prompt = list(range(40, 140))
    whole = sampler.stream(prompt, seed=3)
    direct = [whole.token(i) for i in range(8)]
    continued = sampler.stream([*prompt, direct[0]], seed=3)
    assert [continued.token(i) for i in range(7)] == direct[1:]
    other_seed = sampler.stream(prompt, seed=4)
    assert [other_seed.token(i) for i in range(8)] != direct
    with pytest.raises(ValueError):
        sampler.stream(prompt, seed=3).token(1)  # tokens come in order


def test_bootstrap_fields_give_a_room_per_prompt() -> None:
    body = {"bootstrap_host": "p", "bootstrap_port": 8998, "bootstrap_room": 10}
    assert bootstraps_from_body(body, 2) == [Bootstrap("p", 8998, 10), Bootstrap("p", 8998, 11)]
    lists = {"bootstrap_host": ["p", "q"], "bootstrap_port": [1, 2], "bootstrap_room": [5, 9]}
    assert bootstraps_from_body(lists, 2) == [Bootstrap("p", 1, 5), Bootstrap("q", 2, 9)]
    assert bootstraps_from_body({}, 1) is None
    for bad in ({"bootstrap_host": "p"}, {**body, "bootstrap_room": -1}, {**lists, "bootstrap_room": [1]}):
        with pytest.raises(ValueError):
            bootstraps_from_body(bad, 2)


def test_disagg_spec_needs_one_port_pair_per_rank() -> None:
    spec = {"req_id": "r", "receiver_host": "h", "receiver_init_port": [1, 2], "receiver_alloc_port": [3, 4]}
    assert DisaggSpec.from_params({"disagg_spec": spec}).init_ports == (1, 2)
    with pytest.raises(DisaggSpecError):
        DisaggSpec.from_params({"disagg_spec": {**spec, "receiver_alloc_port": [3]}})


def test_pushed_kv_is_found_once_every_rank_has_it_and_only_once() -> None:
    buffer = ReceiveBuffer(ranks=2)
    prompt = [7, 8, 9]
    buffer.store(prompt, rank=0)
    assert buffer.take([*prompt, 42]) == 0, "one rank of two"
    buffer.store(prompt, rank=1)
    assert buffer.take([7, 8, 10, 42]) == 0, "another prompt"
    assert buffer.take([*prompt, 42]) == 3
    assert buffer.take([*prompt, 42]) == 0, "used up"


def test_a_full_receive_buffer_refuses_pushes_and_never_evicts() -> None:
    buffer = ReceiveBuffer(ranks=1, capacity_tokens=10)
    buffer.store([1, 2, 3, 4], rank=0)
    buffer.store([5, 6, 7, 8], rank=0)
    with pytest.raises(BufferFull):
        buffer.store([9, 10, 11], rank=0)
    assert (len(buffer), buffer.tokens, buffer.refused) == (2, 8, 1), "nothing was dropped to make room"
    assert buffer.holds([1, 2, 3, 4, 99]) and buffer.take([1, 2, 3, 4, 99]) == 4
    buffer.store([9, 10, 11], rank=0)  # a decode took an entry: room again
    assert buffer.tokens == 7


def test_min_tokens_masks_stop_tokens_as_a_banned_logit(sim_tokenizer: Path) -> None:
    sampler = Sampler(AutoTokenizer.from_pretrained(str(sim_tokenizer)).backend_tokenizer, engine_seed=0)
    prompt = list(range(40, 140))
    first = sampler.stream(prompt, seed=3).token(0)
    masked = sampler.stream(prompt, seed=3).token(0, banned={first})
    assert masked != first and masked in sampler.token_text


async def test_a_decoder_gets_its_rooms_kv_over_the_bootstrap_socket() -> None:
    rooms = BootstrapRooms()
    server = BootstrapServer("127.0.0.1", free_port(), rooms, TimingModel(), wait=0.5)
    await server.start()
    try:
        prompt = [1, 2, 3, 4]
        # The decoder may come before the prefiller has computed the prompt.
        fetching = asyncio.ensure_future(fetch_kv(Bootstrap("127.0.0.1", server.port, 77), prompt_digest(prompt), 5))
        await asyncio.sleep(0.05)
        assert not fetching.done()
        rooms.computed(77, prompt_digest(prompt), len(prompt))
        assert await fetching == 4
        assert await rooms.handed_over([77], within=1.0)

        rooms.computed(78, prompt_digest(prompt), len(prompt))
        with pytest.raises(BootstrapError, match="another prompt"):
            await fetch_kv(Bootstrap("127.0.0.1", server.port, 78), prompt_digest([9, 9]), 5)
        with pytest.raises(BootstrapError, match="no prefill"):
            await fetch_kv(Bootstrap("127.0.0.1", server.port, 79), prompt_digest(prompt), 5)
        assert not await rooms.handed_over([80], within=0.05), "nobody came for it"
    finally:
        await server.close()
    with pytest.raises(BootstrapError, match="unreachable"):
        await fetch_kv(Bootstrap("127.0.0.1", server.port, 1), "d", 1)


async def test_a_stop_token_ends_the_answer_unless_min_tokens_forbids_it(engine: EngineFactory) -> None:
    async with engine() as e:
        prompt = list(range(200, 260))
        plain = (await e.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})).json()
        first = e.core.sampler.stream(prompt, seed=0).token(0)
        stopped = {"prompt": prompt, "max_tokens": 4, "stop_token_ids": [first]}
        whole = (await e.client.post("/v1/completions", json=stopped)).json()
        streamed = await e.client.post("/v1/completions", json={**stopped, "stream": True})
        held = (await e.client.post("/v1/completions", json={**stopped, "min_tokens": 1})).json()
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("", "stop", first)
    assert whole["usage"]["completion_tokens"] == 1, "the stop token counts, its text is not output"
    last = [event for event in sse_events(streamed.text) if event != "[DONE]"][-1]["choices"][0]
    assert (last["text"], last["finish_reason"], last["stop_reason"]) == ("", "stop", first)
    assert held["choices"][0]["finish_reason"] == "length" and held["usage"]["completion_tokens"] == 4
    assert held["choices"][0]["text"] != plain["choices"][0]["text"], "another first token was drawn"


async def test_an_sglang_decode_mode_server_aborts_a_request_without_a_room(engine: EngineFactory) -> None:
    async with engine(role="decode", bootstrap_required=True) as e:
        response = await e.client.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers={"X-Request-Id": "plain"}
        )
        stats = (await e.client.get("/sim/stats")).json()
    assert response.status_code == 500 and "bootstrap" in response.json()["error"]["message"]
    assert [(r["request_id"], r["status"]) for r in stats["recent"]] == [("plain", "error")]
