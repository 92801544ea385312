"""A long prompt is routed on its first tokens: its whole count still reaches the metrics and the log line,
equal to what the engine counted, and the prefix index holds what was read and the prefill answer's ids
(every block, encoded by the router, with `count_whole_prompts`)."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpd_router.prompt.tokenizer import BackgroundEncoder, LocalTokenizer
from dpd_router.request.errors import NoHealthyDecoder
from dpd_router.routing.planner import REACH_HEAD_BLOCKS, Planner
from dpd_router.transfer import base as transfer_base
from dpd_sim.cluster import SimCluster
from dpd_sim.tokenizer_kit import _WORDS

from .conftest import MODEL, metric, openai_client, running_router

BLOCK_SIZE = 16


def reading_router(cluster: SimCluster, tokenizer_dir: Path, **settings: Any) -> AbstractAsyncContextManager[str]:
    """A router over the cluster that plans prompts of 512 tokens and more through a prefiller."""
    return running_router(
        prefill_urls=cluster.prefill_urls,
        decode_urls=cluster.decode_urls,
        tokenizer=str(tokenizer_dir),
        routing_threshold=512,
        block_size=BLOCK_SIZE,
        **settings,
    )


def long_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def answers_without_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefiller's answers read as an engine's that cannot return the prompt's ids."""
    monkeypatch.setattr(transfer_base, "prefill_prompt_ids", lambda payload, prompt_tokens: None)


@pytest.mark.parametrize("ids_in_answer", ["theirs", "none", "foreign"])
async def test_a_long_prompt_read_in_part_is_reported_and_indexed_whole(
    cluster: SimCluster,
    tokenizer_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    ids_in_answer: str,
) -> None:
    """With `count_whole_prompts`: whole by the prefill answer's ids, or, where the answer has none (or ids
    that do not start as the router's own encoding does), by the router's own encoding of the prompt off the
    request's path."""
    caplog.set_level(logging.INFO, logger="dpd_router.request")
    read_in_part: list[str] = []
    encode_rest = LocalTokenizer.encode_rest

    def spy(self: LocalTokenizer, text: str, *, special: bool, started: float) -> asyncio.Future[object]:
        read_in_part.append(text[-20:])
        return encode_rest(self, text, special=special, started=started)  # type: ignore[return-value]

    monkeypatch.setattr(LocalTokenizer, "encode_rest", spy)
    if ids_in_answer == "none":
        answers_without_ids(monkeypatch)
    elif ids_in_answer == "foreign":  # another tokenizer's: as many ids, not the same
        monkeypatch.setattr(transfer_base, "prefill_prompt_ids", lambda payload, prompt_tokens: [7] * prompt_tokens)
    async with reading_router(cluster, tokenizer_dir, count_whole_prompts=True) as base_url:
        client = openai_client(base_url)
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text(4000, 1)}], max_tokens=4
        )
        assert answer.usage is not None
        engine_count = answer.usage.prompt_tokens
        # Routed before it was encoded whole, by the router only where the prefiller did not send its ids.
        assert len(read_in_part) == (0 if ids_in_answer == "theirs" else 1)
        for _ in range(100):  # the trace is reported once the whole encoding is done, just after the answer
            if await metric(base_url, "dpd_router_prompt_tokens_count", {"path": "disaggregated"}) == 1:
                break
            await asyncio.sleep(0.05)
        assert await metric(base_url, "dpd_router_prompt_tokens_sum", {"path": "disaggregated"}) == engine_count
        assert await metric(base_url, "dpd_router_cache_index_blocks", {"index": "prefix"}) == (
            engine_count // BLOCK_SIZE
        )
    logged = [r.fields for r in caplog.records if r.getMessage().startswith("Conditional routing")]  # type: ignore[attr-defined]
    assert [(fields["path"], fields["prompt_tokens"]) for fields in logged] == [("disaggregated", engine_count)]


