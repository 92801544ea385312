"""A stream whose decoder dies after output is continued on another decoder: one uninterrupted answer.

The decoders are engine processes, killed with SIGKILL mid-stream. The simulated engine's greedy text
is a function of the token ids before it, so a continuation from the ids already sent must give the
text an uninterrupted decoder gives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from dpd_sim.cluster import SimCluster
from tests.integration.conftest import MODEL, cluster_settings, engine_stats, metric, requests_seen, running_router
from tests.integration.test_reliability import LONG, THRESHOLD

TOKENS = 40
# Slow enough that the client sees its first tokens long before the answer ends (50 ms a token: a loaded
# machine still kills the decoder mid-answer).
SLOW_DECODE = ["--decode-step-base", "0.05"]
SHORT_PROMPT = "Tell me about rivers."


@asynccontextmanager
async def two_decoders(tokenizer_dir: Path, **settings: Any) -> AsyncIterator[tuple[SimCluster, str]]:
    """A prefiller and two decoder processes behind a router."""
    async with (
        SimCluster(prefill=1, decode=2, tokenizer=tokenizer_dir, model=MODEL, extra_args=SLOW_DECODE) as cluster,
        running_router(**cluster_settings(cluster, tokenizer_dir, threshold=THRESHOLD, **settings)) as base_url,
    ):
        yield cluster, base_url


async def serving_decoder(cluster: SimCluster) -> int:
    """The index of the decoder running a request now."""
    for index, url in enumerate(cluster.decode_urls):
        if (await engine_stats(url))["running"]:
            return index
    raise AssertionError("no decoder is running the request")


async def kill_serving_decoder(cluster: SimCluster) -> int:
    """SIGKILL the decoder running a request now; its index."""
    index = await serving_decoder(cluster)
    await cluster.kill([engine for engine in cluster.engines if engine.role == "decode"][index])
    return index


async def kill_after(cluster: SimCluster, seen: int, pieces: list[str], ready: asyncio.Event) -> int:
    """Once the client has `seen` pieces of output, SIGKILL the decoder serving it; its index."""
    await ready.wait()
    assert len(pieces) >= seen
    return await kill_serving_decoder(cluster)


async def stream_chat(
    client: openai.AsyncOpenAI, content: str, pieces: list[str], ready: asyncio.Event, *, request_id: str, **extra: Any
) -> tuple[list[str | None], Any]:
    """Stream a chat answer, collecting its text in `pieces`; `ready` is set after the 5th piece. Its
    finish reasons (one per chunk) and usage."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id},
        **extra,
    )
    finishes: list[str | None] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finishes.append(choice.finish_reason)
        if len(pieces) >= 5:
            ready.set()
    return finishes, usage


@pytest.mark.parametrize("content", [SHORT_PROMPT, LONG], ids=["direct", "disaggregated"])
async def test_a_chat_stream_continues_on_another_decoder_with_the_uninterrupted_text(
    tokenizer_dir: Path, content: str
) -> None:
    async with two_decoders(tokenizer_dir) as (cluster, base_url):
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        reference: list[str] = []
        _, reference_usage = await stream_chat(client, content, reference, asyncio.Event(), request_id="reference")
        assert reference_usage is not None and reference_usage.completion_tokens == TOKENS

        pieces: list[str] = []
        ready = asyncio.Event()
        killer = asyncio.create_task(kill_after(cluster, 5, pieces, ready))
        finishes, usage = await stream_chat(client, content, pieces, ready, request_id="broken")
        killed = await killer

        assert "".join(pieces) == "".join(reference), "the continued text is the uninterrupted one"
        assert [reason for reason in finishes if reason is not None] == ["length"]
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (reference_usage.prompt_tokens, TOKENS)
        other = cluster.decode_urls[1 - killed]
        (continued,) = await requests_seen(other, "broken-c1")
        sent = continued["prompt_tokens"] - reference_usage.prompt_tokens
        assert 5 <= sent < TOKENS, "the continuation's prompt carries the output already sent"
        assert await metric(base_url, "dpd_router_stream_continuations_total", {"outcome": "continued"}) == 1
        assert await metric(base_url, "dpd_router_requests_total", {"outcome": "ok"}) == 2
        # The console shows it: the request's log line says where it went on, the counters how often.
        async with httpx.AsyncClient(base_url=base_url) as http:
            state = (await http.get("/admin/state")).json()
        (line,) = [fields for fields in state["recent"] if fields["request_id"] == "broken"]
        assert line["continuations"] == 1 and f"after {sent} tokens; continued on {other}" in line["continued_after"]
        (counted,) = state["counters"]["stream_continuations_total"]
        assert counted == {"outcome": "continued", "reason": "", "count": 1}
        if content == LONG:
            (prefilled,) = await requests_seen(cluster.prefill_urls[0], "broken-c1")
            assert prefilled["prompt_tokens"] == continued["prompt_tokens"], "a long continuation is prefilled"


