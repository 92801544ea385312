"""dpd-router is no stricter than, and no different from, the real vLLM engine behind it: what the
decoder serves called directly, the router serves; what it refuses, the router refuses with the same
answer (status, type, param and message)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from dpd_sim.vllm_cpu import VllmPair
from tests.e2e_vllm.conftest import MODEL_NAME, REQUEST_TIMEOUT, EngineCounters, _say, long_text
from tests.integration.conftest import local_client

CONTEXT = 4096  # the engines' --max-model-len
TOKEN = 100  # a token id of the tiny model's vocabulary


async def call(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with local_client(timeout=REQUEST_TIMEOUT) as client:
        return await client.post(f"{base_url}{path}", json={"model": MODEL_NAME, **body})


async def test_a_prompt_asking_for_more_than_the_room_left_is_served_and_capped_as_by_the_engine(
    router: str, nixl_pair: VllmPair
) -> None:
    """The issue's case: 3,904 prompt tokens and max_tokens 1000 on a 4,096-token model."""
    body = {"prompt": [TOKEN] * 3904, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    before = await EngineCounters.read(nixl_pair)
    routed = await call(router, "/v1/completions", body)
    assert routed.status_code == 200, routed.text
    assert (await EngineCounters.read(nixl_pair)).prefill_requests == before.prefill_requests + 1, "disaggregated"
    direct = await call(nixl_pair.decode.url, "/v1/completions", body)
    assert direct.status_code == 200, direct.text
    usage, reference = routed.json()["usage"], direct.json()["usage"]
    _say(f"3,904 prompt tokens + max_tokens 1000: router {routed.status_code} {usage}; engine {reference}")
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (reference["prompt_tokens"], 192)
    assert routed.json()["choices"][0]["finish_reason"] == direct.json()["choices"][0]["finish_reason"] == "length"


REFUSED = [
    ("/v1/completions", {"prompt": [TOKEN] * 5000, "max_tokens": 16}),
    ("/v1/completions", {"prompt": long_text(6000, seed="over-long text"), "max_tokens": 16}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text(6000, seed="over-long chat")}]}),
    ("/v1/completions", {"prompt": [TOKEN] * CONTEXT, "max_tokens": 16}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 5000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 5000}),
]


@pytest.mark.parametrize(
    ("path", "body"),
    REFUSED,
    ids=["prompt-ids", "prompt-text", "chat", "no-room-left", "max_tokens", "max_completion_tokens"],
)
async def test_what_the_engine_refuses_the_router_refuses_with_the_engines_answer(
    router: str, nixl_pair: VllmPair, path: str, body: dict[str, Any]
) -> None:
    direct = await call(nixl_pair.decode.url, path, body)
    routed = await call(router, path, body)
    _say(f"refused {path}: engine {direct.status_code} {direct.text[:240]}")
    assert direct.status_code == 400
    assert routed.status_code == direct.status_code
    assert routed.json() == direct.json()


@pytest.mark.parametrize("value", ["lots", [1], 5000])
async def test_text_completions_ignore_max_completion_tokens_as_the_engine_does(router: str, value: object) -> None:
    answer = await call(router, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "max_completion_tokens": value})
    assert answer.status_code == 200, answer.text


def usage_shapes(stream: bytes) -> list[list[str] | None]:
    """Each chunk's usage fields (None: no usage), and of prompt_tokens_details the fields inside it."""
    shapes: list[list[str] | None] = []
    for event in stream.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        usage = orjson.loads(event.removeprefix(b"data: ")).get("usage")
        if usage is None:
            shapes.append(None)
            continue
        details = usage.get("prompt_tokens_details")
        shapes.append(sorted(usage) + (sorted(details) if isinstance(details, dict) else []))
    return shapes


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_continuous_usage_reaches_the_client_as_the_decoder_wrote_it(
    router: str, nixl_pair: VllmPair, kind: str
) -> None:
    text = long_text(seed=f"continuous-{kind}")  # disaggregated: the router reconciles cached_tokens
    path, body = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
        if kind == "chat"
        else ("/v1/completions", {"prompt": text})
    )
    body |= {
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    routed = await call(router, path, body)
    direct = await call(nixl_pair.decode.url, path, body)
    assert routed.status_code == direct.status_code == 200
    shapes, reference = usage_shapes(routed.content), usage_shapes(direct.content)
    _say(f"continuous usage ({kind}): router {len(shapes)} chunks, engine {len(reference)}; last {shapes[-1]}")
    # How the engine groups tokens into chunks is its own affair (a transferred prompt's first step may
    # yield two): each chunk's usage must have the shape the engine gives such a chunk.
    assert {tuple(shape) for shape in shapes[:-1] if shape} == {tuple(shape) for shape in reference[:-1] if shape}
    assert shapes[-1] == reference[-1], "the final usage, reconciled in place"
    assert all("cached_tokens" not in shape for shape in shapes[:-1] if shape), "no details the engine did not send"


async def test_healthcheck_answers_as_health(router: str) -> None:
    async with local_client(base_url=router, timeout=REQUEST_TIMEOUT) as client:
        health, healthcheck = await client.get("/health"), await client.get("/healthcheck")
    assert healthcheck.status_code == health.status_code == 200


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"prompt": "The quarterly report shows steady growth.", "return_token_strs": True}),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "Summarise the quarter."}], "add_generation_prompt": True},
        ),
        ("/tokenize", {"model": "no-such-model", "prompt": "Hello"}),
        ("/detokenize", {"tokens": [TOKEN, TOKEN + 1, TOKEN + 2]}),
    ],
    ids=["prompt", "chat", "unknown-model", "detokenize"],
)
async def test_tokenize_and_detokenize_answer_as_the_engine_does(
    router: str, nixl_pair: VllmPair, path: str, body: dict[str, Any]
) -> None:
    """Benchmark tools count prompts with /tokenize: through the router they get the decoder's own answer."""
    async with local_client(timeout=REQUEST_TIMEOUT) as client:
        routed = await client.post(f"{router}{path}", json=body)
        reference = await client.post(f"{nixl_pair.decode.url}{path}", json=body)
    _say(f"{path} {sorted(body)}: router {routed.status_code}, engine {reference.status_code}")
    assert routed.status_code == reference.status_code
    assert routed.json() == reference.json()
