"""Deterministic "sampling": output token i is a function of the prompt's token ids, the seed and i.

So the same request yields the same text on any engine, whether its prompt was prefilled
locally or its KV came from a prefiller.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from hashlib import blake2b
from typing import Protocol

import orjson

from dpd_router.sim.kv import token_bytes

_WORD = re.compile(r" [a-z]{2,12}")


class TokenDecoder(Protocol):
    def get_vocab_size(self) -> int: ...

    def decode(self, ids: list[int]) -> str: ...


class Sampler:
    """Picks readable whole-word tokens (" river", " cache") from the vocabulary by stable hashes."""

    def __init__(self, decoder: TokenDecoder, engine_seed: int = 0) -> None:
        self.engine_seed = engine_seed
        self.token_text: dict[int, str] = {}
        for token_id in range(decoder.get_vocab_size()):
            text = decoder.decode([token_id])
            if _WORD.fullmatch(text):
                self.token_text[token_id] = text
        if not self.token_text:
            raise ValueError("the tokenizer has no whole-word tokens to sample from")
        self.candidates: list[int] = sorted(self.token_text)
        self.token_json: dict[int, bytes] = {t: orjson.dumps(text) for t, text in self.token_text.items()}

    def key(self, prompt_ids: Sequence[int], seed: int) -> bytes:
        """The per-prompt part of every output token's hash."""
        material = token_bytes(prompt_ids) + b"|" + str(seed).encode() + b"|" + str(self.engine_seed).encode()
        return blake2b(material, digest_size=16).digest()

    def token(self, key: bytes, index: int) -> int:
        digest = blake2b(key + index.to_bytes(4, "little"), digest_size=8).digest()
        return self.candidates[int.from_bytes(digest, "little") % len(self.candidates)]

    def text(self, token_ids: Iterable[int]) -> str:
        return "".join(self.token_text[token_id] for token_id in token_ids)
