"""A prompt read only as far as routing needs: its head is the whole encoding's start, its bound holds,
and the plan made on it is the plan the whole prompt gets (over random prompts, templates, thresholds,
cached prefixes and pools)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpd_router.config import load_settings
from dpd_router.pool.pool import Pool
from dpd_router.prompt.context_window import check_context_length
from dpd_router.prompt.tokenizer import (
    WINDOW_LEFT_TO_ENGINES,
    WORDS_INLINE_SHARE,
    LocalTokenizer,
    Prompt,
    PromptReader,
    PromptTooLong,
    head_cut,
    read_prompt,
    utf8_size,
)
from dpd_router.prompt.word_cache import BOUNDARY
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import InvalidRequest
from dpd_router.routing.planner import REACH_HEAD_BLOCKS, Planner, build_planner
from dpd_router.routing.request import RoutingRequest
from dpd_sim.tokenizer_kit import _WORDS
from tests.tokenizer_families import FAMILIES
from tests.tokenizer_families import build as build_family

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PIECES = (
    *_WORDS[:200],
    "<s>",
    "</s>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "naïve",
    "café",
    "漢字",
    "🙂",
    "Ωmega",
    "x**2",
    "f(x):",
    "return",
    "12345",
    "3.14",
    "don't",
    "we'll",
    "...",
    "--",
    "{",
    "}",
    "[0]",
    "\u00a0",
    "\u2003",
    "\x1c",
    "é\u0301",
)
SEPARATORS = (" ", " ", " ", "  ", "\n", "\n\n", "\t", "", " \n ", "   \n", "\r\n", ".\n")


def text_of(pieces: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(PIECES) + rng.choice(SEPARATORS) for _ in range(pieces)).strip(" ") or "x"


@pytest.fixture(scope="module")
def local(tokenizer_dir: Path) -> LocalTokenizer:
    """A tokenizer that encodes a prompt read in part whole after its plan (`count_whole_prompts`)."""
    return LocalTokenizer.load(tokenizer_dir, inline_max_chars=2048, threads=1, count_whole=True)


@pytest.fixture(scope="module")
def deciding(tokenizer_dir: Path) -> LocalTokenizer:
    """The default: a prompt is encoded only as far as a decision needs."""
    return LocalTokenizer.load(tokenizer_dir, inline_max_chars=2048, threads=1)


@pytest.fixture(scope="module")
def chatml(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LocalTokenizer:
    """The same vocabulary behind another chat template (ChatML, whose markers are plain text here)."""
    directory = tmp_path_factory.mktemp("chatml") / "tokenizer"
    shutil.copytree(tokenizer_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return LocalTokenizer.load(directory, inline_max_chars=2048, threads=1, count_whole=True)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LocalTokenizer]:
    """Tokenizers of the other families whose bytes bound their tokens (tests/tokenizer_families.py), as
    `local` is loaded."""
    return {
        family: LocalTokenizer.load(
            build_family(family, tmp_path_factory.mktemp(family)), inline_max_chars=2048, threads=1, count_whole=True
        )
        for family in FAMILIES
    }


texts = st.builds(text_of, st.integers(1, 1500), st.integers(0, 2**32))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, wanted=st.integers(1, 3000), special=st.booleans())
def test_a_head_read_starts_the_whole_encoding_and_its_bytes_bound_the_rest(
    local: LocalTokenizer, text: str, wanted: int, special: bool
) -> None:
    whole = local._encode(text, special=special)

    async def read() -> list[Prompt]:
        assert local.bound is not None
        specials = local.bound.specials if special else 0
        reader = PromptReader(local, text, special=special, specials=specials, started=0.0)
        prompts = [reader.prompt]
        step = wanted
        while prompts[-1].at_most is not None:
            prompts.append(await reader.more(step))
            step *= 2
        return prompts

    for prompt in asyncio.run(read()):
        known = list(prompt.token_ids)
        assert known == whole[: len(known)]
        if prompt.at_most is None:
            assert known == whole and prompt.num_tokens == len(whole)
        else:
            assert len(known) <= prompt.num_tokens <= prompt.at_most
            assert len(whole) <= prompt.at_most


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, counts=st.lists(st.integers(0, 4000), min_size=1, max_size=4), special=st.booleans())
def test_a_prompts_words_bound_its_tokens_from_below(
    local: LocalTokenizer, text: str, counts: list[int], special: bool
) -> None:
    """No token spans two words: a prompt holds at least its words (and the post-processor's tokens) in
    tokens, and at_least says so of every count up to there, and of none past it, however it is asked."""
    assert local.words_bound
    whole = local._encode(text, special=special)
    assert local.bound is not None
    specials = local.bound.specials if special else 0
    shown = len(text.split()) + specials
    assert shown <= len(whole)
    reader = PromptReader(local, text, special=special, specials=specials, started=0.0)
    for count in counts:
        assert reader.at_least(count) == (count <= shown)
    assert reader.prompt.at_least is not None


@dataclass(frozen=True)
class Case:
    chat: bool
    # The tokenizer: the simulator's (byte-level BPE), its vocabulary behind ChatML, or another family's.
    family: str
    pieces: int
    seed: int
    # The threshold as a share of the prompt's whole count (1e6: above every prompt).
    threshold: float
    mode: str
    strategy: str
    prefillers: int
    decoders: int
    limit: int | None
    # Prefixes of this prompt already placed: (share of its tokens, endpoint index).
    cached: tuple[tuple[float, int], ...]


cases = st.builds(
    Case,
    chat=st.booleans(),
    family=st.sampled_from(("byte", "chatml", *FAMILIES)),
    pieces=st.one_of(st.integers(1, 2000), st.integers(2000, 12000)),
    seed=st.integers(0, 2**32),
    threshold=st.one_of(st.floats(0.0, 0.3), st.floats(0.0, 1.5), st.just(1e6)),
    mode=st.sampled_from(["static", "cache_aware"]),
    strategy=st.sampled_from(["prefixaware", "roundrobin", "leastloaded", "kvaware"]),
    prefillers=st.integers(0, 2),
    decoders=st.integers(1, 3),
    limit=st.one_of(st.none(), st.integers(100, 40000)),
    cached=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 4)), max_size=3).map(tuple),
)


def planner_for(case: Case, whole: Prompt) -> Planner:
    settings = load_settings(
        decode_urls=[f"http://127.0.0.1:82{i:02d}" for i in range(case.decoders)],
        prefill_urls=[f"http://127.0.0.1:81{i:02d}" for i in range(case.prefillers)] or None,
        routing_threshold=max(1, min(int(whole.num_tokens * case.threshold), 10**9)),
        threshold_mode=case.mode,
        prefill_strategy=case.strategy,
    )
    pool = Pool(settings.prefill_urls, settings.decode_urls)
    planner = build_planner(settings, pool, RouterMetrics())
    assert planner.cache is not None
    endpoints = pool.endpoints()
    for share, index in case.cached:
        tokens = int(len(whole.token_ids) * share)
        prefix = Prompt(token_ids=whole.token_ids[:tokens], num_tokens=tokens, seconds=0.0)
        planner.cache.record(RoutingRequest(prefix), [endpoints[index % len(endpoints)]])
    return planner


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_the_plan_of_a_prompt_read_in_part_is_the_plan_of_the_whole_prompt(
    local: LocalTokenizer, chatml: LocalTokenizer, families: dict[str, LocalTokenizer], case: Case
) -> None:
    tokenizer = {"byte": local, "chatml": chatml, **families}[case.family]
    text = text_of(case.pieces, case.seed)
    if case.chat:
        body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]}
        request = parse_request("chat", orjson.dumps(body))
    else:
        request = parse_request("completion", orjson.dumps({"prompt": text}))

    async def plans() -> tuple[Prompt, Prompt, Prompt | None]:
        whole = await tokenizer.tokenize(request)
        reader = await tokenizer.reader(request, max_tokens=case.limit)
        assert reader is not None
        fast = planner_for(case, whole)
        read = await read_prompt(reader, fast.tokens_to_settle, case.limit, below=fast.threshold)
        rest = None if read.rest is None else await read.rest
        return whole, read, rest

    try:
        whole, read, rest = asyncio.run(plans())
    except PromptTooLong:
        return  # refused by size before any reading, as the whole count would be
    assert list(read.token_ids) == list(whole.token_ids)[: len(read.token_ids)]
    if read.at_most is not None:
        assert rest is not None and list(rest.token_ids) == list(whole.token_ids)
        assert whole.num_tokens <= read.at_most
    left_to_engines = case.limit is not None and read.at_most is not None and read.at_most >= case.limit
    if left_to_engines:
        # Planned, and far inside the window by the head's density: the engines check the window exactly,
        # and the router does not refuse it.
        assert case.limit is not None and read.num_tokens <= case.limit * WINDOW_LEFT_TO_ENGINES
        assert refusal(request, Prompt(read.token_ids, read.num_tokens, 0.0), case.limit) is None
    elif case.limit is not None:
        # Within its bound: the context window's check refuses exactly what it would refuse of the whole.
        checked = read if read.at_most is None else Prompt(read.token_ids, read.at_most, 0.0)
        assert refusal(request, whole, case.limit) == refusal(request, checked, case.limit)
    full_plan = planner_for(case, whole).plan(whole)
    # Settled means whatever the whole count turns out to be: the plan is the same at both ends of the bound.
    # The lowest: what its ids or its words showed (Prompt.floor), never past the whole count.
    assert read.floor <= whole.num_tokens
    lowest = max(len(read.token_ids), read.floor)
    counts = {read.num_tokens} if read.at_most is None else {lowest, read.num_tokens, read.at_most}
    for count in counts:
        fast_plan = planner_for(case, whole).plan(replace(read, num_tokens=count))
        assert (fast_plan.path, fast_plan.reason, fast_plan.decoder.url) == (
            full_plan.path,
            full_plan.reason,
            full_plan.decoder.url,
        )
        assert (fast_plan.prefiller and fast_plan.prefiller.url) == (full_plan.prefiller and full_plan.prefiller.url)


def refusal(request: object, prompt: Prompt, limit: int) -> str | None:
    try:
        check_context_length(request, prompt, limit)  # type: ignore[arg-type]
    except InvalidRequest as exc:
        return exc.message
    return None


@pytest.mark.parametrize("shown_by", ["words", "bytes", None])
async def test_a_long_prompt_is_read_only_as_far_as_its_plan_needs(
    local: LocalTokenizer, shown_by: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its words, or its bytes over the longest token's, show it past the threshold: read only as far as the
    cached prefixes need (a few blocks). Without either bound (a tokenizer whose tokens may span words, with
    a very long token), its ids are read to the threshold."""
    text = text_of(20000, 1)
    request = parse_request("completion", orjson.dumps({"prompt": text}))
    whole = await local.tokenize(request)
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200"], prefill_urls=["http://127.0.0.1:8100"], routing_threshold=2048
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    monkeypatch.setattr(local, "words_bound", shown_by == "words")
    if shown_by != "bytes":
        monkeypatch.setattr(local, "bytes_per_token", 1 << 20)
    reader = await local.reader(request)
    assert reader is not None
    read = await read_prompt(reader, planner.tokens_to_settle, None)
    assert read.at_most is not None and read.rest is not None
    if shown_by is not None:
        # A first head of a few blocks (cut by the guess of four characters a token: these texts hold two).
        assert REACH_HEAD_BLOCKS * 16 <= len(read.token_ids) < 2048 / 8 and 2048 <= read.floor <= read.num_tokens
        assert read.floor <= whole.num_tokens
        if shown_by == "bytes":  # shown by the bytes alone: the fewest tokens they can make
            assert read.floor >= utf8_size(text) // local.bytes_per_token
    else:
        assert read.floor == 0
        assert 2048 <= len(read.token_ids) < whole.num_tokens / 2
    assert (await read.rest).token_ids == whole.token_ids
    lowest = max(len(read.token_ids), read.floor)
    for count in (lowest, read.num_tokens):
        fresh = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
        assert fresh.plan(replace(read, num_tokens=count)).reason == "long_prompt"


@pytest.mark.parametrize("decoders", [1, 2])
async def test_under_a_static_threshold_one_endpoint_of_each_role_reads_no_ids_of_a_prompt_long_by_its_words(
    local: LocalTokenizer, decoders: int
) -> None:
    """A static threshold weighs no cached prefix, and one decoder and one prefiller leave nothing to rank by
    one: a prompt its words show long is planned with no id read. With two decoders, its first blocks tell
    which holds more of it."""
    request = parse_request("completion", orjson.dumps({"prompt": text_of(20000, 1)}))
    settings = load_settings(
        decode_urls=[f"http://127.0.0.1:82{i:02d}" for i in range(decoders)],
        prefill_urls=["http://127.0.0.1:8100"],
        routing_threshold=2048,
        threshold_mode="static",
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    reader = await local.reader(request)
    assert reader is not None
    read = await read_prompt(reader, planner.tokens_to_settle, None)
    assert read.floor >= 2048 and planner.plan(read).reason == "long_prompt"
    if decoders == 1:
        assert list(read.token_ids) == []
    else:
        assert REACH_HEAD_BLOCKS * 16 <= len(read.token_ids) < 2048 / 8


async def test_a_prompt_bound_for_the_prefill_hop_waits_for_its_ids_or_is_encoded_when_asked(
    local: LocalTokenizer,
) -> None:
    """Left `later`, a prompt's whole encoding starts only when no prefill answer brings its ids."""
    request = parse_request("completion", orjson.dumps({"prompt": text_of(20000, 1)}))
    whole = await local.tokenize(request)
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200"], prefill_urls=["http://127.0.0.1:8100"], routing_threshold=64
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    for supplied in (True, False):
        reader = await local.reader(request)
        assert reader is not None
        read = await read_prompt(reader, planner.tokens_to_settle, None, later=lambda prompt: True)
        assert read.later is not None and read.rest is not None and read.at_most is not None
        await asyncio.sleep(0.05)
        assert not read.rest.done()  # nothing encodes it meanwhile
        if supplied:
            read.later.supply(list(whole.token_ids))
        read.later.start()  # a no-op once supplied; else the encoding the reader would have started
        read.later.start()  # and only once
        assert list((await read.rest).token_ids) == list(whole.token_ids)


async def test_a_window_far_above_the_estimate_is_left_to_the_engines_and_a_near_one_is_read_to_its_bound(
    local: LocalTokenizer,
) -> None:
    request = parse_request("completion", orjson.dumps({"prompt": text_of(20000, 1)}))
    whole = await local.tokenize(request)
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200"], prefill_urls=["http://127.0.0.1:8100"], routing_threshold=2048
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    # The bytes bound the count far above the whole count: a window between the two.
    roomy = int(whole.num_tokens / WINDOW_LEFT_TO_ENGINES * 1.2)
    reader = await local.reader(request, max_tokens=roomy)
    assert reader is not None and reader.prompt.at_most is not None and reader.prompt.at_most >= roomy
    read = await read_prompt(reader, planner.tokens_to_settle, roomy)
    assert read.at_most is not None and read.at_most >= roomy  # its bound is not inside the window...
    assert len(read.token_ids) < whole.num_tokens / 2  # ...yet it was read only as far as the plan needs
    assert (await read.rest).num_tokens == whole.num_tokens
    # A window the prompt nearly fills: read on until the bound is inside it, as the check needs.
    tight = int(whole.num_tokens * 1.05)
    reader = await local.reader(request, max_tokens=tight)
    assert reader is not None
    read = await read_prompt(reader, planner.tokens_to_settle, tight)
    assert read.at_most is None or read.at_most < tight


async def test_a_prompt_below_the_threshold_by_its_bytes_is_encoded_off_the_requests_path(
    local: LocalTokenizer,
) -> None:
    # Past what is encoded on the event loop: twice the inline size, where a chat's words are kept (WordCache).
    text = text_of(1200, 2)
    assert WORDS_INLINE_SHARE * 2048 < len(text) < 8192 - 64
    request = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": text}]}))
    settings = load_settings(decode_urls=["http://127.0.0.1:8200"], routing_threshold=8192)
    planner = build_planner(settings, Pool([], settings.decode_urls), RouterMetrics())
    reader = await local.reader(request)
    assert reader is not None
    read = await read_prompt(reader, planner.tokens_to_settle, 32768)
    assert read.token_ids == [] and read.rest is not None
    assert (await read.rest).num_tokens == (await local.tokenize(request)).num_tokens


async def test_a_small_prompt_is_encoded_whole_at_once_rather_than_in_the_background(local: LocalTokenizer) -> None:
    """Up to the inline size (tokenize_inline_max_chars), encoding costs less than the hand-off."""
    request = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": text_of(50, 2)}]}))
    settings = load_settings(decode_urls=["http://127.0.0.1:8200"], routing_threshold=4096)
    planner = build_planner(settings, Pool([], settings.decode_urls), RouterMetrics())
    reader = await local.reader(request)
    assert reader is not None
    read = await read_prompt(reader, planner.tokens_to_settle, 32768)
    assert read.at_most is None and read.rest is None
    assert read.token_ids == (await local.tokenize(request)).token_ids


def spy_encodings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the texts every LocalTokenizer encodes from now on (heads, whole texts, pieces), in turn:
    a whole text's, not again its own parts' (a text prompt's words are encoded by `_plain`)."""
    encoded: list[int] = []
    ids_and_offsets, encode, plain = LocalTokenizer._ids_and_offsets, LocalTokenizer._encode, LocalTokenizer._plain
    within = threading.local()

    def spy_head(self: LocalTokenizer, text: str, special: bool) -> tuple[list[int], list[tuple[int, int]]]:
        encoded.append(len(text))
        return ids_and_offsets(self, text, special)

    def spy_whole(self: LocalTokenizer, text: str, *, special: bool) -> list[int]:
        encoded.append(len(text))
        within.whole = True
        try:
            return encode(self, text, special=special)
        finally:
            within.whole = False

    def spy_plain(self: LocalTokenizer, text: str) -> list[int]:
        if not getattr(within, "whole", False):
            encoded.append(len(text))
        return plain(self, text)

    monkeypatch.setattr(LocalTokenizer, "_ids_and_offsets", spy_head)
    monkeypatch.setattr(LocalTokenizer, "_encode", spy_whole)
    monkeypatch.setattr(LocalTokenizer, "_plain", spy_plain)
    return encoded


@pytest.mark.parametrize("chars", [200, 3000, 80000])
async def test_a_static_threshold_has_a_prompt_encoded_no_further_than_its_plan_needs(
    deciding: LocalTokenizer, chars: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small (inline), mid-sized and long prompts, direct or bound for the prefill hop: read as far as the
    plan needs and no further, on or off the request's path; what was read starts the whole encoding."""
    text = text_of(chars // 4, chars)
    request = parse_request("completion", orjson.dumps({"prompt": text}))
    whole = await deciding.tokenize(request)
    encoded = spy_encodings(monkeypatch)
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200", "http://127.0.0.1:8201"],
        prefill_urls=["http://127.0.0.1:8100"],
        routing_threshold=256,
        threshold_mode="static",
        prefill_strategy="roundrobin",  # reads nothing past the threshold (prefixaware reads its match length)
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    for later in (False, True):
        encoded.clear()
        reader = await deciding.reader(request)
        assert reader is not None
        read = await read_prompt(reader, planner.tokens_to_settle, None, later=lambda prompt, later=later: later)
        await asyncio.sleep(0.05)
        if read.at_most is None:  # read whole by its first head: a prompt near the threshold
            assert whole.num_tokens < 3 * 256 and len(encoded) == 1
            continue
        assert list(read.token_ids) == list(whole.token_ids[: len(read.token_ids)])
        assert sum(encoded) < len(text) or len(encoded) == 1  # the heads read, never the whole again
        assert max(encoded, default=0) < len(text)
        assert read.rest is not None
        if later:
            assert read.later is not None and not read.rest.done()  # waits for a prefill answer's ids
            read.later.start()  # none came: nothing is encoded, the engine's usage counts it
        assert await read.rest is None
        assert max(encoded, default=0) < len(text)
        assert planner.plan(read).path == planner.plan(whole).path


@pytest.mark.parametrize(("share", "most_read"), [(1.1, 0.5), (1.5, 0.9), (2.0, 1.0)])
async def test_a_prompt_below_the_threshold_but_not_by_its_bytes_is_read_until_its_bound_shows_it(
    deciding: LocalTokenizer, share: float, most_read: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its bytes (`share` times the threshold) do not show it below the threshold, its estimate does: a head
    brings its bound (the head's tokens and the rest's bytes) below the threshold, with a smaller part of it
    encoded the nearer its bytes are to the threshold (`most_read`, a share of its characters); it is planned
    as the whole prompt is, and nothing more is encoded after. Without `below`, the plan asks for the
    threshold's tokens and it is encoded whole."""
    threshold = 1024
    words, text = 0, ""
    while utf8_size(text) < share * threshold:
        words += 16
        text = text_of(words, 7)
    request = parse_request("completion", orjson.dumps({"prompt": text}))
    whole = await deciding.tokenize(request)
    assert whole.num_tokens < threshold
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200"],
        prefill_urls=["http://127.0.0.1:8100"],
        routing_threshold=threshold,
        threshold_mode="static",
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    encoded = spy_encodings(monkeypatch)
    for below in (threshold, None):
        encoded.clear()
        reader = await deciding.reader(request)
        assert reader is not None
        read = await read_prompt(reader, planner.tokens_to_settle, None, below=below)
        assert read.rest is None or await read.rest is None
        await asyncio.sleep(0.05)
        assert planner.plan(read).path == planner.plan(whole).path == "direct"
        if below is None or most_read >= 1.0:
            assert read.at_most is None or sum(encoded) >= len(text)  # read whole (or nearly)
            continue
        assert read.at_most is not None and read.at_most < threshold
        assert list(read.token_ids) == list(whole.token_ids[: len(read.token_ids)])
        assert 0 < sum(encoded) <= most_read * len(text), (sum(encoded), len(text))


async def test_a_prefill_answers_ids_make_a_prompt_read_in_part_whole(deciding: LocalTokenizer) -> None:
    request = parse_request("completion", orjson.dumps({"prompt": text_of(20000, 1)}))
    whole = await deciding.tokenize(request)
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200"], prefill_urls=["http://127.0.0.1:8100"], routing_threshold=64
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    reader = await deciding.reader(request)
    assert reader is not None
    read = await read_prompt(reader, planner.tokens_to_settle, None, later=lambda prompt: True)
    assert read.later is not None and read.rest is not None
    read.later.supply(list(whole.token_ids))
    read.later.start()  # a no-op once supplied
    supplied = await read.rest
    assert supplied is not None and list(supplied.token_ids) == list(whole.token_ids)


async def test_adaptive_mode_reads_the_whole_prompt(local: LocalTokenizer) -> None:
    request = parse_request("completion", orjson.dumps({"prompt": text_of(3000, 3)}))
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200"],
        prefill_urls=["http://127.0.0.1:8100"],
        routing_threshold=512,
        threshold_mode="adaptive",
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    reader = await local.reader(request)
    assert reader is not None
    read = await read_prompt(reader, planner.tokens_to_settle, None)
    assert read.at_most is None and read.token_ids == (await local.tokenize(request)).token_ids


async def test_a_prompt_cached_on_its_decoder_is_read_past_the_cached_prefix_by_the_threshold(
    local: LocalTokenizer,
) -> None:
    """The decoder holds 30% of the prompt: the uncached rest must be known to reach the threshold
    before the plan is long (at the lowest count the bound allows, it would still be long)."""
    request = parse_request("completion", orjson.dumps({"prompt": text_of(20000, 4)}))
    whole = await local.tokenize(request)
    held = int(whole.num_tokens * 0.3)
    threshold = int(whole.num_tokens * 0.1)
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200", "http://127.0.0.1:8201"],
        prefill_urls=["http://127.0.0.1:8100"],
        routing_threshold=threshold,
        threshold_mode="cache_aware",
        prefill_strategy="roundrobin",
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    assert planner.cache is not None
    prefix = Prompt(token_ids=whole.token_ids[:held], num_tokens=held, seconds=0.0)
    planner.cache.record(RoutingRequest(prefix), [planner.pool.decoders[1]])
    reader = await local.reader(request)
    assert reader is not None
    read = await read_prompt(reader, planner.tokens_to_settle, None)
    assert read.at_most is None or len(read.token_ids) >= held + threshold
    lowest = planner.plan(replace(read, num_tokens=len(read.token_ids)))
    assert (lowest.reason, lowest.decoder.url) == ("long_prompt", "http://127.0.0.1:8201")


@dataclass(frozen=True)
class Known:
    tokens: int
    seed: int
    known: int  # the prompt's first tokens known (all of them when it has fewer)
    slack: float  # how far the bound lies past the whole count, as a share of it
    case: Case
    # How far past the known tokens its words show the whole count to reach, as a share of the rest (None: no bound).
    words: float | None = None


@settings(max_examples=1000, deadline=None)
@given(
    st.builds(
        Known,
        tokens=st.integers(1, 8000),
        seed=st.integers(0, 2**32),
        known=st.integers(0, 8000),
        slack=st.one_of(st.just(0.0), st.floats(0.0, 2.0)),
        case=cases,
        words=st.one_of(st.none(), st.floats(0.0, 1.0)),
    )
)
def test_a_settled_plan_is_the_plan_of_every_prompt_the_known_tokens_allow(known: Known) -> None:
    """Over random ids, not only where a reader's steps happen to stop: whatever the whole count
    between the known tokens and the bound, a settled plan is the whole prompt's plan."""
    rng = random.Random(known.seed)
    ids = [rng.randrange(4000) for _ in range(known.tokens)]
    whole = Prompt(token_ids=ids, num_tokens=len(ids), seconds=0.0)
    count = min(known.known, len(ids))
    at_most = len(ids) + int(len(ids) * known.slack)
    floor = count if known.words is None else count + int((len(ids) - count) * known.words)
    shown = None if known.words is None else (lambda tokens: tokens <= floor)
    part = Prompt(token_ids=ids[:count], num_tokens=count, seconds=0.0, at_most=at_most, at_least=shown)
    case = known.case
    if planner_for(case, whole).tokens_to_settle(part) != 0:
        return
    full_plan = planner_for(case, whole).plan(whole)
    for tokens in {floor, len(ids), at_most}:
        plan = planner_for(case, whole).plan(replace(part, num_tokens=tokens))
        assert (plan.path, plan.reason, plan.decoder.url) == (full_plan.path, full_plan.reason, full_plan.decoder.url)
        assert (plan.prefiller and plan.prefiller.url) == (full_plan.prefiller and full_plan.prefiller.url)


def test_a_cached_prefix_running_past_the_known_tokens_leaves_the_plan_unsettled() -> None:
    """Two decoders hold prefixes longer than what is known: only the whole prompt tells which holds more.
    Once one of them ends inside the known tokens, the other holds more however far its prefix runs."""
    rng = random.Random(5)
    ids = [rng.randrange(4000) for _ in range(4000)]
    whole = Prompt(token_ids=ids, num_tokens=len(ids), seconds=0.0)
    case = Case(False, "byte", 1, 1, 1e6, "static", "roundrobin", 1, 2, None, cached=((0.5, 1), (0.75, 2)))
    for known, settled in ((1000, False), (1900, False), (2500, True), (3100, True)):
        part = Prompt(token_ids=ids[:known], num_tokens=known, seconds=0.0, at_most=5000)
        planner = planner_for(case, whole)
        assert (planner.tokens_to_settle(part) == 0) == settled
        if settled:
            assert planner.plan(part).decoder.url == planner_for(case, whole).plan(whole).decoder.url
    assert planner_for(case, whole).plan(whole).decoder.url == "http://127.0.0.1:8201"


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from([" ", "a", "b", "\n", "\t", "\u00a0", "\u3000", "\x1c", "\u00e9"])),
    data=st.data(),
)
def test_a_head_is_cut_at_the_last_boundary_the_pattern_finds(text: str, data: st.DataObject) -> None:
    """head_cut searches back from the cut; the boundary pattern, scanned forward, says where cuts may be."""
    chars = data.draw(st.integers(-1, len(text) + 1))
    boundaries = [match.start() for match in BOUNDARY.finditer(text, 0, max(chars + 1, 0))]
    assert head_cut(text, chars) == (boundaries[-1] if boundaries else 0)


async def test_a_prompts_first_head_is_cut_by_the_density_of_the_prompts_read_before(tokenizer_dir: Path) -> None:
    """The fixed guess of four characters a token, with its margin, reads these texts (two characters a token)
    nearly three times as far as their plan needs; once heads were read, the tokenizer's own average cuts the
    next prompt's first head close to the tokens its plan wants, still in one step."""
    local = LocalTokenizer.load(tokenizer_dir, inline_max_chars=2048, threads=1)
    assert local.chars_per_token is None
    # Its ids are read to the threshold, not shown long by its words or bytes (as a tokenizer's whose tokens may
    # span words, and whose longest token is very long).
    local.words_bound = False
    local.bytes_per_token = 1 << 20
    settings = load_settings(
        decode_urls=["http://127.0.0.1:8200"],
        prefill_urls=["http://127.0.0.1:8100"],
        routing_threshold=400,
        threshold_mode="static",
    )
    planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
    read_tokens = []
    for seed in range(6):
        request = parse_request("completion", orjson.dumps({"prompt": text_of(8000, seed)}))
        reader = await local.reader(request)
        assert reader is not None
        steps: list[int] = []

        async def counted(
            wanted: int, *, onward: bool = False, more: Any = reader.more, steps: list[int] = steps
        ) -> Prompt:
            steps.append(wanted)
            return await more(wanted, onward=onward)  # type: ignore[no-any-return]

        reader.more = counted  # type: ignore[method-assign]
        read = await read_prompt(reader, planner.tokens_to_settle, None)
        assert read.at_most is not None and len(steps) == 1 and len(read.token_ids) >= 400
        read_tokens.append(len(read.token_ids))
    assert local.chars_per_token is not None
    wanted = 400 + 16
    assert read_tokens[0] > 2 * wanted  # the fixed guess: 4 characters, far more than these texts' tokens
    assert all(wanted <= tokens < 1.5 * wanted for tokens in read_tokens[2:])


conversations = st.lists(
    st.tuples(
        st.sampled_from(["system", "user", "assistant", "tool"]),
        st.builds(text_of, st.integers(0, 120), st.integers(0, 2**32)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=conversations, chatml_template=st.booleans(), data=st.data())
def test_a_conversation_encodes_as_its_pieces_do_whole_and_in_every_head(
    local: LocalTokenizer, chatml: LocalTokenizer, turns: list[tuple[str, str]], chatml_template: bool, data: Any
) -> None:
    """Rendered by either template (its markers added tokens, or plain text as ChatML's are here), with the
    markers in the messages too: the piece cache's encoding is the Rust core's of the whole text, and a head's
    settled tokens start it, however many of its pieces the cache held already (a turn sent again)."""
    tokenizer = chatml if chatml_template else local
    assert tokenizer._pieces is not None and tokenizer._backend is not None
    body = {"messages": [{"role": role, "content": content} for role, content in turns]}
    text = tokenizer._render(body)
    whole = list(tokenizer._backend.encode_batch([text], add_special_tokens=False)[0].ids)
    for _ in range(2):  # the second time, every piece is kept
        assert tokenizer._encode(text, special=False) == whole
        cuts = sorted(head_cut(text, data.draw(st.integers(0, len(text)))) for _ in range(2))
        onward = data.draw(st.booleans())  # on through the pieces kept, past the cut
        earlier = None
        for cut in cuts:
            if not cut:
                continue
            if onward and earlier is not None and cut <= earlier.end:
                continue  # read on past its cut already (the reader's next cut is always past its last head)
            head = tokenizer._head(text, cut, False, earlier, onward)
            known = list(head.ids)
            assert known == whole[: len(known)] and head.count >= len(known)
            assert head.end <= cut or head.whole_end == head.end  # past the cut: a kept piece taken whole
            assert len(known) == len(
                tokenizer._backend.encode_batch([text[: head.end]], add_special_tokens=False)[0].ids
            )
            assert head.whole_ids <= len(known) and head.whole_end <= head.end
            assert head == tokenizer._head(
                text, cut, False, None, onward
            )  # going on from a shorter head reads as afresh
            earlier = head


@pytest.mark.parametrize("decoders", [1, 2, 3])
async def test_a_conversations_turns_read_their_history_from_the_pieces_kept_and_plan_as_the_whole_prompt(
    tokenizer_dir: Path, decoders: int
) -> None:
    """Turn after turn, under a cache-aware threshold whose decoder holds the conversation so far: a turn's
    history is read from the pieces kept (nothing encoded), its new messages are bounded by their bytes, and
    its plan is the whole prompt's: direct while what the decoder would compute stays below the threshold."""
    # A tokenizer of its own: the pieces other tests left kept, and the density their prompts taught, would
    # decide how far these heads read, and so which turns are read in part.
    deciding = LocalTokenizer.load(tokenizer_dir, inline_max_chars=2048, threads=1)
    settings = load_settings(
        decode_urls=[f"http://127.0.0.1:82{i:02d}" for i in range(decoders)],
        prefill_urls=["http://127.0.0.1:8100"],
        routing_threshold=700,
        threshold_mode="cache_aware",
    )
    history: list[tuple[Prompt, list[int]]] = []  # each turn's whole prompt, and where its plan put it

    def fresh() -> Planner:
        planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
        assert planner.cache is not None
        endpoints = planner.pool.endpoints()
        for prompt, placed in history:
            planner.cache.record(RoutingRequest(prompt), [endpoints[index] for index in placed])
        return planner

    messages: list[dict[str, str]] = []
    read_in_part = 0
    for turn in range(10):
        messages.append({"role": "user", "content": text_of(60 + 40 * (turn % 3), 1000 * decoders + turn)})
        request = parse_request("chat", orjson.dumps({"messages": messages}))
        # Encoded whole by the Rust core alone: the piece cache keeps only what the router's own reading met.
        assert request.template_body is not None
        ids, _ = deciding._ids_and_offsets(deciding._render(request.template_body), False)
        whole = Prompt(ids, len(ids), 0.0)
        planner = fresh()
        reader = await deciding.reader(request)
        assert reader is not None
        read = await read_prompt(reader, planner.tokens_to_settle, None, whole=planner.weighs_whole_prefixes)
        assert list(read.token_ids) == list(whole.token_ids)[: len(read.token_ids)]
        read_in_part += read.at_most is not None
        if read.rest is not None:
            # Its whole encoding, made in the background, keeps the turn's pieces: done before the next turn
            # comes (as it is behind a real answer), so which pieces the next turn finds kept is not a race.
            await read.rest
        fast, full = planner.plan(read), fresh().plan(whole)
        assert (fast.path, fast.reason, fast.decoder.url) == (full.path, full.reason, full.decoder.url), turn
        urls = [endpoint.url for endpoint in planner.pool.endpoints()]
        placed = [urls.index(full.decoder.url)] + ([] if full.prefiller is None else [urls.index(full.prefiller.url)])
        history.append((whole, placed))
        messages.append({"role": "assistant", "content": text_of(12, 1000 * decoders + 500 + turn)})
    assert read_in_part >= 4  # the later turns: their history from the pieces kept, their new message bounded


async def test_a_conversation_sent_again_encodes_only_its_new_messages(tokenizer_dir: Path) -> None:
    local = LocalTokenizer.load(tokenizer_dir, inline_max_chars=1 << 30, threads=1)
    pieces = local._pieces
    assert pieces is not None

    def words(count: int, seed: int) -> str:  # no template marker in them: a message is one piece
        rng = random.Random(seed)
        return " ".join(rng.choice(_WORDS) for _ in range(count))

    messages = [{"role": "user", "content": words(400, 1)}]
    for turn in range(5):
        request = parse_request("chat", orjson.dumps({"messages": messages}))
        misses = pieces.misses
        encoded = await local.tokenize(request)
        # The new messages' pieces alone are encoded (the roles' and the generation prompt's the first time).
        assert pieces.misses - misses == (4 if turn == 0 else 2)
        messages += [{"role": "assistant", "content": words(50, turn)}, {"role": "user", "content": words(300, turn)}]
    assert encoded.num_tokens > 1000


def test_a_tokenizer_whose_pieces_do_not_encode_alone_keeps_none(tokenizer_dir: Path, tmp_path: Path) -> None:
    """An added token that strips the spaces beside it joins its neighbours' text: checked at startup."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["lstrip"] = True
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    assert LocalTokenizer.load(directory, inline_max_chars=2048, threads=1)._pieces is None
    assert LocalTokenizer.load(tokenizer_dir, inline_max_chars=2048, threads=1, piece_cache_chars=0)._pieces is None


async def test_a_cache_aware_planner_has_the_prompt_it_read_in_part_encoded_whole_for_its_index(
    deciding: LocalTokenizer,
) -> None:
    """Its next decisions weigh how far a prefix is cached: the index needs every block of this prompt."""
    request = parse_request("completion", orjson.dumps({"prompt": text_of(20000, 5)}))
    whole = await deciding.tokenize(request)
    for mode, weighs in (("cache_aware", True), ("static", False)):
        settings = load_settings(
            decode_urls=["http://127.0.0.1:8200"],
            prefill_urls=["http://127.0.0.1:8100"],
            routing_threshold=256,
            threshold_mode=mode,
        )
        planner = build_planner(settings, Pool(settings.prefill_urls, settings.decode_urls), RouterMetrics())
        assert planner.weighs_whole_prefixes is weighs
        reader = await deciding.reader(request)
        assert reader is not None
        read = await read_prompt(reader, planner.tokens_to_settle, None, whole=planner.weighs_whole_prefixes)
        assert read.at_most is not None and read.rest is not None
        encoded = await read.rest
        assert (encoded is not None and list(encoded.token_ids) == list(whole.token_ids)) is weighs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=conversations, steps=st.lists(st.integers(16, 4000), min_size=1, max_size=4))
def test_the_block_hashes_of_a_prompt_read_on_are_carried_on_from_those_read_before(
    deciding: LocalTokenizer, turns: list[tuple[str, str]], steps: list[int]
) -> None:
    from dpd_router.routing.blocks import block_hashes

    body = {"messages": [{"role": role, "content": content} for role, content in turns]}
    request = parse_request("chat", orjson.dumps(body))

    async def read() -> None:
        reader = await deciding.reader(request)
        assert reader is not None
        for wanted in steps:
            prompt = await reader.more(wanted)
            for block_size in (16, 64):
                hashes = RoutingRequest(prompt).block_hashes(block_size)
                assert hashes == block_hashes(prompt.token_ids, block_size)
            if prompt.at_most is None:
                break

    asyncio.run(read())