async def test_a_completion_stream_continues_with_the_uninterrupted_text(tokenizer_dir: Path) -> None:
    async with two_decoders(tokenizer_dir) as (cluster, base_url):
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)

        async def complete(pieces: list[str], ready: asyncio.Event, request_id: str) -> tuple[Any, str]:
            stream = await client.completions.create(
                model=MODEL,
                prompt=SHORT_PROMPT,
                max_tokens=TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"X-Request-Id": request_id},
            )
            usage, ids, finish = None, set(), ""
            async for chunk in stream:
                ids.add(chunk.id)
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    pieces.append(choice.text)
                    finish = choice.finish_reason or finish
                if len(pieces) >= 5:
                    ready.set()
            assert len(ids) == 1, "one answer, under one id"
            return usage, finish

        reference: list[str] = []
        reference_usage, _ = await complete(reference, asyncio.Event(), "reference")
        pieces: list[str] = []
        ready = asyncio.Event()
        killer = asyncio.create_task(kill_after(cluster, 5, pieces, ready))
        usage, finish = await complete(pieces, ready, "broken")
        await killer
        assert "".join(pieces) == "".join(reference) and finish == "length"
        assert (usage.prompt_tokens, usage.completion_tokens) == (reference_usage.prompt_tokens, TOKENS)
        labels = {"api": "completion", "outcome": "continued"}
        assert await metric(base_url, "dpd_router_stream_continuations_total", labels) == 1


@pytest.mark.parametrize(
    ("extra", "reason"),
    [({"n": 2}, "n"), ({"response_format": {"type": "json_object"}}, "structured_output")],
    ids=["n", "response_format"],
)
async def test_a_stream_that_cannot_be_continued_faithfully_ends_as_before_with_its_reason(
    tokenizer_dir: Path, extra: dict[str, Any], reason: str
) -> None:
    async with two_decoders(tokenizer_dir) as (cluster, base_url):
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        pieces: list[str] = []
        ready = asyncio.Event()
        killer = asyncio.create_task(kill_after(cluster, 5, pieces, ready))
        with pytest.raises(openai.APIError, match="decoder"):
            await stream_chat(client, SHORT_PROMPT, pieces, ready, request_id="unfaithful", **extra)
        await killer
        labels = {"outcome": "not_tried", "reason": reason}
        assert await metric(base_url, "dpd_router_stream_continuations_total", labels) == 1
        assert await metric(base_url, "dpd_router_stream_continuations_total", {"outcome": "continued"}) == 0


