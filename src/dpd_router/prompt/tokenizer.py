"""Counting a request's prompt tokens exactly as the engine will see them.

Chat requests are rendered through the tokenizer's chat template with the generation prompt,
then encoded without extra special tokens (what vLLM does); text prompts are encoded with them.
Long prompts are tokenized in a worker thread so the event loop keeps relaying other streams.
Without a local tokenizer, the engines' own `POST /tokenize` answers.

Routing rarely needs the whole count: a prompt's bytes bound its tokens (for the tokenizers `bounds.py`
proves it of), and a `PromptReader` reads a prompt from its start only as far as the decision needs
(see `PromptReader`). The rest is encoded in the background
only where a decision to come needs it (a cache-aware threshold's prefix index) and no prefill answer
brought the prompt's ids, or where `count_whole` (the `count_whole_prompts` setting) asks for every
prompt; otherwise the exact count comes from the engine's usage. A chat's pieces between added tokens
are kept encoded (`PieceCache`), so a conversation sent again encodes its new messages only.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from dpd_router.prompt.bounds import BYTE_LEVEL, Bound, longest_token_bytes, prompt_bound, words_in
from dpd_router.prompt.chat_inputs import client_template, template_inputs
from dpd_router.prompt.chat_render import PlainChatTemplate
from dpd_router.prompt.template_sandbox import RenderedTooLarge, TemplateSandbox
from dpd_router.prompt.word_cache import BOUNDARY, WORD_CACHE_MAX_CHARS, WordCache, cut_apart, encode_apart_of
from dpd_router.request.client_request import MANY_CONTAINERS, ClientRequest
from dpd_router.request.errors import InvalidRequest, UpstreamError
from dpd_router.request.frozen import evolve


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as tokens: what routing decides on.

    `token_ids` holds the first (or only) prompt's ids; `num_tokens` counts every prompt of a batch.

    A prompt known in part (`at_most` set, read by a `PromptReader`) has the first ids of its whole
    encoding in `token_ids`, an estimate between `len(token_ids)` and `at_most` (a bound on the
    whole count) in `num_tokens`, and, once routing settled on it, the whole prompt coming in `rest`.
    """

    token_ids: Sequence[int]
    num_tokens: int
    seconds: float
    at_most: int | None = None
    # The whole prompt; None in it when the background encoder was too far behind to encode it.
    rest: asyncio.Future[Prompt | None] | None = None
    # The whole encoding behind `rest` where it was left until something asks for it (see WholeLater).
    later: WholeLater | None = None
    # Block hashes of its first ids by block size, shared by every prompt one reader made of one text (each
    # one's ids start the next one's), so that reading on hashes only the blocks read since.
    blocks: dict[int, list[int]] | None = field(default=None, compare=False, repr=False)
    # For a prompt known in part: whether the whole prompt holds at least so many tokens, told by its bytes or
    # words without encoding them (see PromptReader.at_least).
    at_least: Callable[[int], bool] | None = field(default=None, compare=False, repr=False)
    # The most tokens `at_least` has shown the whole prompt to hold (0: none shown).
    floor: int = 0

    @property
    def exact(self) -> bool:
        """Whether `token_ids` and `num_tokens` are the whole prompt's."""
        return self.at_most is None

    @property
    def wants_ids(self) -> bool:
        """Whether the router wants the whole prompt's ids from the prefill answer: a prompt known in part
        whose whole encoding is wanted (see PromptReader.rest); the count alone comes from the usage."""
        return self.later is not None and self.later.wanted


@dataclass(frozen=True)
class Head:
    """What a head of a prompt settled: its first `ids` (the whole encoding's), the character they end at,
    the head's tokens in all, and how many of `ids` (ending at character `whole_end`) are whole pieces of
    the piece cache, from which the next, longer head of the same text goes on (0: none)."""

    # A list, or (read through the piece cache) an array of 4-byte ids: the kept pieces' own form, which is
    # copied a block of memory at a time, where a list takes one new int object an id.
    ids: Sequence[int]
    end: int
    count: int
    whole_ids: int = 0
    whole_end: int = 0


class TokenCounter(Protocol):
    async def tokenize(self, request: ClientRequest, *, max_tokens: int | None = None) -> Prompt: ...

    async def aclose(self) -> None: ...


# Requests of more bytes than this are tokenized in a lane of their own, so that a few huge prompts
# cannot keep every other long prompt waiting for a thread.
LARGE_REQUEST_BYTES = 1 << 20
# A chat body of at most so many containers (messages, content parts, tools) and bytes is rendered on the event
# loop whatever its size: measured, 32 messages of 8 kB through the template engine take 0.3 ms, a lone
# 256 kB message through the plain template 22 us.
INLINE_RENDER_CONTAINERS = 64
INLINE_RENDER_BYTES = 256 * 1024
# How many more characters of a prompt's head are read on the event loop where its words are kept (see
# WordCache): found, they cost a tenth of encoding them or less; a head of words not seen before is encoded
# whole at twice the hold of one of `tokenize_inline_max_chars`.
WORDS_INLINE_SHARE = 2
# Characters of kept chat pieces looked up (hashed, their ids copied) for the cost of encoding one: measured
# about 5 ns a character against 300 (a head going on through 75 kB of kept history took 0.4 ms).
LOOKUP_COST_SHARE = 64


