from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from dpd_router.prompt.tokenizer import LARGE_REQUEST_BYTES, EngineTokenizer, LocalTokenizer, PromptTooLong
from dpd_router.request.client_request import parse_request
from dpd_router.request.errors import InvalidRequest


@pytest.fixture(scope="module")
def local(tokenizer_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(tokenizer_dir, inline_max_chars=100, threads=1)


async def test_chat_is_counted_through_the_template_with_the_generation_prompt(
    local: LocalTokenizer, tokenizer_dir: Path
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    request = parse_request("chat", orjson.dumps({"messages": messages}))
    prompt = await local.tokenize(request)
    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert list(prompt.token_ids) == reference.encode(text, add_special_tokens=False)
    assert prompt.num_tokens == len(prompt.token_ids)


async def test_content_parts_count_their_text(local: LocalTokenizer) -> None:
    as_parts = parse_request(
        "chat",
        orjson.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]}),
    )
    as_text = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": "hello world"}]}))
    assert (await local.tokenize(as_parts)).token_ids == (await local.tokenize(as_text)).token_ids
    two_parts = [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {"url": "x"}}]
    two_parts.append({"type": "text", "text": "world"})
    as_lines = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": "hello\nworld"}]}))
    several = parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": two_parts}]}))
    assert (await local.tokenize(several)).token_ids == (await local.tokenize(as_lines)).token_ids


async def test_text_prompts_in_every_form(local: LocalTokenizer) -> None:
    one = await local.tokenize(parse_request("completion", orjson.dumps({"prompt": "a b c"})))
    batch = await local.tokenize(parse_request("completion", orjson.dumps({"prompt": ["a b c", "a b c"]})))
    ids = await local.tokenize(parse_request("completion", orjson.dumps({"prompt": [5, 6, 7]})))
    id_batch = await local.tokenize(parse_request("completion", orjson.dumps({"prompt": [[5, 6], [7]]})))
    assert batch.num_tokens == 2 * one.num_tokens
    assert (ids.num_tokens, list(ids.token_ids)) == (3, [5, 6, 7])
    assert id_batch.num_tokens == 3


async def test_long_prompts_are_tokenized_off_the_event_loop(tokenizer_dir: Path) -> None:
    local = LocalTokenizer.load(tokenizer_dir, inline_max_chars=100, threads=1)
    seen = threads_that_encode(local)
    await local.tokenize(parse_request("completion", orjson.dumps({"prompt": "short"})))
    await local.tokenize(parse_request("completion", orjson.dumps({"prompt": "long " * 100})))
    assert seen[0] == threading.current_thread().name
    assert seen[1].startswith("tokenize")
    local.close()


@pytest.mark.parametrize(
    "text",
    [
        "plain words, twice: plain words",
        "<s> a special token in the text </s> and unicode: naïve café 漢字 🙂",
        "  leading and trailing spaces  \n\n tabs\tand newlines\n",
        "long " * 400,
    ],
)
async def test_the_fast_path_encodes_exactly_as_transformers_does(local: LocalTokenizer, text: str) -> None:
    """The Rust core is called directly: the ids are transformers' own."""
    reference = local._tokenizer
    for special in (True, False):
        expected = reference.encode(text, add_special_tokens=special)
        assert local._encode(text, special=special) == expected
    completion = await local.tokenize(parse_request("completion", orjson.dumps({"prompt": text})))
    assert list(completion.token_ids) == reference.encode(text, add_special_tokens=True)


async def test_template_failure_is_a_400(local: LocalTokenizer) -> None:
    request = parse_request(
        "chat",
        orjson.dumps({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"x": 1}}),
    )
    await local.tokenize(request)  # harmless extra kwargs render fine
    local._tokenizer.chat_template = "{{ raise_exception('bad roles') }}"
    try:
        with pytest.raises(InvalidRequest, match="bad roles"):
            await local.tokenize(request)
    finally:
        del local._tokenizer.chat_template


async def test_engine_tokenize_fallback_asks_the_next_engine_when_one_fails() -> None:
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host + str(request.url.port))
        if request.url.port == 1:
            return httpx.Response(503)
        body = orjson.loads(request.content)
        assert body == {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "add_generation_prompt": True,
        }
        return httpx.Response(200, json={"count": 3, "max_model_len": 10, "tokens": [1, 2, 3], "token_strs": None})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        counter = EngineTokenizer(client, urls=lambda: ["http://e:1", "http://e:2"], model=lambda: "m")
        prompt = await counter.tokenize(
            parse_request("chat", orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}))
        )
    assert prompt.num_tokens == 3
    assert asked == ["e1", "e2"]