async def test_with_continuations_off_a_stream_ends_with_an_in_band_error(tokenizer_dir: Path) -> None:
    async with (
        two_decoders(tokenizer_dir, stream_continuations=0) as (cluster, base_url),
        httpx.AsyncClient(base_url=base_url, timeout=30) as client,
    ):
        body = {"model": MODEL, "prompt": SHORT_PROMPT, "max_tokens": TOKENS, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            chunks = []
            async for chunk in response.aiter_bytes():
                chunks.append(chunk)
                if len(chunks) == 5:
                    await kill_serving_decoder(cluster)
        tail = b"".join(chunks).split(b"\n\n")
        assert b'"error"' in tail[-3] and tail[-2] == b"data: [DONE]"
        labels = {"outcome": "not_tried", "reason": "disabled"}
        assert await metric(base_url, "dpd_router_stream_continuations_total", labels) == 1


async def test_a_messages_stream_continues_as_one_message(tokenizer_dir: Path) -> None:
    """Continued from its text (the Messages endpoint returns no ids): a chat call continuing the text said as
    the assistant's message. The simulated engine's words encode back to the ids it generated, so here the
    text is the uninterrupted one too."""
    async with two_decoders(tokenizer_dir) as (cluster, base_url):
        client = anthropic.AsyncAnthropic(base_url=base_url, api_key="none", max_retries=0)

        async def ask(pieces: list[str], ready: asyncio.Event, request_id: str) -> Any:
            async with client.messages.stream(
                model=MODEL,
                max_tokens=TOKENS,
                messages=[{"role": "user", "content": SHORT_PROMPT}],
                extra_headers={"X-Request-Id": request_id},
            ) as stream:
                async for text in stream.text_stream:
                    pieces.append(text)
                    if len(pieces) >= 5:
                        ready.set()
                return await stream.get_final_message()

        reference: list[str] = []
        first = await ask(reference, asyncio.Event(), "reference")
        pieces: list[str] = []
        ready = asyncio.Event()
        killer = asyncio.create_task(kill_after(cluster, 5, pieces, ready))
        message = await ask(pieces, ready, "broken")
        killed = await killer
        assert "".join(pieces) == "".join(reference) == message.content[0].text
        assert message.id != first.id and message.stop_reason == "max_tokens"
        assert message.usage.output_tokens == TOKENS and message.usage.input_tokens == first.usage.input_tokens
        (continued,) = await requests_seen(cluster.decode_urls[1 - killed], "broken-c1")
        prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
        assert 5 <= continued["prompt_tokens"] - prompt < TOKENS, "the text said goes on as the assistant's"
        labels = {"api": "messages", "outcome": "continued"}
        assert await metric(base_url, "dpd_router_stream_continuations_total", labels) == 1


async def test_a_responses_stream_continues_and_the_router_keeps_the_whole_answer(tokenizer_dir: Path) -> None:
    async with two_decoders(tokenizer_dir) as (cluster, base_url):
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)

        async def ask(pieces: list[str], ready: asyncio.Event, request_id: str) -> tuple[Any, list[int]]:
            stream = await client.responses.create(
                model=MODEL,
                input=SHORT_PROMPT,
                max_output_tokens=TOKENS,
                stream=True,
                extra_headers={"X-Request-Id": request_id},
            )
            completed, sequence = None, []
            async for event in stream:
                sequence.append(event.sequence_number)
                if event.type == "response.output_text.delta":
                    pieces.append(event.delta)
                    if len(pieces) >= 5:
                        ready.set()
                elif event.type == "response.completed":
                    completed = event.response
            return completed, sequence

        reference: list[str] = []
        await ask(reference, asyncio.Event(), "reference")
        pieces: list[str] = []
        ready = asyncio.Event()
        killer = asyncio.create_task(kill_after(cluster, 5, pieces, ready))
        response, sequence = await ask(pieces, ready, "broken")
        await killer
        assert response is not None and "".join(pieces) == "".join(reference)
        assert sequence == list(range(len(sequence))), "one stream of events, numbered in order"
        assert response.output_text == "".join(pieces) and response.status == "incomplete"
        assert response.usage is not None and response.usage.output_tokens == TOKENS
        kept = await client.responses.retrieve(response.id)
        assert kept.output_text == "".join(pieces), "the router keeps the whole continued answer"
        labels = {"api": "responses", "outcome": "continued"}
        assert await metric(base_url, "dpd_router_stream_continuations_total", labels) == 1
