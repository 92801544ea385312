"""The gateway around a connector's hand-off: pushed KV that no decode call takes is drained, a
continuation that fails unexpectedly still ends its stream, and a client that leaves is counted.

Engines are httpx mock transports; the LMCache connector is the real one, its notification socket
a stand-in that reports every hand-off landed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any, cast

import httpx
import orjson
import pytest

from dpd_router.api import openai
from dpd_router.api.admission import Admissions
from dpd_router.api.answers import send_answer
from dpd_router.api.auth import Gatekeeper, KeyRing
from dpd_router.api.departure import Departure
from dpd_router.config import load_settings
from dpd_router.gateway import Answer, Gateway, PhaseTimeouts, RetryPolicy, StreamedAnswer
from dpd_router.gateway.models import Models, ServingModel
from dpd_router.pool.pool import Pool
from dpd_router.pool.served_model import ServedModel
from dpd_router.pool.transport import EngineCalls
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Observer
from dpd_router.request.client_request import ClientRequest, parse_request
from dpd_router.responses.history import ResponsesHistory
from dpd_router.routing.planner import build_planner
from dpd_router.transfer.lmcache.connector import LMCacheConnector
from dpd_router.transfer.lmcache.receivers import ReceiverMap

PREFILLER = "http://10.0.0.1:8000"
DECODER = "http://10.0.0.9:8000"
OTHER_DECODER = "http://10.0.0.8:8000"
PROMPT_IDS = list(range(100, 140))

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class LandedAtOnce:
    """ProxyNotifications, as if every prefiller's KV reached its decoder at once."""

    address = "inproc://test"

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def expect(self, req_id: str, count: int) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass

    async def wait(self, req_id: str, within: float) -> bool:
        return True


class Tokens:
    async def tokenize(self, request: ClientRequest, *, max_tokens: int | None = None) -> Prompt:
        return Prompt(token_ids=PROMPT_IDS, num_tokens=len(PROMPT_IDS), seconds=0.0)

    async def aclose(self) -> None:
        pass


def prefill_answer(finish_reason: str = "length") -> dict[str, Any]:
    return {
        "id": "cmpl-p",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "text": " river", "finish_reason": finish_reason, "stop_reason": None}],
        "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 1, "total_tokens": len(PROMPT_IDS) + 1},
        "kv_transfer_params": {"first_tok": 42},
    }


def completion_events(*texts: str) -> bytes:
    events = []
    for index, text in enumerate(texts):
        finish = "length" if index == len(texts) - 1 else None
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        events.append({"id": "cmpl-d", "object": "text_completion", "created": 6, "model": "m", "choices": [choice]})
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"


class Engines:
    """One prefiller and some decoders behind a mock transport; every call is recorded."""

    def __init__(self, decoder: Handler | None = None, *, prefill_finish: str = "length") -> None:
        self.calls: list[httpx.Request] = []
        self.decoder = decoder or self.stream
        self.prefill_finish = prefill_finish
        self.drained = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        if str(request.url).startswith(PREFILLER):
            return httpx.Response(200, json=prefill_answer(self.prefill_finish))
        if request.headers["X-Request-Id"].endswith("-drain"):
            self.drained.set()
            if str(request.url).startswith(OTHER_DECODER):
                raise httpx.ConnectError("refused")
            return httpx.Response(200, json={"choices": [{"index": 0, "text": " x", "finish_reason": "length"}]})
        return await self.decoder(request)

    @staticmethod
    async def stream(request: httpx.Request) -> httpx.Response:
        events = httpx.ByteStream(completion_events(" flows", " on"))
        return httpx.Response(200, stream=events, headers={"content-type": "text/event-stream"})

    def to(self, url: str, *, drain: bool = False) -> list[dict[str, Any]]:
        """The bodies of the calls to `url`: the decode calls, or the drains."""
        return [
            orjson.loads(call.content)
            for call in self.calls
            if str(call.url).startswith(url) and call.headers["X-Request-Id"].endswith("-drain") is drain
        ]