class PromptTooLong(Exception):
    """The prompt's size alone shows it has more tokens than the model holds; it was not tokenized."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


class _Abandoned(Exception):
    """The request was cancelled while its tokenizing waited or ran: the rest is not done."""


class LocalTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (nothing is downloaded)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        inline_max_chars: int,
        threads: int,
        sandbox: TemplateSandbox | None = None,
        body_renderer: TemplateSandbox | None = None,
        background_max_chars: int = 4_000_000,
        on_background_skip: Callable[[], None] | None = None,
        count_whole: bool = False,
        piece_cache_chars: int = 8_000_000,
        word_cache: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        # The template alone renders a plain conversation, where it renders the startup probes exactly.
        self._plain_template = PlainChatTemplate.for_tokenizer(tokenizer)
        # A fast tokenizer's Rust core, called directly: transformers' wrapper around it costs more
        # than the encoding itself for short prompts. `encode_batch` releases the GIL (plain `encode`
        # does not), so the worker threads use it and the event loop keeps running meanwhile.
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self._encode_batch = None if self._backend is None else encode_batch_of(self._backend)
        self._inline_max_chars = inline_max_chars
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self._large_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-large")
        # The background encoder's thread (see _plain), which adds itself as it starts.
        self._background_threads: set[int] = set()
        self._sandbox = sandbox
        # Renders the server's template over a body of very many containers in another process: freeing
        # transformers' copies of them here would hold the event loop (TemplateSandbox.render_body).
        self._body_renderer = body_renderer
        self.bytes_per_token = longest_token_bytes(tokenizer)
        # Characters a token of the prompts read so far stood for (a moving average of their heads): the
        # first head of the next prompt is cut by it, so most prompts are read in one step of about the
        # tokens their plan wants. None until a head was read.
        self.chars_per_token: float | None = None
        self._pieces: PieceCache | None = None  # set below, once heads are known to read right without it
        self._words: WordCache | None = None  # likewise
        # The tokens the post-processor puts before and after a text, where the words are kept (else None).
        self._affixes: tuple[list[int], list[int]] | None = None
        # What the tokenizer's shape proves of a text's tokens by its bytes (None: nothing, so every prompt
        # is counted whole), as far as the probe text shows it too.
        self.bound = None if self._backend is None else prompt_bound(self._backend)
        if self.bound is not None and not self._bound_holds(_PROBE_TEXT, self.bound):
            self.bound = None
        # Whether a prompt can be read from its start only as far as a decision needs (PromptReader.more).
        self.reads_heads = self.bound is not None and self.bound.heads and self._heads_agree(_PROBE_TEXT)
        # Whether a prompt holds at least as many tokens as words (PromptReader.at_least).
        self.words_bound = self.bound is not None and self.bound.words and self._words_apart(_PROBE_TEXT)
        # A text's encoding from its words' kept encodings: where the startup check shows the probe texts
        # encode so as the tokenizer encodes them (see word_cache.py).
        if self._encode_batch is not None and self.reads_heads and word_cache and self.bound is not None:
            words = WordCache(encode_apart_of(self._backend), self._plain_whole)
            if self.bound.kind == BYTE_LEVEL and cut_apart(self._backend) and self._words_agree(words):
                self._words = words
                self._affixes = self._special_affixes()
        # The encodings of the text between added tokens, kept: a conversation sent again encodes its new
        # messages only. Only where the startup check shows a text encodes as its pieces do.
        if self._backend is not None and self.reads_heads and piece_cache_chars > 0:
            pieces = PieceCache(self._backend, max_chars=piece_cache_chars, encode=lambda text: self._plain(text))
            if pieces.splits and self._pieces_agree(pieces, _piece_probe(pieces)):
                self._pieces = pieces
        # Whether a prompt read in part is encoded whole as well, after its plan (see PromptReader.rest).
        self.count_whole = count_whole
        self._background = (
            None
            if self._backend is None
            else BackgroundEncoder(
                self._encode,
                max_chars=background_max_chars,
                on_skip=on_background_skip,
                initializer=self._background_started,
            )
        )

    def _bound_holds(self, text: str, bound: Bound) -> bool:
        """Whether `text`, and every part of it up to a boundary, encodes in no more tokens than its bound."""
        for special in (False, True):
            for end in [match.start() for match in BOUNDARY.finditer(text)] + [len(text)]:
                whole, _ = self._ids_and_offsets(text[:end], special)
                if len(whole) > bound.at_most(utf8_size(text[:end]), special=special):
                    return False
        return True

    def _heads_agree(self, text: str) -> bool:
        """Whether the heads of `text` cut at every boundary PromptReader cuts at (with the tokens it
        keeps of each) start as the whole text's encoding does."""
        for special in (False, True):
            whole, _ = self._ids_and_offsets(text, special)
            for match in BOUNDARY.finditer(text):
                known = self._head(text, match.start(), special).ids
                if known != whole[: len(known)]:
                    return False
        return True

    def _words_apart(self, text: str) -> bool:
        """Whether no token of `text`'s encoding spans two of its words (non-space characters on both sides
        of a space): no pre-tokenizer pattern of a byte-level BPE does, and BPE merges within one."""
        for special in (False, True):
            _, offsets = self._ids_and_offsets(text, special)
            if any(len(text[start:end].split()) > 1 for start, end in offsets):
                return False
        return True

    def _words_agree(self, words: WordCache) -> bool:
        """Whether the probe texts (added tokens among them), their heads and a text of their lines in another
        order encode from their kept words as the tokenizer encodes them, the second time (found) as the first
        (encoded apart)."""
        texts = _probe_variants(_PROBE_TEXT + "".join(self._tokenizer.all_special_tokens) + " " + _PROBE_TEXT[::-1])
        return all(words.encode(text) == self._plain_whole(text) for text in texts + texts)

    def _special_affixes(self) -> tuple[list[int], list[int]] | None:
        """The tokens the post-processor puts before and after a text (a BOS, an EOS), where the probe text,
        its heads, its lines in another order and an empty text each encode with them as those around its
        encoding without them; None where one does not (a text prompt is then encoded by the Rust core)."""
        plain = self._plain_whole(_PROBE_TEXT)
        whole = self._plain_whole(_PROBE_TEXT, special=True)
        starts = [at for at in range(len(whole) - len(plain) + 1) if whole[at : at + len(plain)] == plain]
        if len(starts) != 1:
            return None
        before, after = whole[: starts[0]], whole[starts[0] + len(plain) :]
        texts = ["", *_probe_variants(_PROBE_TEXT)]
        if any(self._plain_whole(text, special=True) != before + self._plain_whole(text) + after for text in texts):
            return None
        return before, after

    def _pieces_agree(self, pieces: PieceCache, text: str) -> bool:
        """Whether `text` (added tokens among ordinary text) encodes as its pieces do, whole and in every
        head PromptReader may cut: no normalizer or pattern reaches across an added token."""
        whole, _ = self._ids_and_offsets(text, False)
        if pieces.encode(text) != whole:
            return False
        for match in BOUNDARY.finditer(text):
            known = list(pieces.head(text, match.start()).ids)
            if known != whole[: len(known)]:
                return False
        return True

    def reading(self) -> str:
        """How this tokenizer's prompts are read, in words for the startup log."""
        bound = self.bound
        if bound is None:
            return "every prompt is encoded whole (its shape bounds no prompt's tokens by its bytes)"
        parts = [f"{bound.kind}: a prompt's bytes bound its tokens"]
        parts.append(
            "prompts are read in part" if self.reads_heads else "a prompt its bytes do not settle is encoded whole"
        )
        if self.words_bound:
            parts.append("words bound them from below")
        if self._words is not None:
            parts.append("words are kept")
        if self._pieces is not None:
            parts.append("chat pieces are kept")
        return ", ".join(parts)

    @classmethod
    def load(cls, directory: Path, **options: Any) -> LocalTokenizer:
        """The tokenizer saved in `directory`; `options` as the constructor's."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return cls(tokenizer, **options)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    async def tokenize(self, request: ClientRequest, *, max_tokens: int | None = None) -> Prompt:
        """The request's prompt tokens. A prompt whose size already shows it holds more than
        `max_tokens` raises PromptTooLong before any tokenizing; a cancelled request stops its
        tokenizing at the next step (a queued one never starts)."""
        started = time.perf_counter()
        rendered = await self._render_apart(request, max_tokens)
        work = self._work_for(request, rendered, max_tokens)
        lane = self._lane(
            len(request.raw) if rendered is None else len(rendered),
            words=self._words_kept(special=request.template_body is None),
        )
        if lane is not None:
            abandoned = threading.Event()
            try:
                batches = await asyncio.get_running_loop().run_in_executor(lane, work, abandoned)
            except asyncio.CancelledError:
                abandoned.set()
                raise
        else:
            batches = work(None)
        return Prompt(
            token_ids=batches[0],
            num_tokens=sum(len(ids) for ids in batches),
            seconds=time.perf_counter() - started,
        )

    async def reader(self, request: ClientRequest, *, max_tokens: int | None = None) -> PromptReader | None:
        """A reader of the request's prompt from its start; None where only the whole count will do (a
        tokenizer whose bytes bound nothing, a batch, token ids). A prompt whose size already shows it
        holds more than `max_tokens` raises PromptTooLong, as `tokenize` does."""
        bound = self.bound
        if bound is None:
            return None
        started = time.perf_counter()
        if request.template_body is not None:
            rendered = await self._render_apart(request, max_tokens)
            text, special = (rendered if rendered is not None else await self._render_in_lane(request)), False
        else:
            prompt = request.body["prompt"]
            if not isinstance(prompt, str):
                return None
            text, special = prompt, True
        self._check_size(text, max_tokens)
        return PromptReader(
            self,
            text,
            special=special,
            specials=bound.specials if special else 0,
            extra=bound.extra,
            heads=self.reads_heads,
            started=started,
        )

    def _lane(self, size: int, *, words: bool = False) -> ThreadPoolExecutor | None:
        """The threads that encode a text of `size` characters; None: at once, on the event loop. `words`:
        the text is put together from its kept words (see WordCache), which costs a fraction as much."""
        if size <= self._inline_max_chars * (WORDS_INLINE_SHARE if words else 1):
            return None
        return self._large_executor if size > LARGE_REQUEST_BYTES else self._executor

    async def read_head(
        self, text: str, cut: int, *, special: bool, after: Head | None = None, onward: bool = False
    ) -> Head:
        """What `text`'s head `text[:cut]` settles of its whole encoding (see Head), in the lane the head's
        size calls for; `after`: a shorter head of the same text read before, whose whole pieces are kept;
        `onward`: on past the cut through the pieces kept (see PieceCache.head)."""
        # With the piece cache, a head goes on from the shorter one's whole pieces: only the text after them
        # is looked up or encoded (an encoding with special tokens starts from the text's start).
        start = after.whole_end if after is not None and self._pieces is not None and not special else 0
        # Going on through kept pieces costs their lookup: about a sixtieth of encoding as much text.
        onward_cost = (len(text) - cut) // LOOKUP_COST_SHARE if onward and self._pieces is not None else 0
        lane = self._lane(max(cut - start, onward_cost), words=self._words_kept(special=special))
        if lane is None:
            return self._head(text, cut, special, after, onward)
        return await asyncio.get_running_loop().run_in_executor(lane, self._head, text, cut, special, after, onward)

    def _words_kept(self, *, special: bool) -> bool:
        """Whether a text is put together from its kept words (with the post-processor's tokens: `special`)."""
        return self._words is not None and (not special or self._affixes is not None)

    def _head(self, text: str, cut: int, special: bool, after: Head | None = None, onward: bool = False) -> Head:
        """A head's settled tokens (see PromptReader), the character they end at and its tokens in all.
        Without special tokens, every token of `text[:cut]` (with the piece cache, every piece before its
        last added token from the cache where it was seen before), encoded without offsets. With them, those
        up to its last boundary before `cut` (a post-processor may end an encoding with its own tokens), or,
        where the words are kept and the post-processor's tokens known, those before the text and every token
        of `text[:cut]`."""
        if special and self._affixes is not None:
            before, after_text = self._affixes
            ids = before + self._plain(text[:cut])
            return Head(ids, cut, len(ids) + len(after_text))
        if not special:
            if self._pieces is not None:
                return self._pieces.head(text, cut, after, onward=onward)
            ids = self._plain(text[:cut])
            return Head(ids, cut, len(ids))
        ids, offsets = self._ids_and_offsets(text[:cut], special)
        known = kept_tokens(offsets, head_cut(text, cut - 1))
        end = max((token_end for _, token_end in offsets[:known]), default=0)
        return Head(ids[:known], end, len(ids))

    def _plain(self, text: str) -> list[int]:
        """The text's ids without special tokens or offsets: from its kept words where the word cache is on
        (at most WORD_CACHE_MAX_CHARS a call: a request's head read in a tokenizing thread holds the GIL for
        about 0.3 ms at most), except in the background encoder's thread, which encodes whole prompts off the
        request's path one after another: there the Rust core, which releases the GIL, where the lookups would
        hold it from the event loop for as long as the interpreter lets a thread run."""
        words = self._words
        if (
            words is not None
            and len(text) <= WORD_CACHE_MAX_CHARS
            and threading.get_ident() not in self._background_threads
        ):
            return words.encode(text)
        return self._plain_whole(text)

    def _background_started(self) -> None:
        self._background_threads.add(threading.get_ident())

    def _plain_whole(self, text: str, *, special: bool = False) -> list[int]:
        """The text's ids without offsets (`special`: with the post-processor's tokens), from the Rust core's
        batch call without offsets, the cheapest it has, which releases the GIL. One text a call: a batch of
        several would spread over every core (see BackgroundEncoder)."""
        assert self._encode_batch is not None
        return list(self._encode_batch([text], add_special_tokens=special)[0].ids)

    async def continued(self, request: ClientRequest, said: str) -> list[int]:
        """The ids of a chat-like request's prompt followed by `said` (an answer's text so far), encoded as one
        text as the engine encodes a rendered prompt: a continuation's prompt. Encoded apart, `said` could
        start otherwise (SentencePiece puts a space before a text of its own)."""
        rendered = await self._render_apart(request, None)
        if rendered is None:
            rendered = await self._render_in_lane(request)
        return await self.encode_whole(rendered + said, special=False)

    async def encode_whole(self, text: str, *, special: bool) -> list[int]:
        """The ids of `text` (no offsets: about half the work), in the lane its size calls for."""
        lane = self._lane(len(text), words=self._words_kept(special=special))
        if lane is None:
            return self._encode(text, special=special)
        return await asyncio.get_running_loop().run_in_executor(lane, lambda: self._encode(text, special=special))

    def _ids_and_offsets(self, text: str, special: bool) -> tuple[list[int], list[tuple[int, int]]]:
        assert self._backend is not None
        encoding = self._backend.encode_batch([text], add_special_tokens=special)[0]  # releases the GIL
        return list(encoding.ids), list(encoding.offsets)

    def encode_at_once(self, text: str, *, special: bool) -> list[int] | None:
        """The ids of `text`, encoded on the event loop if it is small enough to be (None: it is not)."""
        if self._lane(len(text), words=self._words_kept(special=special)) is not None:
            return None
        return self._encode(text, special=special)

    def encode_rest(self, text: str, *, special: bool, started: float) -> asyncio.Future[Prompt | None]:
        """The whole prompt, encoded in the background (off the request's path): None in the future when
        the background encoder is too far behind to take it."""
        assert self._background is not None  # a PromptReader, the only caller, needs the Rust core
        return self._background.submit(text, special=special, started=started)

    def _work_for(
        self, request: ClientRequest, rendered: str | None, max_tokens: int | None
    ) -> Callable[[threading.Event | None], list[Sequence[int]]]:
        """The tokenizing to do, called with the event that says its request was abandoned (None on
        the event loop)."""
        body = request.body

        def encode(texts: Callable[[], list[str]], special: bool) -> Callable[..., list[Sequence[int]]]:
            def run(abandoned: threading.Event | None) -> list[Sequence[int]]:
                batches: list[Sequence[int]] = []
                for text in texts():
                    self._check_size(text, max_tokens)
                    if abandoned is not None and abandoned.is_set():
                        raise _Abandoned
                    batches.append(self._encode(text, special=special))
                return batches

            return run

        chat = request.template_body
        if chat is not None:
            return encode(lambda: [rendered if rendered is not None else self._render(chat)], False)
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return encode(lambda: [prompt], True)
        if prompt and isinstance(prompt[0], int):
            return lambda abandoned: [prompt]
        if prompt and isinstance(prompt[0], list):
            return lambda abandoned: list(prompt)
        return encode(lambda: list(prompt), True)

    def fewest_tokens(self, size: int) -> int:
        """The fewest tokens a text of `size` UTF-8 bytes can make (the post-processor's aside): no token stands
        for more bytes than the longest token's (`bytes_per_token`)."""
        return size // self.bytes_per_token

    def _check_size(self, text: str, max_tokens: int | None) -> None:
        """Refuse a text whose bytes alone show more than `max_tokens` tokens (fewest_tokens)."""
        if max_tokens is None or len(text) * 4 <= max_tokens * self.bytes_per_token:
            return  # too few characters to prove anything (a character is at most 4 bytes)
        at_least = self.fewest_tokens(utf8_size(text))
        if at_least > max_tokens:
            raise PromptTooLong(at_least)

    def _encode(self, text: str, *, special: bool) -> list[int]:
        if special and self._affixes is not None:
            before, after = self._affixes
            return before + self._plain(text) + after
        if not special and self._pieces is not None:
            return self._pieces.encode(text)
        if not special and self._words is not None:
            return self._plain(text)
        if self._encode_batch is None:
            return list(self._tokenizer.encode(text, add_special_tokens=special))
        return self._plain_whole(text, special=special)

    async def _render_in_lane(self, request: ClientRequest) -> str:
        """The tokenizer's template over the request's messages: on the event loop for a body of few messages
        and bounded size, else in the lane its size calls for (a body of many short messages renders for
        seconds). A render's cost follows its messages, not its bytes: a 12 kB message renders in 11 us
        here, where handing it to a thread and waking the loop after costs 80 us of CPU."""
        chat = request.template_body
        assert chat is not None
        size = len(request.raw)
        few = request.brackets <= INLINE_RENDER_CONTAINERS and size <= INLINE_RENDER_BYTES
        lane = None if few else self._lane(size)
        if lane is None:
            return self._render(chat)
        return await asyncio.get_running_loop().run_in_executor(lane, self._render, chat)

    def _render(self, body: dict[str, Any]) -> str:
        """The prompt text of a chat request, by the tokenizer's own (trusted) template: a plain conversation
        by the template alone (chat_render.py), anything else through apply_chat_template."""
        try:
            conversation, tools, kwargs = template_inputs(body)
            plain = self._plain_template
            if plain is not None and plain.takes(conversation, tools, kwargs):
                return plain.render(conversation, add_generation_prompt=kwargs["add_generation_prompt"])
            text = self._tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)
        except Exception as exc:  # jinja errors, template raise_exception(), bad message shapes
            raise InvalidRequest(f"The chat template could not render these messages: {exc}") from None
        return str(text)

    async def _render_apart(self, request: ClientRequest, max_tokens: int | None) -> str | None:
        """The prompt text of a chat request rendered in a worker process: a template the client brought
        (in the sandbox), or the server's over a body of very many containers; None: render it here.
        A text whose size alone shows more than `max_tokens` raises PromptTooLong, as `_check_size`, and is
        never sent back (tens of MB to copy and decode)."""
        chat = request.template_body
        if chat is None:
            return None
        max_bytes = None if max_tokens is None else (max_tokens + 1) * self.bytes_per_token - 1
        try:
            if client_template(chat) is not None:
                if self._sandbox is None:  # parsing refuses client templates unless they are trusted
                    raise InvalidRequest("Chat templates sent with requests are not accepted.", param="chat_template")
                return await self._sandbox.render_body(request.template_raw(), from_client=True, max_bytes=max_bytes)
            if self._body_renderer is not None and request.brackets > MANY_CONTAINERS:
                return await self._body_renderer.render_body(request.template_raw(), max_bytes=max_bytes)
        except RenderedTooLarge as exc:
            raise PromptTooLong(self.fewest_tokens(exc.size)) from None
        return None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._large_executor.shutdown(wait=False, cancel_futures=True)
        if self._background is not None:
            self._background.close()

    async def aclose(self) -> None:
        self.close()
        for worker in (self._sandbox, self._body_renderer):
            if worker is not None:
                await worker.close()


