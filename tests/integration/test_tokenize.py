"""vLLM's /tokenize and /detokenize through the router: the engine's own answers, behind the router's keys,
limits and tenants, from an engine that can be reached."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster

from .conftest import MODEL, engine_stats, running_router

TEXT = "The quarterly report shows steady growth across every region."
CHAT = {
    "model": MODEL,
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}],
    "return_token_strs": True,
}


@pytest.fixture(scope="module")
async def router(cluster: SimCluster, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - sha256: {hash_key('good-key')}\n"
        f"  - sha256: {hash_key('once-a-minute')}\n    requests_per_minute: 1\n"
    )
    async with running_router(
        prefill_urls=cluster.prefill_urls,
        decode_urls=cluster.decode_urls,
        tokenizer=str(tokenizer_dir),
        api_keys_file=str(keys),
    ) as base_url:
        yield base_url


GOOD = {"Authorization": "Bearer good-key"}


async def post(base_url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return await client.post(path, json=body, headers=headers)


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": TEXT},
        {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True},
        CHAT,
        {**CHAT, "add_generation_prompt": False},
    ],
    ids=["prompt", "prompt-no-specials", "chat", "chat-no-generation-prompt"],
)
async def test_tokenize_answers_as_the_engine_does(router: str, cluster: SimCluster, body: dict[str, Any]) -> None:
    through_router = await post(router, "/tokenize", body, GOOD)
    engine = await post(cluster.decode_urls[0], "/tokenize", body)
    assert through_router.status_code == engine.status_code == 200
    assert through_router.json() == engine.json()
    answer = through_router.json()
    assert answer["count"] == len(answer["tokens"]) > 0
    assert answer["max_model_len"] > answer["count"]
    if body.get("return_token_strs"):
        assert len(answer["token_strs"]) == answer["count"]
    else:
        assert answer["token_strs"] is None


async def test_detokenize_gives_back_the_text_the_engine_gives(router: str, cluster: SimCluster) -> None:
    tokens = (await post(router, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}, GOOD)).json()["tokens"]
    through_router = await post(router, "/detokenize", {"model": MODEL, "tokens": tokens}, GOOD)
    assert through_router.status_code == 200
    assert through_router.json() == {"prompt": TEXT}
    assert through_router.json() == (await post(cluster.decode_urls[1], "/detokenize", {"tokens": tokens})).json()


async def test_a_bad_request_gets_the_engines_own_refusal(router: str, cluster: SimCluster) -> None:
    for path, body in (
        ("/tokenize", {"model": "no-such-model", "prompt": TEXT}),
        ("/tokenize", {"model": MODEL}),
        ("/detokenize", {"tokens": ["one", "two"]}),
    ):
        through_router = await post(router, path, body, GOOD)
        engine = await post(cluster.decode_urls[0], path, body)
        assert through_router.status_code == engine.status_code, (path, body)
        assert 400 <= through_router.status_code < 500
        assert through_router.json() == engine.json()
        assert through_router.json()["error"]["message"]


async def test_keys_and_request_limits_hold_as_for_chat(router: str, cluster: SimCluster) -> None:
    before = sum([(await engine_stats(url))["tokenize_requests"] for url in cluster.prefill_urls + cluster.decode_urls])
    refused = await post(router, "/tokenize", {"prompt": TEXT})
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    assert (await post(router, "/tokenize", {"prompt": TEXT}, {"Authorization": "Bearer wrong"})).status_code == 401

    once = {"Authorization": "Bearer once-a-minute"}
    assert (await post(router, "/tokenize", {"prompt": TEXT}, once)).status_code == 200
    limited = await post(router, "/detokenize", {"tokens": [1, 2]}, once)
    assert limited.status_code == 429
    assert int(limited.headers["retry-after"]) >= 1
    after = sum([(await engine_stats(url))["tokenize_requests"] for url in cluster.prefill_urls + cluster.decode_urls])
    assert after - before == 1, "only the accepted call reached an engine"


async def test_an_engine_that_cannot_be_reached_is_passed_over(
    cluster: SimCluster, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dpd_router.tokenize")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: connections refused
        async with running_router(
            decode_urls=[dead, cluster.decode_urls[0]],
            tokenizer=str(tokenizer_dir),
            model=MODEL,
            # The dead decoder stays in the pool as though its probes passed: each call may try it first.
            health_unhealthy_threshold=1000,
        ) as base_url:
            answers = [await post(base_url, "/tokenize", {"prompt": f"{i} {TEXT}"}) for i in range(4)]
    assert [answer.status_code for answer in answers] == [200] * 4
    tried_dead = [record for record in caplog.records if dead in record.getMessage()]
    assert len(tried_dead) == 2, "the calls took the decoders in turn, the dead one first every other call"


async def test_an_engine_that_never_answers_is_passed_over_within_the_tokenize_timeout(
    cluster: SimCluster, tokenizer_dir: Path
) -> None:
    """It accepts the connection and reads the call, then says nothing: a hung engine, passing its probes."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read(1 << 16)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    hung = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with running_router(
            decode_urls=[hung, cluster.decode_urls[0]],
            tokenizer=str(tokenizer_dir),
            model=MODEL,
            health_unhealthy_threshold=1000,
            tokenize_timeout=0.5,
        ) as base_url:
            started = time.monotonic()
            answers = [await post(base_url, "/tokenize", {"prompt": f"{i} {TEXT}"}) for i in range(2)]
            waited = time.monotonic() - started
    finally:
        server.close()
        for writer in held:
            writer.close()
    assert [answer.status_code for answer in answers] == [200, 200]
    assert waited < 30, "the hung engine cost its tokenize_timeout, not the request timeout"
    assert held, "one of the calls tried the hung engine first"
