"""A prompt's bytes bound its tokens for every tokenizer family the bound is proven for (byte-level BPE,
SentencePiece-style BPE, WordPiece), so a prompt the bound settles is routed with nothing encoded; shapes
that prove nothing are counted whole."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers

from dpd_router.config import load_settings
from dpd_router.pool.pool import Pool
from dpd_router.prompt.bounds import BYTE_LEVEL, SENTENCEPIECE, WIDE_SPACES, WORDPIECE, Bound, prompt_bound, words_in
from dpd_router.prompt.tokenizer import LocalTokenizer, Prompt, PromptReader, read_prompt, utf8_size
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.client_request import parse_request
from dpd_router.routing.planner import build_planner
from tests.tokenizer_families import FAMILIES, build
from tests.unit.test_prompt_reader import spy_encodings, text_of

EXPECTED = {
    "byte": Bound(BYTE_LEVEL, specials=1, heads=True, words=True),
    # Llama 2's shape: `▁` put before each piece by the normalizer; its vocabulary keeps to words.
    "sentencepiece": Bound(SENTENCEPIECE, specials=1, extra=1, heads=True, words=True),
    "metaspace": Bound(SENTENCEPIECE, specials=1, extra=1, heads=True, words=True),
    # Tokens such as "o▁" run into a space: a head's merges could differ from the whole's.
    "crossing": Bound(SENTENCEPIECE, specials=1, extra=1),
    "wordpiece": Bound(WORDPIECE, specials=2),
}


@pytest.fixture(scope="module")
def families(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LocalTokenizer]:
    """Each family's tokenizer as the router loads it by default (nothing encoded past a decision)."""
    built = {family: build(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}
    return {
        family: LocalTokenizer.load(directory, inline_max_chars=2048, threads=1)
        for family, directory in {"byte": tokenizer_dir, **built}.items()
    }


def test_each_family_proves_what_its_shape_allows_and_its_startup_check_confirms(
    families: dict[str, LocalTokenizer],
) -> None:
    for family, tokenizer in families.items():
        assert tokenizer.bound == EXPECTED[family], family
        assert tokenizer.reads_heads == EXPECTED[family].heads, family
        assert tokenizer.words_bound == EXPECTED[family].words, family
        said = tokenizer.reading()  # the startup log's words
        assert said.startswith(EXPECTED[family].kind) and ("read in part" in said) == EXPECTED[family].heads


def reshaped(tokenizer: LocalTokenizer, change: Any) -> Any:
    """The tokenizer's Rust core with its `tokenizer.json` changed by `change` (a function of the spec)."""
    spec = json.loads(tokenizer._backend.to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def test_a_shape_that_proves_nothing_has_every_prompt_counted_whole(families: dict[str, LocalTokenizer]) -> None:
    byte, sentencepiece, wordpiece = families["byte"], families["sentencepiece"], families["wordpiece"]

    def nfkc(spec: dict[str, Any]) -> None:  # one character may become eighteen (U+FDFA)
        spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, spec["normalizer"]]}

    def no_mark(spec: dict[str, Any]) -> None:  # a space would be `▁`'s three byte tokens
        del spec["model"]["vocab"]["\u2581"]
        spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "\u2581" not in "".join(m)]

    def stripping(spec: dict[str, Any]) -> None:  # an added token that takes the spaces beside it
        spec["added_tokens"][0]["lstrip"] = True

    def dropout(spec: dict[str, Any]) -> None:  # not repeatable
        spec["model"]["dropout"] = 0.1

    def split_words(spec: dict[str, Any]) -> None:  # not a shape the bound is proven for
        spec["pre_tokenizer"] = {"type": "Whitespace"}

    def byte_nfkc(spec: dict[str, Any]) -> None:
        spec["normalizer"] = {"type": "NFKC"}

    assert prompt_bound(reshaped(byte, byte_nfkc)) is None
    for change in (nfkc, no_mark, stripping, dropout, split_words):
        assert prompt_bound(reshaped(sentencepiece, change)) is None, change.__name__

    def ignore_merges(spec: dict[str, Any]) -> None:  # a head may be one vocabulary token the whole text is not
        spec["model"]["ignore_merges"] = True

    assert prompt_bound(reshaped(sentencepiece, ignore_merges)) == replace(EXPECTED["sentencepiece"], heads=False)
    assert prompt_bound(reshaped(wordpiece, nfkc)) is None
    assert prompt_bound(reshaped(wordpiece, stripping)) is None
    unigram = Tokenizer.from_str(json.dumps({**json.loads(sentencepiece._backend.to_str()), "model": {
        "type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0], ["\u2581", -1.0], ["a", -2.0]],
        "byte_fallback": False}}))  # fmt: skip
    assert prompt_bound(unigram) is None