async def test_a_huge_request_tokenizes_in_its_own_lane(tokenizer_dir: Path) -> None:
    """Two huge prompts cannot take every tokenizer thread: bodies over LARGE_REQUEST_BYTES have one of their own."""
    local = LocalTokenizer.load(tokenizer_dir, inline_max_chars=100, threads=1)
    seen = threads_that_encode(local)
    await local.tokenize(parse_request("completion", orjson.dumps({"prompt": "word " * (LARGE_REQUEST_BYTES // 4)})))
    await local.tokenize(parse_request("completion", orjson.dumps({"prompt": "word " * 100})))
    assert seen[0].startswith("tokenize-large") and not seen[1].startswith("tokenize-large")
    local.close()


async def test_a_prompt_too_long_by_size_is_refused_before_tokenizing(local: LocalTokenizer) -> None:
    text = "x" * (local.bytes_per_token * 5000)
    with pytest.raises(PromptTooLong) as refused:
        await local.tokenize(parse_request("completion", orjson.dumps({"prompt": text})), max_tokens=4000)
    assert refused.value.at_least >= 5000
    # At the bound or under it, the prompt is counted exactly as usual.
    fits = "x" * (local.bytes_per_token * 100)
    prompt = await local.tokenize(parse_request("completion", orjson.dumps({"prompt": fits})), max_tokens=4000)
    assert prompt.num_tokens == len(local._tokenizer.encode(fits))


def test_the_size_bound_never_exceeds_a_real_count(local: LocalTokenizer) -> None:
    """No text of the tokenizer's own tokens has fewer tokens than its bytes over bytes_per_token."""
    import random

    vocab = list(local._tokenizer.get_vocab())
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randrange(1, 60))]
        text = local._tokenizer.decode(ids)
        counted = len(local._tokenizer.encode(text, add_special_tokens=False))
        assert len(text.encode("utf-8", "surrogatepass")) // local.bytes_per_token <= counted


async def test_a_cancelled_request_stops_tokenizing_at_its_next_step(tokenizer_dir: Path) -> None:
    local = LocalTokenizer.load(tokenizer_dir, inline_max_chars=100, threads=1)
    release = threading.Event()
    encoded: list[str] = []
    original = local._encode

    def slow(text: str, *, special: bool) -> list[int]:
        encoded.append(text[:5])
        release.wait(10)
        return original(text, special=special)

    local._encode = slow  # type: ignore[method-assign]
    batch = parse_request("completion", orjson.dumps({"prompt": ["first " * 50, "second " * 50]}))
    task = asyncio.create_task(local.tokenize(batch))
    while not encoded:  # noqa: ASYNC110 - waiting on a worker thread
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task  # the request is abandoned at once, while its first step still runs
    release.set()
    # The lane's one thread takes this after the abandoned work is over, however long that took.
    await asyncio.get_running_loop().run_in_executor(local._executor, lambda: None)
    assert encoded == ["first"]
    local.close()


def threads_that_encode(local: LocalTokenizer) -> list[str]:
    """The names of the threads `local` encodes in from now on, in order."""
    seen: list[str] = []
    original = local._encode

    def spy(text: str, *, special: bool) -> list[int]:
        seen.append(threading.current_thread().name)
        return original(text, special=special)

    local._encode = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(("messages", "chars", "on_loop"), [(1, 12_000, True), (16, 4_000, True), (200, 60, False)])
async def test_a_body_of_few_messages_is_rendered_on_the_loop_whatever_its_size_and_one_of_many_in_a_thread(
    local: LocalTokenizer, messages: int, chars: int, on_loop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A render costs by its messages (a 12 kB message renders in microseconds, less than handing it to a
    thread costs); a body of many goes to the tokenizing threads, past the inline size as before."""
    threads: list[threading.Thread] = []
    render = LocalTokenizer._render

    def spy(self: LocalTokenizer, body: dict[str, object]) -> str:
        threads.append(threading.current_thread())
        return render(self, body)

    monkeypatch.setattr(LocalTokenizer, "_render", spy)
    conversation = [{"role": ("user", "assistant")[i % 2], "content": "word " * (chars // 5)} for i in range(messages)]
    request = parse_request("chat", orjson.dumps({"messages": conversation}))
    assert len(request.raw) > 2048  # past the inline size for encoding
    assert await local.reader(request) is not None
    assert (threads == [threading.main_thread()]) == on_loop and len(threads) == 1
