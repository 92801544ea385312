from __future__ import annotations

import threading
from pathlib import Path

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from dpd_router.errors import InvalidRequest
from dpd_router.request import parse_request
from dpd_router.tokenizer import EngineTokenizer, LocalTokenizer


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
    seen: list[str] = []
    original = local._encode

    def spy(text: str, *, special: bool, threaded: bool) -> list[int]:
        seen.append(threading.current_thread().name)
        return original(text, special=special, threaded=threaded)

    local._encode = spy  # type: ignore[method-assign]
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
    """The Rust core is called directly (inline and in a thread): the ids are transformers' own."""
    reference = local._tokenizer
    for special in (True, False):
        expected = reference.encode(text, add_special_tokens=special)
        for threaded in (False, True):
            assert local._encode(text, special=special, threaded=threaded) == expected
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
