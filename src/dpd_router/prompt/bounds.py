"""What a tokenizer's shape proves about a text's tokens before anything is encoded.

Three families of tokenizers make no more tokens of a text than it has UTF-8 bytes, give or take a few
they add themselves:

- a byte-level BPE (GPT-2, Llama 3, Qwen, Mistral's Tekken): every token stands for at least one byte;
- a SentencePiece-style BPE (Llama 2, Mistral v1-v3) with byte fallback or an unknown token:
  every token stands for at least one character, a character the vocabulary lacks becomes at most its
  UTF-8 bytes' tokens, a space becomes the one-character `▁`, and a `▁` put before the text (or before
  each piece between added tokens) is one token more;
- a WordPiece (BERT's) behind a BERT normalizer: every token stands for at least one character of the
  normalized text, or is the unknown token for a whole word, and that normalizer turns no character into
  more characters than it has bytes (it lowercases, strips accents and control characters, and spaces
  CJK characters apart; `tests/unit/test_prompt_bounds.py` checks every code point).

Any other shape (a normalizer that may grow a text, as NFKC does, BPE dropout, added tokens that strip
the spaces beside them) proves nothing: its prompts are counted whole. A tokenizer's shape is read from
its `tokenizer.json`; LocalTokenizer checks what it proves on a probe text at startup too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

BYTE_LEVEL = "byte-level BPE"
SENTENCEPIECE = "SentencePiece BPE"
WORDPIECE = "WordPiece"

# The byte tokens of a BPE with byte fallback: a byte of a character the vocabulary lacks.
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPACE_MARK = "\u2581"


@dataclass(frozen=True, slots=True)
class Bound:
    """What a tokenizer's encoding of a text is known to be: at most the text's UTF-8 bytes plus `extra`
    tokens, plus `specials` where its post-processor adds its own. `heads`: a head of the text cut just
    before a space that follows a non-space character encodes as the whole text's first tokens (so a
    prompt can be read in part, see PromptReader). `words`: no token spans two words, and every word makes
    at least one token (so a text's words bound its tokens from below)."""

    kind: str
    specials: int
    extra: int = 0
    heads: bool = False
    words: bool = False

    def at_most(self, size: int, *, special: bool) -> int:
        """The most tokens a text of `size` UTF-8 bytes can make (`special`: with the post-processor's)."""
        return size + self.extra + (self.specials if special else 0)


def prompt_bound(backend: Any) -> Bound | None:
    """What the shape of a fast tokenizer's Rust core (`backend`) proves of its texts' tokens; None when
    it proves nothing (its prompts are only ever counted whole)."""
    spec = orjson.loads(backend.to_str())
    model = spec.get("model") or {}
    added = [str(token.get("content", "")) for token in spec.get("added_tokens") or []]
    if not _added_tokens_keep_apart(spec):
        return None
    processor = backend.post_processor
    specials = 0 if processor is None else int(processor.num_special_tokens_to_add(False))
    kind = model.get("type")
    if kind == "BPE" and not model.get("dropout"):
        if _byte_level(spec):
            return Bound(BYTE_LEVEL, specials, heads=True, words=True)
        extra = _sentencepiece_prepends(spec, model, added)
        if extra is None:
            return None
        heads, words = _sentencepiece_words(model, set(added))
        return Bound(SENTENCEPIECE, specials, extra, heads=heads, words=words)
    if kind == "WordPiece" and _wordpiece(spec):
        # Not read in part: a word the normalizer empties (a control character alone) makes no token, so
        # neither its words nor a head's last token tell where the whole encoding stands.
        return Bound(WORDPIECE, specials)
    return None


def _added_tokens_keep_apart(spec: dict[str, Any]) -> bool:
    """Whether no added token holds a space or takes the spaces beside it (it could straddle a head's cut,
    or take a space's token with it)."""
    for token in spec.get("added_tokens") or []:
        content = str(token.get("content", ""))
        if not content or any(ch.isspace() for ch in content):
            return False
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
    return True


def _byte_level(spec: dict[str, Any]) -> bool:
    """A byte-level BPE whose heads read as its whole texts' starts: no normalizer (one may grow the text),
    a pattern that splits the text (else merges could run across spaces), no prefix space added to every
    piece between special tokens."""
    if spec.get("normalizer") is not None:
        return False
    parts = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    if not any(part.get("type") == "ByteLevel" for part in parts):
        return False
    if not any(
        part.get("type") == "Split" or (part.get("type") == "ByteLevel" and part.get("use_regex", True))
        for part in parts
    ):
        return False
    allowed = ("ByteLevel", "Split", "Digits")
    return all(part.get("type") in allowed and not part.get("add_prefix_space") for part in parts)


def _sentencepiece_prepends(spec: dict[str, Any], model: dict[str, Any], added: list[str]) -> int | None:
    """For a BPE over the text's characters with spaces made `▁` (by a normalizer or a Metaspace
    pre-tokenizer): how many `▁` may be put before a piece of it; None for any other shape.

    Such a BPE makes at most a token of each character, or of each byte of a character it lacks (byte
    fallback; without it the unknown token stands for one or more), so only what the text gains costs
    more: a space made `▁` is one token where the vocabulary has `▁`, and each `▁` put before a piece (the
    first, or each between added tokens) one more. An added token of two bytes or more pays for the piece
    after it, so the whole text gains at most the one before its first piece."""
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    prepends = 0
    marks = set()
    for step in _steps(spec.get("normalizer"), "normalizers"):
        kind = step.get("type")
        if kind == "Prepend":
            marks.add(step.get("prepend"))
            prepends += 1
        elif kind == "Replace":
            if (step.get("pattern") or {}).get("String") != " ":
                return None
            marks.add(step.get("content"))
        else:
            return None
    for step in _steps(spec.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") != "Metaspace":
            return None
        marks.add(step.get("replacement"))
        scheme = step.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if step.get("add_prefix_space", True) else "never"
        prepends += scheme != "never"
    if marks != {_SPACE_MARK} or _SPACE_MARK not in (model.get("vocab") or {}):
        # Spaces left as they are could be unknown and fused with their neighbours; a `▁` the vocabulary
        # lacks is three byte tokens, not one.
        return None
    if prepends > 1 or (prepends and any(len(content.encode("utf-8")) < 2 for content in added)):
        return None
    return prepends


def _sentencepiece_words(model: dict[str, Any], added: set[str]) -> tuple[bool, bool]:
    """Whether a head cut before a space reads as the whole text's start, and whether words bound the
    tokens: a BPE merges only into tokens of its vocabulary, so where no token runs from a non-space
    character into a space, no merge crosses such a cut (the head's pieces merge as the whole's do), and
    where no token spans two words, each word starts a token of its own (unless the unknown characters
    around a space the vocabulary lacks, a newline, are fused into one token)."""
    # A BPE told to take a whole word from its vocabulary before merging (`ignore_merges`) takes the whole
    # text here, which has no pre-tokenizer to cut it into words: a head could be one token the whole is not.
    heads = not model.get("ignore_merges")
    words = bool(model.get("byte_fallback")) or not model.get("fuse_unk")
    fallback = bool(model.get("byte_fallback"))
    for token in model.get("vocab") or {}:
        if token in added or (fallback and _BYTE_TOKEN.fullmatch(token)):
            continue
        piece = token.replace(_SPACE_MARK, " ")
        if heads and any(ch == " " and index and not piece[index - 1].isspace() for index, ch in enumerate(piece)):
            heads = False
        if words and len(piece.split()) > 1:
            words = False
        if not heads and not words:
            break
    return heads, words


def _wordpiece(spec: dict[str, Any]) -> bool:
    """A WordPiece behind a BERT normalizer (or none) and a pre-tokenizer that splits on whitespace."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "BertNormalizer":
        return False
    return all(
        step.get("type") in ("BertPreTokenizer", "Whitespace", "WhitespaceSplit")
        for step in _steps(spec.get("pre_tokenizer"), "pretokenizers")
    )


def _steps(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps: those of a Sequence, or the one."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return list(component.get(key) or [])
    return [component]


def longest_token_bytes(tokenizer: Any) -> int:
    """A bound on the bytes of text one token can stand for: its longest token's, plus one for a
    leading space a decoder drops, times three when a normalizer may shrink the text first (NFKC
    and lowercasing map some three-byte characters to one byte)."""
    backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        size = backend.get_vocab_size(with_added_tokens=True)
        pieces = backend.decode_batch([[token] for token in range(size)], skip_special_tokens=False)
        shrinks = backend.normalizer is not None
    else:
        pieces = [tokenizer.convert_tokens_to_string([token]) for token in tokenizer.get_vocab()]
        shrinks = True
    longest = max((len(piece.encode("utf-8", "surrogatepass")) for piece in pieces), default=1)
    return (longest + 1) * (3 if shrinks else 1)


# Each byte of a UTF-8 text as a space (an ASCII character str.split() splits on) or not: a word starts where a
# byte that is not follows one that is. A multi-byte character's bytes are never ASCII, so never a space here:
# the characters above ASCII that str.split() splits on (WIDE_SPACES) are made spaces first.
_SPACE_OR_NOT = bytes(32 if chr(byte).isspace() else 120 for byte in range(128)) + b"x" * 128
WIDE_SPACES = (
    "\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_CHARS_A_WORD = 6  # characters looked at for each word still to find, at a time: a head of the text, mostly


def words_in(text: str, most: int) -> int:
    """The words of `text` as `str.split()` finds them, counted up to `most` (`most` or more returned: the
    text has that many or more).

    Counted in bytes, with no string made per word, and over the head that holds them: `str.split` makes each
    word an object (a 1,600-word prompt's first 1,000 words: 26 us; here 14)."""
    found = 0
    after_space = True  # the text's start is a word's start
    start, end = 0, len(text)
    while start < end and found < most:
        step = max((most - found) * _CHARS_A_WORD, 1024)
        chunk = text[start : start + step]
        if not chunk.isascii():
            for space in WIDE_SPACES:
                if space in chunk:
                    chunk = chunk.replace(space, " ")
        marks = chunk.encode("utf-8", "surrogatepass").translate(_SPACE_OR_NOT)
        found += marks.count(b" x") + (after_space and marks[:1] == b"x")
        after_space = marks[-1:] == b" "
        start += step
    return found
