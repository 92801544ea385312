"""Deterministic "sampling": each output token is a function of every token before it, and the seed.

So the same request yields the same text on any engine, whether its prompt was prefilled
locally or its KV came from a prefiller; and, as with a real model, a prompt extended by its
own first output token continues with the same text (LMCache's disaggregated decode relies on it).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from hashlib import blake2b
from typing import Protocol

import orjson

from dpd_sim.kv import token_bytes

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

    def stream(self, prompt_ids: Sequence[int], seed: int, adapter: str | None = None) -> TokenStream:
        """The output tokens of one prompt, in order (another text under a LoRA adapter)."""
        return TokenStream(self, prompt_ids, seed, adapter)

    def pick(self, digest: bytes, banned: Collection[int] = ()) -> int:
        """The candidate the digest points at, or the next one not `banned` (a masked logit)."""
        start = int.from_bytes(digest, "little") % len(self.candidates)
        for offset in range(len(self.candidates)):
            token_id = self.candidates[(start + offset) % len(self.candidates)]
            if token_id not in banned:
                return token_id
        raise ValueError("every candidate token is banned")

    def text(self, token_ids: Iterable[int]) -> str:
        return "".join(self.token_text[token_id] for token_id in token_ids)


class TokenStream:
    """One sequence's next tokens: token i hashes the seeds, the prompt and tokens 0 .. i-1.

    The hash runs over the token ids as one byte string, so `prompt + [t0]` starts where `prompt`
    left off after `t0`: the continuation is the same text.
    """

    __slots__ = ("_hash", "_sampler", "position")

    def __init__(self, sampler: Sampler, prompt_ids: Sequence[int], seed: int, adapter: str | None = None) -> None:
        self._sampler = sampler
        material = f"{seed}|{sampler.engine_seed}".encode()
        if adapter is not None:  # another adapter's weights: another text
            material += f"|{adapter}".encode()
        self._hash = blake2b(digest_size=8, key=material[:64])
        self._hash.update(token_bytes(prompt_ids))
        self.position = 0

    def token(self, index: int, banned: Collection[int] = ()) -> int:
        """Output token `index`, never one of `banned`; tokens are drawn in order, each once."""
        if index != self.position:
            raise ValueError(f"token {index} asked for at position {self.position}")
        token_id = self._sampler.pick(self._hash.copy().digest(), banned)
        self._hash.update(token_bytes((token_id,)))
        self.position += 1
        return token_id