def gateway(
    engines: Engines, *, decoders: tuple[str, ...] = (DECODER,), threshold: int = 8
) -> tuple[Gateway, RouterMetrics]:
    settings = load_settings(
        prefill_urls=[PREFILLER], decode_urls=list(decoders), routing_threshold=threshold, threshold_mode="static"
    )
    metrics = RouterMetrics()
    transport = httpx.MockTransport(engines)
    connector = LMCacheConnector(
        EngineCalls(transport, {}),
        timeout=httpx.Timeout(5.0),
        receivers=ReceiverMap([8300], [8400]),
        notifications=LandedAtOnce(),  # type: ignore[arg-type]
        notify_timeout=1.0,
    )
    pool = Pool(settings.prefill_urls, settings.decode_urls)
    planner = build_planner(settings, pool, metrics)
    built = Gateway(
        engines=EngineCalls(transport, {}),
        tokenizers={None: Tokens()},
        planners={None: planner},
        connector=connector,
        observer=Observer(metrics),
        metrics=metrics,
        model=ServedModel("m"),
        timeouts=PhaseTimeouts(first_token=5, idle=5, total=5, prefill=5),
        retries=RetryPolicy(),
    )
    return built, metrics


def chat(**extra: Any) -> ClientRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "a long prompt"}], "max_tokens": 5, **extra}
    return parse_request("chat", orjson.dumps(body))


async def play(answer: Answer, *, client_leaves_after: float | None = None) -> bytes:
    """Send an answer to a client as the router's ASGI server would; the client may leave after some seconds."""
    body: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if client_leaves_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(client_leaves_after)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    departure = Departure({"type": "http"}, receive)  # as the completions lane watches its client
    try:
        await send_answer(answer, send, departure)
    except asyncio.CancelledError:
        if not departure.left:
            raise
        departure.absorb()
    finally:
        departure.stop()
    return b"".join(body)


def sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_a_continuation_that_fails_unexpectedly_still_ends_the_stream_in_band() -> None:
    async def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug in the transport")

    built, metrics = gateway(Engines(broken))
    response = await built.handle(chat(stream=True), "req-1")
    assert isinstance(response, StreamedAnswer)
    events = [event for event in (await play(response)).split(b"\n\n") if event]
    assert b'"content":" river"' in events[1], "the prefiller's token went first"
    assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
    assert (
        sample(
            metrics,
            "dpd_router_requests_total",
            model="m",
            arm="live",
            api="chat",
            path="disaggregated",
            outcome="error",
        )
        == 1
    )
    assert sample(metrics, "dpd_router_client_disconnects_total", phase="serve") == 0


async def test_a_client_leaving_before_the_continuation_answers_is_counted_and_the_kv_drained() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        raise AssertionError("the client left long before")

    engines = Engines(slow)
    built, metrics = gateway(engines)
    response = await built.handle(chat(stream=True), "req-1")
    await play(response, client_leaves_after=0.1)
    async with asyncio.timeout(5):
        await engines.drained.wait()
    (drain,) = engines.to(DECODER, drain=True)
    assert drain["prompt"] == [*PROMPT_IDS, 42] and drain["max_tokens"] == 1
    assert sample(metrics, "dpd_router_client_disconnects_total", phase="serve") == 1
    assert (
        sample(
            metrics,
            "dpd_router_requests_total",
            model="m",
            arm="live",
            api="chat",
            path="disaggregated",
            outcome="client_disconnect",
        )
        == 1
    )


async def test_kv_a_decoder_took_is_not_drained() -> None:
    engines = Engines()
    built, _ = gateway(engines)
    await play(await built.handle(chat(stream=True), "req-1"))
    whole = await built.handle(chat(), "req-2")
    assert whole.status == 200
    await asyncio.sleep(0.1)
    assert len(engines.to(DECODER)) == 2 and engines.to(DECODER, drain=True) == []


@pytest.mark.parametrize("stream", [True, False])
async def test_a_first_token_that_ends_the_answer_leaves_kv_that_is_drained(stream: bool) -> None:
    engines = Engines(prefill_finish="stop")
    built, _ = gateway(engines)
    response = await built.handle(chat(stream=stream), "req-1")
    if stream:
        await play(response)
    async with asyncio.timeout(5):
        await engines.drained.wait()
    assert engines.to(DECODER) == [], "no decode call: the answer was complete"
    assert len(engines.to(DECODER, drain=True)) == 1


