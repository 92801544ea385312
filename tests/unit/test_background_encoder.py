"""The whole encodings of prompts planned on their first tokens: batched on one thread, equal to the
tokenizer's own encoding, and bounded (a text beyond the backlog is skipped and counted, not queued)."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from dpd_router.prompt.tokenizer import BackgroundEncoder, LocalTokenizer
from dpd_sim.tokenizer_kit import _WORDS


def text_of(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def local(tokenizer_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(tokenizer_dir, inline_max_chars=1 << 30, threads=1, count_whole=True)


class GatedBackend:
    """An encoding (as LocalTokenizer._encode) whose calls wait for the test to open a gate, and that records
    them."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.gate = threading.Event()
        self.batches: list[list[str]] = []
        self.threads: set[str] = set()

    def __call__(self, text: str, *, special: bool) -> list[int]:
        self.gate.wait(10)
        self.batches.append([text])
        self.threads.add(threading.current_thread().name)
        return list(self._backend.encode_batch_fast([text], add_special_tokens=special)[0].ids)


async def test_texts_waiting_are_taken_at_once_and_encoded_on_one_thread_as_the_tokenizer_encodes_them(
    local: LocalTokenizer,
) -> None:
    backend = local._tokenizer.backend_tokenizer
    gated = GatedBackend(backend)
    encoder = BackgroundEncoder(gated, max_chars=1 << 30)
    jobs: list[int] = []
    encode = encoder._encode
    encoder._encode = lambda texts: jobs.append(len(texts)) or encode(texts)  # type: ignore[method-assign]
    try:
        texts = [text_of(30 + i, i) for i in range(12)]
        first = encoder.submit(texts[0], special=False, started=0.0)
        # The first text is being encoded; the others arrive meanwhile, with and without special tokens.
        rest = [encoder.submit(text, special=i % 2 == 0, started=0.0) for i, text in enumerate(texts[1:], 1)]
        gated.gate.set()
        encoded = await asyncio.gather(first, *rest)
    finally:
        encoder.close()
    assert jobs == [1, 11]  # the first alone; the eleven that arrived meanwhile in one job
    assert gated.batches == [[text] for text in texts]  # one text a call: never spread over every core
    assert len(gated.threads) == 1
    for i, (text, prompt) in enumerate(zip(texts, encoded, strict=True)):
        assert prompt is not None
        want = list(backend.encode(text, add_special_tokens=i != 0 and i % 2 == 0).ids)
        assert list(prompt.token_ids) == want and prompt.num_tokens == len(want)


async def test_a_text_beyond_the_backlog_is_skipped_and_counted_and_an_idle_encoder_takes_any(
    local: LocalTokenizer,
) -> None:
    gated = GatedBackend(local._tokenizer.backend_tokenizer)
    skipped: list[int] = []
    encoder = BackgroundEncoder(gated, max_chars=1000, on_skip=lambda: skipped.append(1))
    try:
        big = encoder.submit("x " * 2000, special=False, started=0.0)  # over the bound, but nothing waits
        small = encoder.submit("a b c", special=False, started=0.0)  # would pass the bound: skipped
        assert small.done() and small.result() is None and skipped == [1]
        gated.gate.set()
        assert (await big) is not None
        assert (await encoder.submit("a b c", special=False, started=0.0)) is not None  # room again
    finally:
        encoder.close()
    assert skipped == [1]


async def test_a_prompt_read_in_part_gets_its_whole_encoding_from_the_background(local: LocalTokenizer) -> None:
    text = text_of(3000, 7)
    whole = local._encode(text, special=True)
    started = asyncio.get_running_loop().time()
    prompts = await asyncio.gather(*(local.encode_rest(text, special=True, started=started) for _ in range(3)))
    assert [None if p is None else list(p.token_ids) for p in prompts] == [whole] * 3