def encode_batch_of(backend: Any) -> Callable[..., list[Any]]:
    """The Rust core's batch encoding without character offsets where the tokenizers release has it
    (0.21+, about half the work of one with offsets), else the batch encoding."""
    fast: Callable[..., list[Any]] | None = getattr(backend, "encode_batch_fast", None)
    return fast if fast is not None else backend.encode_batch


class PieceCache:
    """Encodings of the pieces of text between a tokenizer's added tokens, kept for the prompts that hold
    them again.

    A Hugging Face tokenizer splits a text on its added tokens (the chat template's markers) before it
    normalizes, pre-tokenizes and encodes the rest, so each piece between two of them encodes alone, and a
    text's encoding is its pieces' and its added tokens' ids in turn. An agent or a chat sends its whole
    history again every turn: with its earlier messages' pieces kept, a turn encodes its new messages only.
    LocalTokenizer uses it only where a startup check shows a text encodes as its pieces do (no normalizer,
    no added token that strips the spaces beside it). At most `max_chars` characters of pieces are kept
    (with 64 more counted for each piece), the least recently used dropped first. Used from the event loop
    and the tokenizing threads alike, so the kept pieces are only touched under a lock.
    """

    def __init__(
        self,
        backend: Any,
        *,
        max_chars: int,
        encode: Callable[[str], list[int]],
    ) -> None:
        spec = orjson.loads(backend.to_str())
        self._ids = {str(token["content"]): int(token["id"]) for token in spec.get("added_tokens") or []}
        # Longest first: at one place, the longest added token matches, as the tokenizer's own split does.
        contents = sorted((content for content in self._ids if content), key=len, reverse=True)
        self._split = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._encode = encode
        self._max_chars = max_chars
        self._kept: OrderedDict[str, array[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def splits(self) -> bool:
        """Whether the tokenizer has added tokens to split on (else a text is one piece: nothing to gain)."""
        return self._split is not None

    @property
    def added_tokens(self) -> list[str]:
        return list(self._ids)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without the post-processor's special tokens, piece by piece."""
        parts, end = self._parts(text, len(text))
        ids = self._ids_of(parts)
        if end < len(text):
            ids.extend(self._ids_of([text[end:]]))
        return ids.tolist()

    def head(self, text: str, cut: int, after: Head | None = None, *, onward: bool = False) -> Head:
        """As LocalTokenizer._head without special tokens: the tokens of the head `text[:cut]` (cut at a
        boundary), its pieces up to its last added token from the cache (an added token holds no space, and
        the cut is at one, so none runs past the cut), the text after it encoded and not kept (it is not a
        whole piece), unless that piece is kept: then it is taken whole, with the added token after it (the
        head ends there, past the cut, for nothing), and with `onward` every kept piece after it too, up to
        the first piece not kept: a conversation's history up to its new messages, found with nothing
        encoded (what a cache-aware threshold reads on for). `after`: a shorter head's, whose whole pieces
        are not looked up again."""
        start = 0 if after is None else after.whole_end
        ids = array("I") if after is None else array("I", after.ids[: after.whole_ids])
        parts, end = self._parts(text, cut, start)
        ids += self._ids_of(parts)
        if end >= cut:
            return Head(ids, end, len(ids), len(ids), end)
        assert self._split is not None  # `end` short of the cut: a text with an added token in it
        after_piece = self._split.search(text, cut)
        piece = text[end : len(text) if after_piece is None else after_piece.start()]
        kept = self._kept_ids([piece]).get(piece)
        if kept is not None:
            ids.extend(kept)
            if after_piece is not None:
                ids.append(self._ids[after_piece.group()])
            end = len(text) if after_piece is None else after_piece.end()
            if onward:
                end = self._onward(text, end, ids)
            return Head(ids, end, len(ids), len(ids), end)
        whole_ids = len(ids)
        ids.extend(self._encode(text[end:cut]))
        return Head(ids, cut, len(ids), whole_ids, end)

    def _onward(self, text: str, end: int, ids: array[int]) -> int:
        """Where the kept pieces of `text` from `end` on (and the added tokens between them) end, their ids
        added to `ids`: the first piece not kept stops it, unread."""
        assert self._split is not None
        while end < len(text):
            token = self._split.search(text, end)
            stop = len(text) if token is None else token.start()
            if stop > end:
                piece = text[end:stop]
                kept = self._kept_ids([piece]).get(piece)
                if kept is None:
                    break
                ids.extend(kept)
            if token is None:
                return len(text)
            ids.append(self._ids[token.group()])
            end = token.end()
        return end

    def _parts(self, text: str, stop: int, start: int = 0) -> tuple[list[str | int], int]:
        """The pieces and added tokens' ids of `text[start:stop]` up to its last added token, and where it
        ends (`start` when there is none)."""
        parts: list[str | int] = []
        end = start
        if self._split is not None:
            ids = self._ids
            for match in self._split.finditer(text, start, stop):
                if match.start() > end:
                    parts.append(text[end : match.start()])
                parts.append(ids[match.group()])
                end = match.end()
        return parts, end

    def _kept_ids(self, parts: Sequence[str | int]) -> dict[str, array[int]]:
        """The ids kept of the parts that are pieces, each marked as used just now."""
        found: dict[str, array[int]] = {}
        with self._lock:
            kept = self._kept
            for part in parts:
                if isinstance(part, str) and part not in found and (seen := kept.get(part)) is not None:
                    kept.move_to_end(part)
                    found[part] = seen
        self.hits += len(found)
        return found

    def _ids_of(self, parts: Sequence[str | int]) -> array[int]:
        """The parts' ids in turn: a piece's from the kept ones, or encoded (and kept)."""
        found = self._kept_ids(parts)
        missing = list({part: None for part in parts if isinstance(part, str) and part not in found})
        self.misses += len(missing)
        if missing:
            fresh = {piece: array("I", self._encode(piece)) for piece in missing}
            found.update(fresh)
            self._keep(fresh)
        ids = array("I")
        for part in parts:
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(found[part])
        return ids

    def _keep(self, fresh: dict[str, array[int]]) -> None:
        with self._lock:
            kept = self._kept
            for piece, ids in fresh.items():
                size = len(piece) + PIECE_OVERHEAD_CHARS
                if size > self._max_chars or piece in kept:
                    continue
                kept[piece] = ids
                self._chars += size
            while self._chars > self._max_chars and kept:
                piece, _ = kept.popitem(last=False)
                self._chars -= len(piece) + PIECE_OVERHEAD_CHARS


# What a kept piece costs beyond its characters (its entry, its ids' array), counted in characters.
PIECE_OVERHEAD_CHARS = 64


def _piece_probe(pieces: PieceCache) -> str:
    """Ordinary text with added tokens of the tokenizer before, inside and after it: the first and last
    eight (a vocabulary may have hundreds, split alike; whether any strips spaces is checked apart, by
    `bounds.prompt_bound`), so the check at startup stays a matter of milliseconds."""
    lines = _PROBE_TEXT.splitlines(keepends=True)
    tokens = pieces.added_tokens
    parts = []
    for index, token in enumerate(tokens if len(tokens) <= 16 else tokens[:8] + tokens[-8:]):
        parts += [token, lines[index % len(lines)], token, token, " " + lines[(index + 1) % len(lines)], "\n\n"]
    return "".join(parts) + _PROBE_TEXT


class BackgroundEncoder:
    """Whole encodings of prompts that were planned on their first tokens, made off the request's path.

    They serve the exact counts a request is reported with (when the engine reports none) and the tail
    blocks of the prefix index, so they may lag: one thread takes every text waiting at once and encodes
    them one after another with the tokenizer's Rust core, which releases the GIL (one text a call: a
    batch call would spread over every core). The event loop pays no encoding even for short prompts,
    and however many long prompts arrive the background work takes at most one core, leaving the rest
    to the requests. At most `max_chars` characters wait or run: a text beyond them
    is not encoded (its future holds None, `on_skip` counts it), rather than the lag growing without
    end while prompts arrive faster than one core encodes them.
    """

    def __init__(
        self,
        encode: Callable[..., list[int]],
        *,
        max_chars: int,
        on_skip: Callable[[], None] | None = None,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        # LocalTokenizer._encode: the Rust core's call without offsets, through the piece cache for a chat.
        self._encode_text = encode
        self._max_chars = max_chars
        self._on_skip = on_skip
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-rest", initializer=initializer)
        self._waiting: list[tuple[str, bool, float, asyncio.Future[Prompt | None]]] = []
        self._chars = 0  # of the texts waiting or being encoded
        self._busy: asyncio.AbstractEventLoop | None = None  # the loop a running batch reports to

    def submit(self, text: str, *, special: bool, started: float) -> asyncio.Future[Prompt | None]:
        loop = asyncio.get_running_loop()
        if self._busy is not None and self._busy.is_closed():  # its loop ended mid-batch: it never reports
            self._busy, self._waiting, self._chars = None, [], 0
        future: asyncio.Future[Prompt | None] = loop.create_future()
        if self._chars and self._chars + len(text) > self._max_chars:  # an idle encoder takes any text
            future.set_result(None)
            if self._on_skip is not None:
                self._on_skip()
            return future
        self._waiting.append((text, special, started, future))
        self._chars += len(text)
        if self._busy is None:
            self._start(loop)
        return future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._waiting = self._waiting, []
        self._busy = loop
        try:
            running = loop.run_in_executor(
                self._thread, self._encode, [(text, special) for text, special, _, _ in batch]
            )
        except RuntimeError as exc:  # shut down: nothing more is encoded
            self._busy = None
            self._chars -= sum(len(text) for text, *_ in batch)
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
                    future.exception()  # retrieved: a future nobody waits for any more logs nothing
            return
        running.add_done_callback(lambda done: self._finished(loop, batch, done))

    def _encode(self, texts: list[tuple[str, bool]]) -> list[list[int]]:
        return [self._encode_text(text, special=special) for text, special in texts]

    def _finished(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[tuple[str, bool, float, asyncio.Future[Prompt | None]]],
        done: asyncio.Future[list[list[int]]],
    ) -> None:
        self._busy = None
        self._chars -= sum(len(text) for text, *_ in batch)
        failure = None if done.cancelled() else done.exception()
        now = time.perf_counter()
        for index, (_, _, started, future) in enumerate(batch):
            if future.done():
                continue
            if done.cancelled():
                future.cancel()
            elif failure is not None:
                future.set_exception(failure)
                future.exception()  # retrieved: a refused request's encoding has nobody waiting for it
            else:
                ids = done.result()[index]
                future.set_result(Prompt(token_ids=ids, num_tokens=len(ids), seconds=now - started))
        if self._waiting:
            self._start(loop)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


# Before any prompt's head is encoded, the characters one token is taken to stand for.
_CHARS_PER_TOKEN_GUESS = 4.0
# The weight of the latest head in the tokenizer's average characters per token.
DENSITY_WEIGHT = 0.1
# How far back from a wanted cut a boundary is looked for; none there and the text is read whole.
_BOUNDARY_WINDOW = 4096


class PromptReader:
    """Reads a prompt's tokens from its start, only as far as a decision needs.

    Every token of a byte-level BPE stands for at least one byte of the text, but the few special
    tokens its post-processor adds: the text's UTF-8 size bounds its tokens before anything is
    encoded (a SentencePiece BPE's and a WordPiece's too, with a token or so more: see bounds.py).
    A head of the text cut just before a space that follows a non-space character splits
    into the same pre-tokens as the whole text up to that boundary (no pre-tokenizer pattern runs from
    a non-space character into a space, and BPE encodes each pre-token alone; a SentencePiece BPE
    whose vocabulary has no token running into a space merges nothing across it), so the head's tokens are
    the whole encoding's first tokens (with a post-processor's special tokens, those up to the head's
    last such boundary before the cut), and the bytes after them bound the rest
    (tests/unit/test_prompt_reader.py checks both over random texts; the tokenizer, at startup). Where
    heads are not read so (`heads` false), a prompt the bound does not settle is encoded whole.
    """

    def __init__(
        self,
        tokenizer: LocalTokenizer,
        text: str,
        *,
        special: bool,
        specials: int,
        started: float,
        extra: int = 0,
        heads: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._text = text
        self._special = special
        self._specials = specials  # the post-processor's tokens: in every encoding of the text
        self._over = specials + extra  # the most tokens the whole text has over its bytes (Bound)
        self._heads = heads  # whether a head is read as the whole encoding's start; else the text is read whole
        self._started = started
        self._size = utf8_size(text)
        self._chars = 0  # characters of the last head encoded
        self._end = 0  # characters the known ids stand for
        self._head: Head | None = None  # the last head read
        self._blocks: dict[int, list[int]] = {}  # the block hashes of the ids read (Prompt.blocks)
        self._words_bound = tokenizer.words_bound
        self._floor = 0  # the most tokens the whole prompt was shown to hold by its bytes or words (at_least)
        # The fewest tokens its bytes can make (what the tokenizer refuses a prompt too long by, unencoded).
        self._by_bytes = tokenizer.fewest_tokens(self._size) + specials
        self._words: int | None = None  # its words, once a split of them reached the text's end
        self._per_token = tokenizer.chars_per_token or _CHARS_PER_TOKEN_GUESS
        # A head cut by the tokenizer's own average errs less than one cut by the fixed guess.
        self._first_margin = 1.5 if tokenizer.chars_per_token is None else 1.2
        self.prompt = self._known([], 0)

    async def more(self, wanted: int, *, onward: bool = False) -> Prompt:
        """The prompt read on, to about `wanted` known tokens (encoding at least twice as far as before), or
        whole; `onward`: on through the chat pieces the tokenizer kept too, which cost no encoding
        (PieceCache.head), so the next step may start past them."""
        text = self._text
        margin = 1.1 if self._chars else self._first_margin  # a guessed size errs long, to read in one step
        known = len(self.prompt.token_ids)
        # The tokens still wanted, at the text's density, past the characters the known ones stand for.
        ahead = math.ceil(max(wanted - known, 1) * self._per_token * margin) + 64
        chars = max(2 * self._chars, self._end + ahead)
        cut = head_cut(text, chars) if chars < len(text) and self._heads else 0
        if cut <= self._end:  # (no boundary past what is known: nothing to read in part)
            cut = 0
        if cut <= 0:
            ids = await self._tokenizer.encode_whole(text, special=self._special)
            self.prompt = self._whole(ids)
            return self.prompt
        head = await self._tokenizer.read_head(text, cut, special=self._special, after=self._head, onward=onward)
        self._head = head
        end, count = head.end, head.count
        if end >= len(text):  # a kept last piece took the head to the text's end: it is whole
            self.prompt = self._whole(head.ids)
            return self.prompt
        self._end = end
        # What the next step doubles: the characters encoded (or looked up) up to the cut, not the kept pieces
        # an onward head went on through after it.
        self._chars = cut if onward else max(cut, end)
        if count:
            self._per_token = max(max(cut, end) / count, 1.0)
            learned = self._tokenizer.chars_per_token
            self._tokenizer.chars_per_token = (
                self._per_token if learned is None else learned + DENSITY_WEIGHT * (self._per_token - learned)
            )
        self.prompt = self._known(head.ids, end)
        return self.prompt

    def at_least(self, count: int) -> bool:
        """Whether the whole prompt holds at least `count` tokens, told without encoding it: by its bytes (no
        token stands for more than the tokenizer's longest token does: LocalTokenizer.bytes_per_token), else,
        where no token spans two words (checked at startup, LocalTokenizer._words_apart), by its words: each
        starts a token of its own. The post-processor's special tokens come on top of either. Only the head
        that holds the first `count` words is scanned (words_in): a long prompt is shown long for the cost of
        counting its head's words (a 1,600-word one's 400: 6 us, where its bytes alone showed it long for
        nothing)."""
        if count <= self._floor:
            return True
        if count <= self._by_bytes:
            self._floor = self._by_bytes
            return True
        if not self._words_bound:
            return False
        if self._words is None:
            words = count - self._specials
            if words <= 0:
                self._floor = count
                return True
            found = words_in(self._text, words)
            if found >= words:
                self._floor = count
                return True
            self._words = found  # the count reached the end: every word was counted
        self._floor = max(self._floor, self._words + self._specials)
        return count <= self._floor

    def tokens_to_bound(self, limit: int) -> int:
        """About how many first tokens must be known for the bound on the whole count to fall below
        `limit`: each token read stands for the bytes the bound counted as one token each."""
        prompt = self.prompt
        assert prompt.at_most is not None
        bytes_per_token = self._size / max(prompt.num_tokens, 1)
        if bytes_per_token <= 1.01:
            return prompt.at_most  # reading on would barely lower the bound: read it whole
        excess = max(prompt.at_most - limit + 1, 0)
        return len(prompt.token_ids) + math.ceil(excess / (bytes_per_token - 1))

    def rest(self, *, later: bool = False, whole: bool = False) -> Prompt:
        """The prompt as read so far, with its whole encoding to come in `rest`: a prompt small enough to
        encode on the event loop is encoded whole at once, which costs the router less CPU than handing it
        to the background thread and waking the loop when that is done. `later`: the whole encoding waits
        for the caller (`Prompt.later`), who may get the ids elsewhere (a prefill answer's).

        Only where the caller needs the whole encoding (`whole`: the blocks of the whole prompt for a
        cache-aware threshold's next decision) or the tokenizer counts every prompt whole (`count_whole`);
        otherwise nothing more is encoded: `rest` holds None at once (the count comes from the engine's
        usage), and `later` takes the ids it is supplied or ends with None."""
        tokenizer = self._tokenizer
        whole = whole or tokenizer.count_whole
        if later:
            waiting = WholeLater(tokenizer if whole else None, self._text, special=self._special, started=self._started)
            self.prompt = self._settled(rest=waiting.future, later=waiting)
            return self.prompt
        if not whole:
            nothing: asyncio.Future[Prompt | None] = asyncio.get_running_loop().create_future()
            nothing.set_result(None)
            self.prompt = self._settled(rest=nothing)
            return self.prompt
        ids = tokenizer.encode_at_once(self._text, special=self._special)
        if ids is not None:
            self.prompt = Prompt(token_ids=ids, num_tokens=len(ids), seconds=time.perf_counter() - self._started)
            return self.prompt
        encoded = tokenizer.encode_rest(self._text, special=self._special, started=self._started)
        self.prompt = self._settled(rest=encoded)
        return self.prompt

    def _settled(self, **rest: Any) -> Prompt:
        """The prompt as read, with `rest` (its whole encoding to come). What its words showed counts too: a
        plan settled by them saw at least as many tokens. Settled, the prompt asks its words nothing more
        (nor keeps this reader alive through `at_least`)."""
        known = self.prompt
        return evolve(known, num_tokens=max(known.num_tokens, self._floor), floor=self._floor, at_least=None, **rest)

    def _known(self, ids: Sequence[int], end: int) -> Prompt:
        """The prompt known by its first `ids`, which stand for `text[:end]`."""
        head = utf8_size(self._text[:end])
        after = self._size - head
        at_most = len(ids) + after + self._over
        per_token = head / len(ids) if ids and head else self._per_token
        estimate = min(max(len(ids) + round(after / per_token), len(ids), self._floor), at_most)
        seconds = time.perf_counter() - self._started
        return Prompt(
            ids,
            estimate,
            seconds,
            at_most=at_most,
            blocks=self._blocks,
            at_least=self.at_least,
            floor=self._floor,
        )

    def _whole(self, ids: Sequence[int]) -> Prompt:
        return Prompt(ids, len(ids), time.perf_counter() - self._started, blocks=self._blocks)


class WholeLater:
    """The whole encoding of a prompt planned on its first tokens, left until it is known whether a
    prefill answer brings the prompt's ids (`supply`: nothing to encode) or not (`start`: encoded as
    `PromptReader.rest` would have, or, without a `tokenizer` to encode it, None: not known). Either
    resolves `future` (the prompt's `rest`), once."""

    def __init__(self, tokenizer: LocalTokenizer | None, text: str, *, special: bool, started: float) -> None:
        self.future: asyncio.Future[Prompt | None] = asyncio.get_running_loop().create_future()
        self._tokenizer = tokenizer
        self._text: str | None = text
        self._special = special
        self._started = started

    @property
    def wanted(self) -> bool:
        """Whether the whole encoding is wanted (the caller asked for it): else it ends with None, unless an
        engine's answer brings the ids anyway."""
        return self._tokenizer is not None

    def supply(self, ids: list[int]) -> None:
        """The whole prompt's ids, counted by an engine."""
        self._text = None
        if not self.future.done():
            self.future.set_result(
                Prompt(token_ids=ids, num_tokens=len(ids), seconds=time.perf_counter() - self._started)
            )

    def start(self) -> None:
        """Encode the whole prompt (at once if it is small, else in the background), unless that is done
        or under way."""
        text, self._text = self._text, None
        if text is None or self.future.done():
            return
        if self._tokenizer is None:
            self.future.set_result(None)  # counted by the engine; indexed as far as it was read
            return
        ids = self._tokenizer.encode_at_once(text, special=self._special)
        if ids is not None:
            self.supply(ids)
            return
        self._tokenizer.encode_rest(text, special=self._special, started=self._started).add_done_callback(self._copy)

    def _copy(self, encoded: asyncio.Future[Prompt | None]) -> None:
        if self.future.done():  # supplied meanwhile
            if not encoded.cancelled():
                encoded.exception()  # retrieved: nobody needs this encoding any more
            return
        if encoded.cancelled():
            self.future.cancel()
        elif (failure := encoded.exception()) is not None:
            self.future.set_exception(failure)
            self.future.exception()  # retrieved: nobody may be waiting for it
        else:
            self.future.set_result(encoded.result())


# A planned prompt whose estimated length (its bytes at the head's bytes per token) is at most this share
# of the context window is not read further for the window's check: the engines make it exactly.
WINDOW_LEFT_TO_ENGINES = 0.75
# Tokens read of a prompt planned without reading, to learn its bytes per token for that estimate: a few
# blocks' worth, as a cached prefix's check reads (512 cost a 32k-token prompt 0.6 ms more, for an estimate that
# only decides whether the engines alone check the window, which they do exactly).
DENSITY_HEAD_TOKENS = 64


async def read_prompt(
    reader: PromptReader,
    settle: Callable[[Prompt], int | None],
    limit: int | None,
    *,
    later: Callable[[Prompt], bool] = lambda prompt: False,
    whole: bool = False,
    below: int | None = None,
) -> Prompt:
    """The prompt read as far as `settle` (how many first tokens would settle the plan: 0 when it is
    settled, None when only the whole prompt will do) and the context window of `limit` tokens need:
    a prompt known in part, its whole encoding coming in `rest` where `whole` asks for it (left to the
    caller where `later` says so of the prompt as read; see PromptReader.rest), or the whole prompt.

    `below`: the threshold a prompt settles under once its bound falls below it. A prompt whose estimate
    is below it (its bytes do not show it yet) reads, of the tokens `settle` asks for, only as many as bring
    its bound below the threshold: the head's tokens and the rest's bytes (PromptReader.tokens_to_bound).
    Asked for the threshold's tokens, which would show it long, such a prompt was encoded whole to show it
    short: one of 1.1 times the threshold's bytes now encodes its first quarter. Only how far a step reads
    changes: `settle` still decides when the plan is settled."""
    prompt = reader.prompt
    while prompt.at_most is not None:
        wanted = settle(prompt)
        if wanted is None:
            wanted = prompt.at_most  # the whole prompt
        elif wanted and below is not None and prompt.num_tokens < below <= prompt.at_most:
            wanted = min(wanted, reader.tokens_to_bound(below))
        if limit is not None and prompt.at_most >= limit and (wanted == 0 or prompt.token_ids):
            if wanted == 0 and not prompt.token_ids:
                # Planned without reading, but the bytes do not show the window fits: a head first, whose
                # density tells whether the prompt is far inside the window or must be read to its bound.
                prompt = await reader.more(DENSITY_HEAD_TOKENS)
                continue
            if wanted == 0 and prompt.num_tokens <= limit * WINDOW_LEFT_TO_ENGINES:
                # Planned, and by the head's own density far inside the window: the engines check the
                # window exactly (as vLLM does, with a 400 the router relays), so the router need not
                # read on; only a prompt whose estimate nears the window is read as far as its bound needs.
                return reader.rest(later=later(prompt), whole=whole)
            # The context window's check is not settled either: read as far as the bound needs (once
            # a head read for the plan has shown how many bytes a token of this text stands for).
            wanted = max(wanted, reader.tokens_to_bound(limit))
        if wanted == 0:
            return reader.rest(later=later(prompt), whole=whole)
        # A threshold that weighs cached prefixes reads a conversation's history on to its new messages at once.
        prompt = await reader.more(wanted, onward=whole)
    return prompt


def utf8_size(text: str) -> int:
    """The text's size in UTF-8 bytes, without encoding an ASCII text (a copy of a long prompt)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def kept_tokens(offsets: Sequence[tuple[int, int]], boundary: int) -> int:
    """How many of a head's first tokens end at or before `boundary` (those the whole text shares)."""
    kept = 0
    for _, end in offsets:
        if end > boundary:
            break
        kept += 1
    return kept


# Text a tokenizer's heads are checked on at startup: words, digits, punctuation before newlines,
# whitespace runs, code and non-Latin scripts.
_PROBE_TEXT = (
    "The quick brown fox, 12345 jumps.\n\nOver   the lazy dog; naïve café 漢字 🙂 ok!\n"
    "def f(x):\n    return x**2  # squared\n\tTabs\tand  \r\n CRLF... (parens) [brackets] {braces}\n"
    "  leading spaces, trailing spaces   \nemoji 🙂🙂 mixed123abc 3.14159 don't we'll I'm\n"
)


def _probe_variants(text: str) -> list[str]:
    """A probe text, its lines in reverse order and each head a reader may cut of it: what the startup checks
    of the word cache encode both ways."""
    heads = [text[: match.start()] for match in BOUNDARY.finditer(text)]
    return [text, "".join(reversed(text.splitlines(keepends=True))), *heads]


def head_cut(text: str, chars: int) -> int:
    """The last place at or before `chars` where `text` may be cut for a head (a space right after a
    non-space character, as `BOUNDARY` matches), looked for a little way back; 0 when there is none.
    Searched from the end: the last boundary is usually a word back, where a scan of the window would
    cross thousands of characters."""
    start = max(0, chars - _BOUNDARY_WINDOW)
    at = text.rfind(" ", start, chars + 1)
    while at > 0:
        if not text[at - 1].isspace():
            return at
        at = text.rfind(" ", start, at)
    return 0


class EngineTokenizer:
    """Counts tokens with an engine's `POST /tokenize` when no local tokenizer is configured."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: Callable[[], list[str]],
        model: Callable[[], str | None],
        *,
        timeout: float = 10.0,
    ):
        self._client = client
        self._urls = urls
        self._model = model
        # A hung engine is passed over after this, not after the client's whole request timeout.
        self._timeout = httpx.Timeout(timeout)

    async def tokenize(self, request: ClientRequest, *, max_tokens: int | None = None) -> Prompt:
        started = time.perf_counter()
        body = request.body
        chat = request.template_body
        if chat is not None:
            payload: dict[str, Any] = {"messages": chat["messages"], "add_generation_prompt": True}
            if chat.get("tools") is not None:
                payload["tools"] = chat["tools"]
            model = self._model()
            if model:
                payload["model"] = model
            batches = [await self._ask(payload)]
        else:
            prompt = body["prompt"]
            if isinstance(prompt, str):
                batches = [await self._ask({"prompt": prompt, "add_special_tokens": True})]
            elif prompt and isinstance(prompt[0], int):
                batches = [prompt]
            elif prompt and isinstance(prompt[0], list):
                batches = list(prompt)
            else:
                batches = list(
                    await asyncio.gather(*(self._ask({"prompt": p, "add_special_tokens": True}) for p in prompt))
                )
        return Prompt(
            token_ids=batches[0],
            num_tokens=sum(len(ids) for ids in batches),
            seconds=time.perf_counter() - started,
        )

    async def _ask(self, payload: dict[str, Any]) -> list[int]:
        last_error = "no engine to ask"
        for url in self._urls():
            try:
                response = await self._client.post(
                    f"{url}/tokenize", content=orjson.dumps(payload), timeout=self._timeout
                )
            except httpx.HTTPError as exc:
                last_error = f"{url}: {type(exc).__name__}"
                continue
            if response.status_code == 400:
                raise InvalidRequest(_engine_error_message(response))
            if response.status_code != 200:
                last_error = f"{url}: status {response.status_code}"
                continue
            return list(orjson.loads(response.content)["tokens"])
        raise UpstreamError(f"Could not tokenize the prompt: {last_error}")

    async def aclose(self) -> None:
        pass


def _engine_error_message(response: httpx.Response) -> str:
    try:
        return str(orjson.loads(response.content)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response.text[:500]