async def test_a_decoder_that_cannot_be_reached_gets_its_kv_drained_and_the_next_one_its_own() -> None:
    """Non-streamed: the KV is staged again for the decoder that serves (LMCache pushed it to one)."""

    async def refused_then_whole(request: httpx.Request) -> httpx.Response:
        if str(request.url).startswith(OTHER_DECODER):
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"choices": [{"index": 0, "text": " on", "finish_reason": "length"}]})

    engines = Engines(refused_then_whole)
    built, _ = gateway(engines, decoders=(OTHER_DECODER, DECODER))
    # Swamped (past balance_abs_threshold): whatever the prompt's prefix hashes to, the plan takes the one that refuses.
    built.planners[None].pool.decoders[1].in_flight += 40
    answer = await built.handle(chat(), "req-1")
    assert answer.status == 200
    prefills = [orjson.loads(call.content) for call in engines.calls if str(call.url).startswith(PREFILLER)]
    hosts = [body["kv_transfer_params"]["disagg_spec"]["receiver_host"] for body in prefills]
    assert hosts == ["10.0.0.8", "10.0.0.9"], "staged again for the decoder that answered"
    async with asyncio.timeout(5):
        await engines.drained.wait()
    assert len(engines.to(OTHER_DECODER, drain=True)) == 1, "the KV pushed to the first one is drained"
    assert engines.to(DECODER, drain=True) == []


async def test_an_answer_that_finished_after_its_client_left_is_released() -> None:
    """The gateway's task may still return an answer after the client left and it was cancelled."""
    released = asyncio.Event()

    class StubbornGateway:
        async def handle(self, *args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)  # cancelled: it finishes its answer anyway

            async def events() -> Any:
                yield b"data: [DONE]\n\n"

            async def close() -> None:
                released.set()

            return StreamedAnswer(events(), close, headers={})

    metrics = RouterMetrics()
    api = openai.OpenAIApi(
        live=cast(
            Any, SimpleNamespace(settings=SimpleNamespace(max_body_bytes=1 << 20, trust_request_chat_template=False))
        ),
        gatekeeper=Gatekeeper(
            KeyRing.load(keys_file=None, key_hashes=[], admin_key_hashes=[]), metrics, failures_per_minute=0
        ),
        admission=Admissions(metrics, load_settings(decode_urls=["http://127.0.0.1:9"], max_queued=10)),
        models=Models([ServingModel(ServedModel("m"), cast(Any, StubbornGateway()), {})]),
        metrics=metrics,
        responses=ResponsesHistory(None, metrics),
    )
    messages = [
        {"type": "http.request", "body": orjson.dumps({"messages": [{"role": "user", "content": "x"}]})},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [],
    }
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await api.serve(scope, receive, send, "chat")
    assert sent[0]["status"] == 499
    assert released.is_set(), "its stream was closed and the request released"


async def test_a_streamed_direct_prompt_waits_in_its_decoders_queue_until_its_first_token() -> None:
    """Counted in the queue of the decoder computing it (what adaptive mode reads), released when that
    decoder fails before its first token (the next one counts it), at the first token, never twice."""
    asked, first_token = asyncio.Event(), asyncio.Event()

    async def refused_then_slow(request: httpx.Request) -> httpx.Response:
        if str(request.url).startswith(OTHER_DECODER):
            raise httpx.ConnectError("refused")
        asked.set()

        async def events() -> AsyncIterator[bytes]:
            await first_token.wait()
            yield completion_events(" flows", " on")

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    built, _ = gateway(Engines(refused_then_slow), decoders=(OTHER_DECODER, DECODER), threshold=1000)
    refusing, serving = built.planners[None].pool.decoders
    serving.in_flight += 40  # swamped: the plan takes the one that refuses first
    handled = asyncio.create_task(built.handle(chat(stream=True), "req-1"))
    async with asyncio.timeout(5):
        await asyncio.wait({asyncio.ensure_future(asked.wait()), handled}, return_when=asyncio.FIRST_COMPLETED)
    assert asked.is_set(), handled
    assert (refusing.queued_tokens, serving.queued_tokens) == (0, len(PROMPT_IDS))
    first_token.set()
    answer = await handled
    assert serving.queued_tokens == 0  # its first token came: out of the queue while the answer streams on
    assert b" flows" in await play(answer)
    assert (refusing.queued_tokens, serving.queued_tokens) == (0, 0)
