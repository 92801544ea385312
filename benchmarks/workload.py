"""What the load generator sends: prompt lengths in genai-bench's notation, mixtures, exact-length prompts.

`D(4096,256)` is 4096 prompt tokens and 256 output tokens; `U(128,1024)/(64,256)` draws both
uniformly; a mixture names weighted classes, `short:0.7:U(128,1024)/(128,128),long:0.3:D(8192,128)`.
Prompt lengths count the message content's tokens under the simulator's tokenizer (the chat
template adds a few more), as genai-bench counts them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from dpd_sim.tokenizer_kit import _WORDS

_DIST = re.compile(
    r"^\s*(?P<kind>[DU])\((?P<a>\d+),(?P<b>\d+)\)(?:/\((?P<c>\d+),(?P<d>\d+)\))?\s*$",
)


@dataclass(frozen=True)
class Lengths:
    """One class of request: prompt and output token counts, fixed (D) or uniform (U)."""

    kind: str
    in_lo: int
    in_hi: int
    out_lo: int
    out_hi: int

    @classmethod
    def parse(cls, spec: str) -> Lengths:
        match = _DIST.match(spec.replace(" ", ""))
        if match is None:
            raise ValueError(f"not a length spec: {spec!r} (want D(in,out) or U(lo,hi)/(lo,hi))")
        a, b = int(match["a"]), int(match["b"])
        if match["kind"] == "D":
            if match["c"] is not None:
                raise ValueError(f"D takes (in,out): {spec!r}")
            return cls("D", a, a, b, b)
        if match["c"] is None:
            raise ValueError(f"U needs output lengths, U(lo,hi)/(lo,hi): {spec!r}")
        return cls(
            "U", min(a, b), max(a, b), min(int(match["c"]), int(match["d"])), max(int(match["c"]), int(match["d"]))
        )

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(self.in_lo, self.in_hi), rng.randint(self.out_lo, self.out_hi)

    def __str__(self) -> str:
        if self.kind == "D":
            return f"D({self.in_lo},{self.out_lo})"
        return f"U({self.in_lo},{self.in_hi})/({self.out_lo},{self.out_hi})"


@dataclass(frozen=True)
class RequestClass:
    name: str
    weight: float
    lengths: Lengths


@dataclass(frozen=True)
class Workload:
    """Weighted request classes; `draw` is deterministic for a seed."""

    classes: tuple[RequestClass, ...]
    spec: str = ""

    @classmethod
    def parse(cls, spec: str) -> Workload:
        """`D(in,out)` alone (one class named after it), or `name:weight:SPEC,name:weight:SPEC,...`."""
        spec = spec.strip()
        if ":" not in spec:
            lengths = Lengths.parse(spec)
            return cls((RequestClass(str(lengths), 1.0, lengths),), spec)
        classes = []
        for part in re.split(r",(?=[A-Za-z_][\w-]*:)", spec):
            name, weight, lengths = part.split(":", 2)
            classes.append(RequestClass(name.strip(), float(weight), Lengths.parse(lengths)))
        if sum(c.weight for c in classes) <= 0:
            raise ValueError(f"weights must add up to more than 0: {spec!r}")
        return cls(tuple(classes), spec)

    def draw(self, count: int, seed: int = 0) -> list[tuple[str, int, int]]:
        """`count` requests as (class name, prompt tokens, output tokens), in a seeded random order."""
        rng = random.Random(seed)
        names = [c.name for c in self.classes]
        weights = [c.weight for c in self.classes]
        by_name = {c.name: c for c in self.classes}
        # Exact class proportions (largest remainder), then shuffled: small runs keep the mix.
        total = sum(weights)
        quotas = [count * w / total for w in weights]
        counts = [int(q) for q in quotas]
        for index in sorted(range(len(names)), key=lambda i: quotas[i] - counts[i], reverse=True)[
            : count - sum(counts)
        ]:
            counts[index] += 1
        drawn = [name for name, n in zip(names, counts, strict=True) for _ in range(n)]
        rng.shuffle(drawn)
        return [(name, *by_name[name].lengths.draw(rng)) for name in drawn]


FINANCE_MIX_SCALED = "short:0.70:U(128,1023)/(128,128),long:0.25:U(4096,16384)/(128,128),huge:0.05:D(32768,128)"
"""The seed's finance mix (70% under 1,024 tokens, 25% 4k-32k, 5% over 64k), scaled for this machine:
the long class is cut to 4k-16k and the huge one to 32k, and every answer is 128 tokens."""


@dataclass
class PromptFactory:
    """Makes chat prompts whose content is exactly N tokens under a tokenizer, each unique from its
    first token (so neither the engines' prefix caches nor the router's prefix index match across
    requests), or sharing one of `shared_docs` long documents as a prefix when asked."""

    tokenizer_dir: Path
    seed: int = 0
    _tokenizer: object = field(default=None, init=False, repr=False)
    _docs: dict[tuple[int, int], str] = field(default_factory=dict, init=False, repr=False)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(Path(self.tokenizer_dir) / "tokenizer.json"))
        return self._tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, tokens: int, key: str) -> str:
        """Text of exactly `tokens` tokens (when the tokenizer allows), starting with `key`."""
        rng = random.Random(f"{self.seed}/{key}")
        head = f"Request {key}: "
        words = [head]
        # The simulator's tokenizer was trained on these words: about 1.2 tokens each with a space.
        for _ in range(max(tokens, 1) + 16):
            words.append(rng.choice(_WORDS) + " ")
        text = "".join(words)
        return self._cut(text, tokens, rng)

    def _cut(self, text: str, tokens: int, rng: random.Random) -> str:
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        while len(encoding.ids) < tokens:
            text += " ".join(rng.choice(_WORDS) for _ in range(tokens)) + " "
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
        text = text[: encoding.offsets[tokens - 1][1]] if tokens > 0 else ""
        for _ in range(8):
            have = self.count(text)
            if have == tokens:
                break
            if have > tokens:
                text = text[:-1]
            else:
                text += " " + rng.choice(_WORDS)
        return text

    def shared_doc(self, doc: int, tokens: int) -> str:
        key = (doc, tokens)
        if key not in self._docs:
            self._docs[key] = self.text(tokens, f"doc-{doc}")
        return self._docs[key]

    def prompt(self, index: int, tokens: int, *, doc: int | None = None, doc_tokens: int = 0) -> str:
        """The content of request `index`: unique, or a shared document then a unique question."""
        if doc is None or doc_tokens <= 0 or doc_tokens >= tokens:
            return self.text(tokens, f"{self.seed}-{index}")
        question = self.text(tokens - doc_tokens, f"{self.seed}-{index}")
        return self.shared_doc(doc, doc_tokens) + "\n" + question
