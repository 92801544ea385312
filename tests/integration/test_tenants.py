"""Tenants with reserved engines are kept apart: their prompts reach only their engines, and another
tenant's burst does not use up their admission budget."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_router.api.auth import hash_key
from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, chat_body, engine_stats, metric, running_router

SHORT = "Hi there."


@pytest.fixture(scope="module")
async def decoders(tokenizer_dir: Path) -> AsyncIterator[SimCluster]:
    """Three decoders: one for the shared pool, one reserved for tenant acme, one for tenant beta
    (slow: a stream there lasts seconds)."""
    slow = {"decode-2": ["--decode-step-base", "0.01"]}
    async with SimCluster(
        in_process=True, prefill=0, decode=3, tokenizer=tokenizer_dir, model=MODEL, engine_args=slow
    ) as engines:
        yield engines


def tenant_settings(decoders: SimCluster, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    shared, acme, beta = decoders.decode_urls
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - sha256: {hash_key('acme-key')}\n    tenant: acme\n"
        f"  - sha256: {hash_key('beta-key')}\n    tenant: beta\n"
        f"  - sha256: {hash_key('public-key')}\n"
    )
    return {
        "decode_urls": [shared],
        "tenants": {"acme": {"decode_urls": [acme]}, "beta": {"decode_urls": [beta]}},
        "api_keys_file": str(keys),
        "model": MODEL,
        **extra,
    }


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


async def tokenize_calls(decoders: SimCluster) -> list[int]:
    return [(await engine_stats(url))["tokenize_requests"] for url in decoders.decode_urls]


async def test_without_a_local_tokenizer_a_tenants_prompts_are_tokenized_on_its_own_engines(
    decoders: SimCluster, tmp_path: Path
) -> None:
    async with (
        running_router(**tenant_settings(decoders, tmp_path)) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        before = await tokenize_calls(decoders)
        for body in (chat_body("acme's confidential plan"), {"model": MODEL, "prompt": "acme's data", "max_tokens": 2}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            assert (await client.post(path, json=body, headers=key("acme-key"))).status_code == 200
        after = await tokenize_calls(decoders)
        shared, acme, beta = (now - then for now, then in zip(after, before, strict=True))
        assert acme == 2, "acme's prompts were counted by acme's decoder"
        assert (shared, beta) == (0, 0), "and reached no engine acme does not own"

        public = {"model": MODEL, "prompt": "public", "max_tokens": 2}
        assert (await client.post("/v1/completions", json=public, headers=key("public-key"))).status_code == 200
        shared_after = (await tokenize_calls(decoders))[0]
        assert shared_after - after[0] == 1, "a key without reserved engines is tokenized on the shared pool"


async def test_a_tenants_tokenize_and_detokenize_reach_only_its_own_engines(
    decoders: SimCluster, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """With a local tokenizer too: /tokenize is the engine's to answer, and acme's text goes to acme's."""
    async with (
        running_router(**tenant_settings(decoders, tmp_path, tokenizer=str(tokenizer_dir))) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        before = await tokenize_calls(decoders)
        answer = await client.post("/tokenize", json={"prompt": "acme's secret"}, headers=key("acme-key"))
        assert answer.status_code == 200
        decoded = await client.post("/detokenize", json={"tokens": answer.json()["tokens"]}, headers=key("acme-key"))
        assert decoded.status_code == 200 and "acme's secret" in decoded.json()["prompt"]
        shared, acme, beta = (now - then for now, then in zip(await tokenize_calls(decoders), before, strict=True))
        assert (shared, acme, beta) == (0, 1, 0)


async def test_a_tenants_burst_fills_its_own_admission_budget_not_anothers(
    decoders: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Each pool admits max_in_flight requests and queues max_queued more: beta holding its two
    slots and asking for a third is refused, while acme and the shared pool are served."""
    settings = tenant_settings(decoders, tmp_path, tokenizer=str(tokenizer_dir), max_in_flight=2, max_queued=0)
    async with (
        running_router(**settings) as base_url,
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
        contextlib.AsyncExitStack() as streams,
    ):
        reading = []  # a stream's iterator, kept: dropping it would close the stream
        for _ in range(2):
            stream = await streams.enter_async_context(
                client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={**chat_body(SHORT, max_tokens=2000, stream=True), "min_tokens": 2000},
                    headers=key("beta-key"),
                )
            )
            assert stream.status_code == 200
            reading.append(stream.aiter_bytes())
            await anext(reading[-1])  # streaming: its slot is taken until it ends
        refused = await client.post("/v1/chat/completions", json=chat_body(SHORT), headers=key("beta-key"))
        assert refused.status_code == 503

        for name in ("acme-key", "acme-key", "public-key"):
            served = await client.post("/v1/chat/completions", json=chat_body(SHORT), headers=key(name))
            assert served.status_code == 200, f"{name}: {served.text}"

        rejected = "dpd_router_admission_rejected_total"
        assert await metric(base_url, rejected, {"reason": "queue_full", "pool": "beta"}) == 1
        assert await metric(base_url, rejected, {"pool": "acme"}) == 0
        assert await metric(base_url, rejected, {"pool": "shared"}) == 0
