"""A text put together from its words' kept encodings encodes as the tokenizer encodes it (random texts of the
characters where patterns and Unicode classes differ, two byte-level pre-tokenizer patterns, a cache small
enough to drop what it keeps), costs an encoding only for the words not kept, and is used only where the
tokenizer's shape and the startup check allow it."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dpd_router.prompt.tokenizer import LocalTokenizer, read_prompt
from dpd_router.prompt.word_cache import (
    _ENTRY_BYTES,
    BOUNDARY,
    MOST_ENCODED_APART,
    WordCache,
    _cut_at_every_space,
    encode_apart_of,
)
from dpd_router.request.client_request import parse_request
from dpd_sim.tokenizer_kit import _WORDS, SPECIAL_TOKENS
from tests.tokenizer_families import build as build_family

# Llama 3's pattern (Qwen 2's differs in its digits): a pre-tokenizer of its own, beside the simulator's GPT-2 one.
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Characters and runs where a cut could go wrong: every ASCII whitespace (and those str.isspace counts that
# the tokenizer's \s does not), wide spaces, contractions, digits in runs, letters of other scripts, emoji.
PIECES = (
    *"abcXYZ019 .,;'!?-_()\n\t\r\x0b\x0c\x1c\x1f\x85\xa0",
    *("\u2000", "\u3000", "é", "漢", "🙂", "\u2019", "'s", "'S", "  ", "\n\n", " \n", " 123", "4567", "don't"),
    *_WORDS[:50],
    *SPECIAL_TOKENS,  # added tokens inside a text: the tokenizer splits on them first
)


@pytest.fixture(scope="module")
def backends(tokenizer_dir: Path) -> dict[str, Any]:
    """The simulator's byte-level BPE (GPT-2's pattern) and the same vocabulary behind Llama 3's pattern."""
    gpt2 = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).backend_tokenizer
    llama3 = Tokenizer.from_str(gpt2.to_str())
    llama3.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return {"gpt2": gpt2, "llama3": llama3}


def whole(backend: Any, text: str) -> list[int]:
    return list(backend.encode_batch_fast([text], add_special_tokens=False)[0].ids)


def cache_of(backend: Any, **options: Any) -> WordCache:
    return WordCache(encode_apart_of(backend), lambda text: whole(backend, text), **options)


@pytest.mark.parametrize("pattern", ["gpt2", "llama3"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(st.sampled_from(PIECES), max_size=40).map("".join), min_size=1, max_size=6))
def test_a_text_from_its_kept_words_encodes_as_the_tokenizer_encodes_it(
    backends: dict[str, Any], pattern: str, texts: list[str]
) -> None:
    backend = backends[pattern]
    words = cache_of(backend, generation_bytes=2000)  # about a dozen chunks: what is kept is dropped as it goes
    for text in texts + texts:  # the second time, from what was kept
        assert words.encode(text) == whole(backend, text), repr(text)


def test_a_text_of_words_seen_before_encodes_only_its_new_ones(backends: dict[str, Any]) -> None:
    backend = backends["gpt2"]
    apart: list[list[str]] = []
    encode_apart = encode_apart_of(backend)

    def spy(texts: list[str]) -> list[Any]:
        apart.append(texts)
        return encode_apart(texts)

    wholes: list[str] = []

    def encode_whole(text: str) -> list[int]:
        wholes.append(text)
        return whole(backend, text)

    words = WordCache(spy, encode_whole)
    rng = random.Random(3)
    many = " ".join(_WORDS[:60]) + "."  # more words than are encoded apart: encoded whole, some of them kept
    assert words.encode(many) == whole(backend, many)
    assert wholes == [many]
    assert len(apart[0]) == MOST_ENCODED_APART

    words = WordCache(spy, encode_whole)
    first = " ".join(rng.choice(_WORDS[100:120]) for _ in range(200)) + "."
    assert words.encode(first) == whole(backend, first)
    apart.clear()
    for turn in range(5):
        text = f"Turn {turn}: " + " ".join(rng.choice(_WORDS[100:120]) for _ in range(200)) + " again."
        assert words.encode(text) == whole(backend, text)
    # After the first text, a turn encodes its own few new words only, each alone.
    assert sorted(chunk for texts in apart for chunk in texts) == sorted(
        ["Turn", " again.", *(f" {turn}:" for turn in range(5))]
    )
    assert wholes == [many]


def test_a_long_chunk_is_encoded_each_time_not_kept(backends: dict[str, Any]) -> None:
    backend = backends["gpt2"]
    words = cache_of(backend)
    text = "word " + "x" * 300 + " word"
    for _ in range(2):
        assert words.encode(text) == whole(backend, text)
    assert words.misses == 3 + 1  # the first word, the long one twice, the last word once


