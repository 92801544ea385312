"""Bodies of very many messages are rendered by a worker process: the same text, count and refusals as
a render in the router's own process, and the worker stops when no such body came for a while."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from dpd_router.prompt.template_sandbox import RenderedTooLarge, TemplateSandbox
from dpd_router.prompt.tokenizer import LocalTokenizer, PromptTooLong
from dpd_router.request.client_request import MANY_CONTAINERS, parse_request
from dpd_router.request.errors import InvalidRequest

MESSAGES = MANY_CONTAINERS // 2 + 100  # a message is two containers: {} and the content's []


@pytest.fixture
async def renderer(tokenizer_dir: Path) -> AsyncIterator[TemplateSandbox]:
    worker = TemplateSandbox(tokenizer_dir, timeout=60, max_output_chars=1 << 20, idle_timeout=0.5)
    yield worker
    await worker.close()


def many_messages(**extra: object) -> bytes:
    messages = [
        {"role": "user" if i % 2 else "assistant", "content": [{"type": "text", "text": f"step {i}"}]}
        for i in range(MESSAGES)
    ]
    return orjson.dumps({"messages": messages, **extra})


async def test_a_body_of_many_messages_is_counted_as_the_routers_own_render_counts_it(tokenizer_dir: Path) -> None:
    # Not the fixture's worker, which stops half a second idle: encoding the text it rendered can take longer
    # on a busy machine, and the check below would find it already stopped.
    renderer = TemplateSandbox(tokenizer_dir, timeout=60, max_output_chars=1 << 20, idle_timeout=60)
    here = LocalTokenizer.load(tokenizer_dir, inline_max_chars=100, threads=1)
    apart = LocalTokenizer.load(
        tokenizer_dir, inline_max_chars=100, threads=1, body_renderer=renderer, count_whole=True
    )
    raw = many_messages(add_generation_prompt=False, tools=[{"type": "function", "function": {"name": "f"}}])
    request = parse_request("chat", raw, yielding=True)
    assert request.brackets > MANY_CONTAINERS
    try:
        expected = await here.tokenize(request)
        rendered = await apart.tokenize(request)
        assert renderer._worker is not None  # it was the worker's render
        assert list(rendered.token_ids) == list(expected.token_ids)
        reader = await apart.reader(request)
        assert reader is not None
        whole = await reader.rest().rest  # read in part, the whole count is made in the background
        assert whole is not None and whole.num_tokens == expected.num_tokens
        # A window the text cannot fit is refused for its size alone, with the same bound, and the text
        # never comes back.
        limit = expected.num_tokens // here.bytes_per_token // 2
        with pytest.raises(PromptTooLong) as in_process:
            await here.tokenize(request, max_tokens=limit)
        with pytest.raises(PromptTooLong) as in_worker:
            await apart.tokenize(request, max_tokens=limit)
        assert in_worker.value.at_least == in_process.value.at_least
    finally:
        await apart.aclose()
        here.close()


async def test_the_worker_refuses_what_the_size_alone_refuses_and_stops_when_idle(
    renderer: TemplateSandbox,
) -> None:
    raw = many_messages()
    text = await renderer.render_body(raw)
    size = len(text.encode())
    assert await renderer.render_body(raw, max_bytes=size) == text
    with pytest.raises(RenderedTooLarge) as refused:
        await renderer.render_body(raw, max_bytes=size - 1)
    assert refused.value.size == size
    worker = renderer._worker
    assert worker is not None and worker.returncode is None
    await asyncio.wait_for(worker.wait(), timeout=10)  # no job for idle_timeout: stopped
    assert renderer._worker is None
    assert await renderer.render_body(raw) == text  # and started again for the next


async def test_a_template_error_in_the_worker_reads_as_one_here(renderer: TemplateSandbox) -> None:
    # The body's own template is not used unless it is the client's: a broken one only fails from_client.
    raw = orjson.dumps({"messages": [{"role": "user", "content": "x"}], "chat_template": "{% if %}"})
    assert "x" in await renderer.render_body(raw)
    with pytest.raises(InvalidRequest) as failed:
        await renderer.render_body(raw, from_client=True)
    assert failed.value.message.startswith("The chat template could not render these messages: TemplateSyntaxError")