@pytest.mark.parametrize("stream", [False, True])
async def test_under_a_static_threshold_a_long_prompt_is_never_encoded_whole_by_the_router(
    cluster: SimCluster,
    tokenizer_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """Read only as far as its plan needs, on or off the request's path: counted by the engine's usage (in
    the metrics and the log line), indexed as far as it was read. Nothing reads its whole ids (its next
    decisions read as far as they need), so the prefill answer is not asked for them."""
    caplog.set_level(logging.INFO, logger="dpd_router.request")
    text = long_text(4000, 11)
    read: list[int] = []
    plain = LocalTokenizer._plain

    def spy(self: LocalTokenizer, text: str) -> list[int]:
        read.append(len(text))  # heads, and pieces (the chat template's and the message's)
        return plain(self, text)

    monkeypatch.setattr(LocalTokenizer, "_plain", spy)
    answered_ids: list[bool] = []
    prompt_ids = transfer_base.prefill_prompt_ids

    def ids_of(payload: dict[str, Any], prompt_tokens: int | None) -> list[int] | None:
        answered_ids.append("prompt_token_ids" in payload)
        return prompt_ids(payload, prompt_tokens)

    monkeypatch.setattr(transfer_base, "prefill_prompt_ids", ids_of)
    async with reading_router(cluster, tokenizer_dir, threshold_mode="static", prefill_strategy="roundrobin") as url:
        client = openai_client(url)
        messages = [{"role": "user", "content": text}]
        if stream:
            chunks = await client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [chunk.usage async for chunk in chunks if chunk.usage is not None]
            engine_count = usage[-1].prompt_tokens
        else:
            answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
            assert answer.usage is not None
            engine_count = answer.usage.prompt_tokens
        assert read and max(read) < len(text) / 2  # the router read a head, never the prompt whole
        assert answered_ids == [False], "the prefill answer was not asked for the prompt's ids"
        for _ in range(100):
            if await metric(url, "dpd_router_prompt_tokens_count", {"path": "disaggregated"}) == 1:
                break
            await asyncio.sleep(0.05)
        assert await metric(url, "dpd_router_prompt_tokens_sum", {"path": "disaggregated"}) == engine_count
        # Shown long by its words, it was read only as far as its cached prefixes needed: a few blocks.
        indexed = await metric(url, "dpd_router_cache_index_blocks", {"index": "prefix"})
        assert REACH_HEAD_BLOCKS <= indexed < 512 // BLOCK_SIZE
    logged = [r.fields for r in caplog.records if r.getMessage().startswith("Conditional routing")]  # type: ignore[attr-defined]
    assert [(fields["path"], fields["prompt_tokens"]) for fields in logged] == [("disaggregated", engine_count)]


async def test_a_prompt_the_background_encoder_has_no_room_for_is_counted_by_the_engine(
    cluster: SimCluster, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    encode = BackgroundEncoder._encode

    def held(self: BackgroundEncoder, texts: list[tuple[str, bool]]) -> list[list[int]]:
        gate.wait(30)  # the first prompt's whole encoding runs until the test lets it end
        return encode(self, texts)

    monkeypatch.setattr(BackgroundEncoder, "_encode", held)
    answers_without_ids(monkeypatch)
    async with reading_router(
        cluster, tokenizer_dir, count_whole_prompts=True, tokenize_background_max_chars=1
    ) as base_url:
        client = openai_client(base_url)
        try:
            counts = []
            for seed in (1, 2):  # the second arrives while the first is still being encoded whole
                answer = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": long_text(4000, seed)}], max_tokens=4
                )
                assert answer.usage is not None
                counts.append(answer.usage.prompt_tokens)
            assert await metric(base_url, "dpd_router_background_encodes_skipped_total") == 1
            # Both are reported with the engine's count, the first without waiting for its encoding.
            assert await metric(base_url, "dpd_router_prompt_tokens_count", {"path": "disaggregated"}) == 2
            assert await metric(base_url, "dpd_router_prompt_tokens_sum", {"path": "disaggregated"}) == sum(counts)
            # Only the blocks each plan read are indexed until the first's whole encoding is done.
            indexed = await metric(base_url, "dpd_router_cache_index_blocks", {"index": "prefix"})
            assert 0 < indexed < sum(counts) // BLOCK_SIZE
        finally:
            gate.set()
        for _ in range(100):
            if await metric(base_url, "dpd_router_cache_index_blocks", {"index": "prefix"}) > indexed:
                break
            await asyncio.sleep(0.05)
        assert await metric(base_url, "dpd_router_cache_index_blocks", {"index": "prefix"}) > indexed


async def test_a_long_prompt_sent_again_is_read_only_as_far_as_its_plan_needs(
    cluster: SimCluster, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's context sent again, under a static threshold: its prefix is on the prefiller and the
    decoder that served it, past every token the plan reads, and on no other endpoint of either role, so
    nothing else could take it: the router reads its head, never the whole prompt, and the prefill
    answer's ids index it. (A cache-aware threshold weighs how far the prefix runs: it reads on.)"""
    encoded_whole: list[int] = []
    encode_whole, encode_rest = LocalTokenizer.encode_whole, LocalTokenizer.encode_rest

    async def whole_spy(self: LocalTokenizer, text: str, *, special: bool) -> list[int]:
        encoded_whole.append(len(text))
        return await encode_whole(self, text, special=special)

    def rest_spy(self: LocalTokenizer, text: str, *, special: bool, started: float) -> asyncio.Future[object]:
        encoded_whole.append(len(text))
        return encode_rest(self, text, special=special, started=started)  # type: ignore[return-value]

    monkeypatch.setattr(LocalTokenizer, "encode_whole", whole_spy)
    monkeypatch.setattr(LocalTokenizer, "encode_rest", rest_spy)
    messages = [{"role": "user", "content": long_text(6000, 7)}]
    async with reading_router(cluster, tokenizer_dir, threshold_mode="static") as base_url:
        client = openai_client(base_url)
        for _ in range(3):
            answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
            assert answer.usage is not None
        assert await metric(base_url, "dpd_router_route_decisions_total", {"path": "disaggregated"}) == 3
        assert await metric(base_url, "dpd_router_prompt_tokens_sum", {"path": "disaggregated"}) == (
            3 * answer.usage.prompt_tokens
        )
    assert encoded_whole == []


@pytest.mark.parametrize(
    "settings",
    [{"count_whole_prompts": True}, {"threshold_mode": "cache_aware"}, {"threshold_mode": "static"}],
    ids=["count-whole", "cache-aware", "static"],
)
async def test_a_long_prompt_whose_plan_is_refused_is_still_reported(
    cluster: SimCluster,
    tokenizer_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    settings: dict[str, Any],
) -> None:
    """No decoder to plan on: the 503 is logged and counted, not held for a prefill answer that never comes:
    with its whole count once the prompt is encoded whole (`count_whole_prompts`, or for a cache-aware
    threshold's prefix index), else without a count (no engine counted it)."""
    caplog.set_level(logging.INFO, logger="dpd_router.request")

    def no_decoder(self: Planner, request: object) -> object:
        raise NoHealthyDecoder("No decoder is available to serve this request; try again shortly.")

    monkeypatch.setattr(Planner, "choose_decoder", no_decoder)
    async with (
        reading_router(cluster, tokenizer_dir, **settings) as base_url,
        httpx.AsyncClient(base_url=base_url) as client,
    ):
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": long_text(4000, 3)}], "max_tokens": 4},
        )
        assert answer.status_code == 503
        for _ in range(100):
            if [r for r in caplog.records if r.name == "dpd_router.request"]:
                break
            await asyncio.sleep(0.05)
    logged = [r.fields for r in caplog.records if r.name == "dpd_router.request"]  # type: ignore[attr-defined]
    assert len(logged) == 1 and logged[0]["status"] == 503
    if settings.get("threshold_mode") != "static":
        assert logged[0]["prompt_tokens"] > 512
    else:
        assert logged[0]["prompt_tokens"] is None