def test_what_is_kept_stays_within_two_generations_of_its_bytes(backends: dict[str, Any]) -> None:
    backend = backends["gpt2"]
    words = cache_of(backend, generation_bytes=4000)
    for index in range(300):
        text = " ".join(f"w{index}x{other}" for other in range(20))  # every word new
        assert words.encode(text) == whole(backend, text)
    for kept in (words._spaced, words._first):
        assert kept.size <= kept.limit
        # Each entry counts at least its overhead: no more of them than two generations of that hold.
        assert len(kept.young) + len(kept.old) <= 2 * kept.limit // _ENTRY_BYTES
    assert len(words._spaced.old) > 0  # the young generation filled and was turned old


async def test_the_router_reads_a_chat_prompt_from_its_kept_words_on_the_event_loop(tokenizer_dir: Path) -> None:
    local = LocalTokenizer.load(tokenizer_dir, inline_max_chars=2048, threads=1)
    assert "words are kept" in local.reading()
    rng = random.Random(7)
    content = " ".join(rng.choice(_WORDS) for _ in range(500))  # about 3,000 characters
    assert 2048 < len(content) < 2 * 2048
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    request = parse_request("chat", orjson.dumps(body))
    plain = LocalTokenizer.load(tokenizer_dir, inline_max_chars=2048, threads=1, word_cache=False)
    reference = await plain.tokenize(request)
    plain.close()
    threads: list[str] = []
    original = local._plain

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args)

    local._plain = spy  # type: ignore[method-assign]
    reader = await local.reader(request)
    assert reader is not None
    prompt = await read_prompt(reader, lambda prompt: None, None)  # read to its end
    assert (list(prompt.token_ids), prompt.num_tokens) == (list(reference.token_ids), reference.num_tokens)
    assert threads and set(threads) == {threading.current_thread().name}, "read on the event loop"
    local.close()


@pytest.mark.parametrize("family", ["sentencepiece", "metaspace"])
def test_other_families_and_a_pattern_that_looks_behind_keep_no_words(
    family: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    local = LocalTokenizer.load(build_family(family, tmp_path / family), inline_max_chars=2048, threads=1)
    assert local._words is None
    local.close()
    # The simulator's tokenizer with a pattern that looks behind: its cuts are not proven.
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"(?<=\S)\s+|\S+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    behind = PreTrainedTokenizerFast(tokenizer_object=backend)  # type: ignore[no-untyped-call]
    behind.chat_template = tokenizer.chat_template
    local = LocalTokenizer(behind, inline_max_chars=2048, threads=1)
    assert local._words is None
    local.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(PIECES), max_size=60).map("".join))
def test_a_text_prompt_from_its_kept_words_encodes_with_the_post_processors_tokens(
    kept: LocalTokenizer, text: str
) -> None:
    """A text prompt (the post-processor's BOS before it) whole, and each head the reader may cut: its tokens
    start the whole encoding, and it counts as the head encoded with its BOS does."""
    assert kept._affixes is not None
    whole = kept._tokenizer.encode(text, add_special_tokens=True)
    assert kept._encode(text, special=True) == whole
    for match in BOUNDARY.finditer(text):
        head = kept._head(text, match.start(), True)
        assert list(head.ids) == whole[: len(head.ids)]
        assert head.count == len(kept._tokenizer.encode(text[: match.start()], add_special_tokens=True))
        assert head.end == match.start()


@pytest.fixture(scope="module")
def kept(tokenizer_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(tokenizer_dir, inline_max_chars=2048, threads=1)


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet=st.characters(max_codepoint=127), max_size=40))
def test_an_ascii_text_is_cut_at_every_space_only_where_the_pattern_cuts_it_so(text: str) -> None:
    """The fast split (at every space) is taken only where each space but one starting the text (a cut before
    nothing) follows a non-space character, as the pattern's cuts do."""
    after_space = any(text[at - 1].isspace() for at in range(1, len(text)) if text[at] == " ")
    assert _cut_at_every_space(text) is not after_space


async def test_the_background_encoder_encodes_by_the_rust_core_and_a_tokenizing_thread_from_the_kept_words(
    tokenizer_dir: Path,
) -> None:
    """The background encoder's thread, whole prompts one after another off the request's path, leaves the GIL
    to the event loop while the Rust core encodes: it keeps no words. A head read in a tokenizing thread, on the
    request's path, does."""
    local = LocalTokenizer.load(tokenizer_dir, inline_max_chars=100, threads=1)
    words = local._words
    assert words is not None
    before = words.hits + words.misses
    text = " ".join(_WORDS[:400])  # past twice the inline size: a tokenizing thread
    prompt = await local.encode_rest(text, special=False, started=0.0)
    assert prompt is not None and list(prompt.token_ids) == local._tokenizer.encode(text, add_special_tokens=False)
    assert words.hits + words.misses == before
    other = " ".join(_WORDS[400:800])  # not one the piece cache kept
    assert await local.encode_whole(other, special=False) == local._tokenizer.encode(other, add_special_tokens=False)
    assert words.hits + words.misses > before
    local.close()