texts = st.builds(text_of, st.integers(1, 600), st.integers(0, 2**32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, special=st.booleans(), data=st.data())
def test_a_texts_bytes_bound_its_tokens_its_words_bound_them_from_below_and_its_heads_start_them(
    families: dict[str, LocalTokenizer], text: str, special: bool, data: st.DataObject
) -> None:
    """Over random texts (words, digits, code, CJK, emoji, accents, control characters, added tokens of the
    template, odd spaces), for every family: the whole count is within the bound; where words bound it, at
    least the words; where heads are read, every head read starts the whole encoding."""
    for family, tokenizer in families.items():
        bound = tokenizer.bound
        assert bound is not None
        ids = tokenizer._encode(text, special=special)
        assert len(ids) <= bound.at_most(utf8_size(text), special=special), family
        if tokenizer.words_bound:
            assert len(text.split()) + (bound.specials if special else 0) <= len(ids), family
        if not tokenizer.reads_heads:
            continue
        prompts = asyncio.run(heads_read(tokenizer, text, special=special, step=data.draw(st.integers(1, 400))))
        for prompt in prompts:
            known = list(prompt.token_ids)
            assert known == ids[: len(known)], family
            assert prompt.at_most is None or len(ids) <= prompt.at_most, family
        assert list(prompts[-1].token_ids) == ids, family


# Pieces of text around every kind of space str.split() splits on, ASCII and wider, runs of them included.
_WORDS_AND_SPACES = st.lists(
    st.sampled_from(
        [" ", "  ", "\t", "\n\r", "\x1c", "\x0b", *WIDE_SPACES, "a", "word", "é", "日本", "\U0001f600", "x" * 300]
    ),
    max_size=600,
)


@settings(max_examples=300, deadline=None)
@given(pieces=_WORDS_AND_SPACES, most=st.integers(1, 700))
def test_words_are_counted_as_a_split_counts_them_as_far_as_asked(pieces: list[str], most: int) -> None:
    text = "".join(pieces)
    assert min(words_in(text, most), most) == min(len(text.split()), most)


def test_the_wide_spaces_are_every_space_above_ascii_a_split_splits_on() -> None:
    assert list(WIDE_SPACES) == [chr(code) for code in range(128, 0x110000) if chr(code).isspace()]


async def heads_read(tokenizer: LocalTokenizer, text: str, *, special: bool, step: int) -> list[Prompt]:
    """The prompts a reader of `text` makes, reading on by `step` tokens and twice as far each time."""
    bound = tokenizer.bound
    assert bound is not None
    specials = bound.specials if special else 0
    reader = PromptReader(tokenizer, text, special=special, specials=specials, extra=bound.extra, started=0.0)
    prompts = [reader.prompt]
    while prompts[-1].at_most is not None:
        prompts.append(await reader.more(step))
        step *= 2
    return prompts


def test_a_bert_normalizer_makes_no_character_into_more_characters_than_it_has_bytes() -> None:
    """What the WordPiece bound stands on (a WordPiece token stands for at least one character of the
    normalized text, or for a whole word): checked for every code point, in every setting of the
    normalizer. The normalizer works a character at a time, so a text's characters add up."""
    code_points = [chr(point) for point in range(0x110000) if not 0xD800 <= point <= 0xDFFF and point != ord("|")]
    for lowercase in (False, True):
        for strip_accents in (False, True):
            normalizer = normalizers.BertNormalizer(
                clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
            )
            for start in range(0, len(code_points), 65536):
                chunk = code_points[start : start + 65536]
                # "|" (one character, one byte) is left as it is, and no other character becomes one: the
                # chunk splits back into its characters.
                normalized = normalizer.normalize_str("|".join(chunk)).split("|")
                assert len(normalized) == len(chunk)
                for char, out in zip(chunk, normalized, strict=True):
                    assert len("".join(out.split())) <= len(char.encode("utf-8")), hex(ord(char))


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_prompt_the_bound_settles_is_routed_with_nothing_encoded_and_a_longer_one_is_read_as_its_family_allows(
    families: dict[str, LocalTokenizer], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = families[family]
    encoded = spy_encodings(monkeypatch)
    for pieces, path in ((400, "direct"), (10000, "disaggregated")):
        settings = load_settings(
            # One decoder to take a short prompt; two for a long one, whose first blocks tell which of them
            # holds more of it (with one decoder, a prompt its words show long has nothing read).
            decode_urls=[f"http://127.0.0.1:82{i:02d}" for i in range(1 if path == "direct" else 2)],
            prefill_urls=["http://127.0.0.1:8100"],
            routing_threshold=4096,
            threshold_mode="static",
            prefill_strategy="roundrobin",
        )
        planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
        encoded.clear()
        text = text_of(pieces, 1)
        assert (utf8_size(text) < 4000) == (path == "direct")
        request = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": text}]}))
        reader = await tokenizer.reader(request)
        assert reader is not None
        read = await read_prompt(reader, planner.tokens_to_settle, None)
        assert planner.plan(read).path == path
        if path == "direct":
            assert encoded == [] and list(read.token_ids) == []  # settled by its bytes alone
        elif tokenizer.reads_heads:
            assert max(encoded) < len(text) // 2  # a head as far as the threshold, not the prompt
        else:
            assert read.at_most is None and len(encoded) == 1  # encoded whole, once
