"""A text's encoding put together from its words' encodings, kept from the texts seen before.

Where a prompt can be read in part (a byte-level BPE whose heads read as its whole texts' starts, see
`bounds.py` and `LocalTokenizer.reads_heads`), a text cut just before a space that follows a non-space
character encodes as its two sides do, one after the other: no pattern of such a pre-tokenizer matches
across that place (a match holding a non-space character ends before a space), none looks behind, and BPE
merges only within a match. So a text is the chunks between such places, each but the first starting with
its space, and its encoding the chunks' encodings in turn, each as the chunk encodes alone.

Text repeats its words: a chunk seen before costs a dictionary lookup, where the tokenizer's Rust core
spends about a microsecond a word, most of it in its regex pre-tokenizer (a 3 kB chat message: 0.7 ms
encoded, about 0.1 ms from its kept chunks). The chunks not kept are encoded each alone.
LocalTokenizer uses this only where its startup check shows the probe texts encode as the tokenizer
encodes them; tests/unit/test_word_cache.py holds it to the tokenizer over random texts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any, cast

import orjson

# Where a text may be cut (a space right after a non-space character): the pattern finds every such place;
# a text of ASCII characters with no whitespace before any of its spaces has one at every space, which
# str.split finds ten times faster.
BOUNDARY = re.compile(r"(?<=\S) ")
# Every ASCII character str.isspace counts but the space, made a newline (a bytes translation: a few
# microseconds for a 3 kB text, where searching it for each pair of whitespace took 30).
_SPACES_MARKED = bytes(10 if chr(byte).isspace() and byte != 32 else byte for byte in range(256))
# Chunks longer than this are encoded every time, not kept: one such entry would hold as much as many words.
KEPT_CHUNK_CHARS = 128
# What a generation (see _Kept) holds at most, in bytes as counted in `_Kept.put`: a chunk's characters, its
# ids (an int object and a tuple slot each) and the entry around them. Two generations of chunks after a
# text's first and two of first chunks (an eighth as much): about 18 MB at most, however long the chunks
# (tracemalloc: two generations of words of 3-12 letters and two ids each, 43,000 and 25,000 of them, 14 MB).
BYTES_A_GENERATION = 8 << 20
_ENTRY_BYTES = 112  # a dictionary slot, the key's str header, the tuple's header
_ID_BYTES = 36
# Texts longer than this are encoded by the Rust core, which releases the GIL: put together from their kept
# words in a tokenizing thread (about 20 ns a character) they would hold it from the event loop.
WORD_CACHE_MAX_CHARS = 16 * 1024
# A text with more chunks not kept than this is encoded whole (as without the cache, for what encoding
# each alone costs more: about 4 us a call each), and only so many of them are encoded alone and kept.
MOST_ENCODED_APART = 32


class _Kept:
    """Chunks' ids in two generations: the young one takes what is found or encoded; once full it becomes
    the old one (the one before dropped), whose chunks move back to the young one when found."""

    __slots__ = ("limit", "old", "size", "young")

    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes a generation holds (see BYTES_A_GENERATION)
        self.size = 0  # of the young generation
        self.young: dict[str, tuple[int, ...]] = {}
        self.old: dict[str, tuple[int, ...]] = {}

    def from_old(self, chunk: str) -> tuple[int, ...] | None:
        ids = self.old.get(chunk)
        if ids is not None:
            self.put(chunk, ids)
        return ids

    def put(self, chunk: str, ids: tuple[int, ...]) -> None:
        if len(chunk) > KEPT_CHUNK_CHARS:
            return
        size = len(chunk) + _ENTRY_BYTES + _ID_BYTES * len(ids)
        if self.size + size > self.limit:
            self.old, self.young, self.size = self.young, {}, 0
        self.young[chunk] = ids
        self.size += size


class WordCache:
    """Encodings of text chunks kept for the texts that hold them again (see the module's docstring).

    `encode_apart` encodes texts without special tokens, each alone (see encode_apart_of); `encode`
    one text. Used from the event loop and the tokenizing threads alike: a dictionary's get and set are
    each atomic, a value found is right whichever thread kept it, and a lost entry is encoded again."""

    def __init__(
        self,
        encode_apart: Callable[[list[str]], Sequence[Sequence[int]]],
        encode: Callable[[str], list[int]],
        *,
        generation_bytes: int = BYTES_A_GENERATION,
    ) -> None:
        self._encode_apart = encode_apart
        self._encode = encode
        # The chunks after a text's first, by their text without the space they start with; a text's first
        # chunk (no space before it) apart, by its text.
        self._spaced = _Kept(generation_bytes)
        self._first = _Kept(generation_bytes // 8)
        self.hits = 0
        self.misses = 0

    def encode(self, text: str) -> list[int]:
        """The ids of `text` without special tokens, as the tokenizer encodes it."""
        parts = text.split(" ") if text.isascii() and _cut_at_every_space(text) else BOUNDARY.split(text)
        first, rest = parts[0], parts[1:]
        head = self._first.young.get(first) if first else ()
        found: list[tuple[int, ...] | None] = list(map(self._spaced.young.get, rest))
        if head is None or None in found:
            head = self._fill(first, rest, found, head)
            if head is None:
                return self._encode(text)
        else:
            self.hits += len(rest) + 1
        return list(chain(head, chain.from_iterable(cast("list[tuple[int, ...]]", found))))

    def _fill(
        self, first: str, rest: list[str], found: list[tuple[int, ...] | None], head: tuple[int, ...] | None
    ) -> tuple[int, ...] | None:
        """Fill `found` (and return the first chunk's ids) from the old generation and by encoding the chunks
        found in neither; None where more are missing than are encoded apart (the text is encoded whole)."""
        missing: dict[str, None] = {}
        absent = _nones(found)
        for index in absent:
            ids = self._spaced.from_old(rest[index])
            if ids is None:
                missing[rest[index]] = None
            else:
                found[index] = ids
        if head is None:
            head = self._first.from_old(first)
        apart = [" " + part for part in missing]
        if head is None:
            apart.append(first)  # last: see _learn
        self.hits += len(rest) + 1 - len(apart)
        self.misses += len(apart)
        if len(apart) > MOST_ENCODED_APART:
            # Some of them kept all the same, so that a run of new texts still fills the cache, at a bounded
            # cost each.
            self._learn(apart[:MOST_ENCODED_APART], first_last=False)
            return None
        fresh = self._learn(apart, first_last=head is None)
        by_part = dict(zip(missing, fresh, strict=False))  # the spaced chunks come first, in `missing`'s order
        for index in absent:
            if found[index] is None:
                found[index] = by_part[rest[index]]
        return fresh[-1] if head is None else head

    def _learn(self, chunks: list[str], *, first_last: bool) -> list[tuple[int, ...]]:
        """The chunks' encodings, each alone, in turn; kept. Each starts with its space (kept without it), but
        the last where `first_last` says it is a text's first chunk."""
        if not chunks:
            return []
        fresh = [tuple(ids) for ids in self._encode_apart(chunks)]
        for index, (chunk, ids) in enumerate(zip(chunks, fresh, strict=True)):
            if first_last and index == len(chunks) - 1:
                self._first.put(chunk, ids)
            else:
                self._spaced.put(chunk[1:], ids)
        return fresh


def _cut_at_every_space(text: str) -> bool:
    """Whether no space of an ASCII `text` follows a whitespace character: then every one is a cut."""
    marks = text.encode("ascii").translate(_SPACES_MARKED)
    return b"  " not in marks and b"\n " not in marks


def _nones(found: list[Any]) -> list[int]:
    """The places of None in `found`, found by the list's own search (a text's chunks are nearly all kept)."""
    places = []
    at = -1
    try:
        while True:
            at = found.index(None, at + 1)
            places.append(at)
    except ValueError:
        return places


def cut_apart(backend: Any) -> bool:
    """Whether no pattern of the tokenizer's pre-tokenizer looks behind (what comes after a cut could then
    match as it does not alone); a byte-level BPE's shape is checked by `bounds.prompt_bound`."""
    spec = orjson.loads(backend.to_str())
    return "(?<" not in orjson.dumps(spec.get("pre_tokenizer")).decode()


def encode_apart_of(backend: Any) -> Callable[[list[str]], list[Sequence[int]]]:
    """`WordCache`'s `encode_apart` over the Rust core (without special tokens): a call a chunk. Its batch call
    hands even one text to its thread pool and spreads a few over every core, which for words costs more than
    their encoding: 8 words in one batch call, 62 us (85 of CPU); one call each, 35."""

    def encode_apart(texts: list[str]) -> list[Sequence[int]]:
        return [backend.encode(text, add_special_tokens=False).ids for text in texts]

    return encode_apart
