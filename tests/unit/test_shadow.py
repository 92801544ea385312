"""Which requests the shadow gets a copy of, the copy's body, and how its answer is read."""

from __future__ import annotations

import orjson
import pytest

from dpd_router.config import SettingsError, ShadowSettings, load_settings, updated_settings
from dpd_router.gateway.wires import MESSAGES_WIRE, RESPONSES_WIRE
from dpd_router.record.metrics import RouterMetrics
from dpd_router.record.observe import Ending, Observer
from dpd_router.request.client_request import parse_request
from dpd_router.shadow import LiveShadow, RecentLengths, ShadowChoice, ShadowCopy
from dpd_router.shadow.copies import ShadowAnswer, ShadowAnswerUnreadable, shadow_body, shadow_headers


def settings(**values: object) -> ShadowSettings:
    return ShadowSettings.model_validate({"url": "http://shadow:8000", **values})


def test_the_shadow_url_is_a_base_url_without_v1() -> None:
    assert settings(url="shadow.internal:8000/v1/").url == "http://shadow.internal:8000"


def test_a_shadow_setting_is_read_from_yaml_values_and_refused_when_malformed() -> None:
    loaded = load_settings(decode_urls=["http://d:1"], shadow={"url": "http://s:1", "kind": "dpd", "share": 0.25})
    assert loaded.shadow is not None and loaded.shadow.kind == "dpd" and loaded.shadow.share == 0.25
    with pytest.raises(SettingsError, match=r"shadow\.share"):
        load_settings(decode_urls=["http://d:1"], shadow={"url": "http://s:1", "share": 1.5})
    with pytest.raises(SettingsError, match=r"shadow\.kind"):
        load_settings(decode_urls=["http://d:1"], shadow={"url": "http://s:1", "kind": "mirror"})
    with pytest.raises(SettingsError, match=r"shadow\.url"):
        load_settings(decode_urls=["http://d:1"], shadow={"share": 0.5})


def test_recent_lengths_give_the_nearest_rank_percentile_of_the_window() -> None:
    lengths = RecentLengths(window=100)
    for tokens in range(1, 20):
        lengths.add(tokens)
    assert lengths.percentile(50) is None  # too few lengths to say
    for tokens in range(20, 101):
        lengths.add(tokens)
    assert lengths.percentile(90) == 90 and lengths.percentile(100) == 100 and lengths.percentile(1) == 1
    for tokens in range(1001, 1051):  # the oldest 50 leave the window
        lengths.add(tokens)
    assert len(lengths) == 100
    assert lengths.percentile(50) == 100 and lengths.percentile(51) == 1001


def test_only_prompts_of_at_least_min_prompt_tokens_are_eligible() -> None:
    choice = ShadowChoice(settings(min_prompt_tokens=1000))
    assert not choice.eligible(999)
    assert choice.eligible(1000) and choice.eligible(50_000)


def test_with_a_percentile_only_prompts_longer_than_the_recent_ones_are_eligible() -> None:
    choice = ShadowChoice(settings(longest_percentile=90, window=100))
    assert not any(choice.eligible(tokens) for tokens in range(1000, 2000, 50))  # warming up: 20 lengths
    assert not any(choice.eligible(tokens) for tokens in range(100, 0, -1))  # none longer than the p90
    assert not choice.eligible(90)
    assert choice.eligible(95)
    both = ShadowChoice(settings(longest_percentile=50, window=100, min_prompt_tokens=500))
    for tokens in range(1, 101):
        both.eligible(tokens)
    assert not both.eligible(400)  # longer than the median, shorter than the minimum
    assert both.eligible(600)


def test_the_share_is_decided_by_a_stable_hash_of_the_key() -> None:
    half = ShadowChoice(settings(share=0.5))
    keys = [f"request-{number}" for number in range(2000)]
    chosen = {key for key in keys if half.chosen(key)}
    assert 900 <= len(chosen) <= 1100
    again = ShadowChoice(settings(share=0.5))  # another process, another replica: the same answers
    assert {key for key in keys if again.chosen(key)} == chosen
    assert all(ShadowChoice(settings(share=1.0)).chosen(key) for key in keys)
    assert not any(ShadowChoice(settings(share=0.0)).chosen(key) for key in keys)
    # A larger share keeps every key a smaller one chose: raising it only adds requests.
    assert chosen <= {key for key in keys if ShadowChoice(settings(share=0.7)).chosen(key)}


def copy_of(body: dict[str, object], model: str | None = None) -> ShadowCopy:
    return ShadowCopy("r1", "chat", orjson.dumps(body), model, 12)


def test_a_copy_asks_for_a_stream_with_usage_whatever_the_client_asked() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": False, "seed": 7}
    sent = orjson.loads(shadow_body(copy_of(body, model="filled-in"), None))
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["model"] == "filled-in" and sent["seed"] == 7 and sent["messages"] == body["messages"]
    options = {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}, "model": "m"}
    sent = orjson.loads(shadow_body(copy_of(options, model="m"), "staging-model"))
    assert sent["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert sent["model"] == "staging-model"


def test_copies_carry_the_shadow_mark_and_the_shadows_own_credentials() -> None:
    headers = shadow_headers(settings(api_key="shadow-secret", headers={"X-Team": "perf"}))
    assert headers["x-dpd-shadow"] == "1" and headers["x-team"] == "perf"
    assert headers["authorization"] == "Bearer shadow-secret"


def event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chunk(content: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


def test_the_answer_is_timed_token_by_token_and_its_usage_kept() -> None:
    ending = Ending()
    answer = ShadowAnswer(ending)
    answer.feed(event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}), 1.0)  # no token yet
    stream = event(chunk("a")) + event(chunk("b"))
    answer.feed(stream[:7], 2.0)  # an event split across reads
    answer.feed(stream[7:], 2.5)
    answer.feed(event(chunk("c")), 3.5)
    answer.feed(event({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}}) + b"data: [DONE]\n\n", 4)
    answer.end()
    output = answer.output
    assert ending.outcome == "ok" and output.first_token_at == 2.5
    assert output.gaps == [0.0, 1.0] and output.token_chunks == 3 and output.completion_tokens == 3


def test_an_answer_that_stops_before_done_or_reports_an_error_fails_the_copy() -> None:
    cut = Ending()
    answer = ShadowAnswer(cut)
    answer.feed(event(chunk("a")), 1.0)
    answer.end()
    assert cut.outcome == "error" and "before its end event" in (cut.error or "")
    failed = Ending()
    answer = ShadowAnswer(failed)
    answer.feed(event({"error": {"message": "engine overloaded"}}) + b"data: [DONE]\n\n", 1.0)
    answer.end()
    assert failed.outcome == "error" and failed.error == "engine overloaded"
    endless = ShadowAnswer(Ending())
    with pytest.raises(ShadowAnswerUnreadable):
        endless.feed(b"data: " + b"x" * (2 << 20), 1.0)


async def test_a_live_change_replaces_the_shadow_and_turning_it_off_leaves_none() -> None:
    metrics = RouterMetrics()
    first = load_settings(decode_urls=["http://127.0.0.1:9"], shadow={"url": "http://127.0.0.1:1", "queue": 4})
    live = LiveShadow(first, Observer(metrics), metrics)
    live.start()
    try:
        old = live.current
        assert old is not None and old.url == "http://127.0.0.1:1"
        live.reconfigure(updated_settings(first, {"routing_threshold": 10}))  # not the shadow's: kept
        assert live.current is old
        changed = updated_settings(first, {"shadow": {"url": "http://127.0.0.1:2", "share": 0.5}})
        live.reconfigure(changed)
        assert live.current is not None and live.current is not old and live.current.url == "http://127.0.0.1:2"
        live.reconfigure(updated_settings(changed, {"shadow": None}))
        assert live.current is None
    finally:
        await live.close()


async def test_a_copy_of_a_copy_is_never_queued() -> None:
    metrics = RouterMetrics()
    settings = load_settings(decode_urls=["http://127.0.0.1:9"], shadow={"url": "http://127.0.0.1:1", "queue": 1})
    live = LiveShadow(settings, Observer(metrics), metrics)
    live.start()
    shadow = live.current
    assert shadow is not None
    request = parse_request("chat", b'{"messages": [{"role": "user", "content": "hi"}]}')
    try:
        shadow.offer(request, "copy-1", 5, {"x-dpd-shadow": "1"})
        shadow.offer(request, "copy-2", 5, {"x-dpd-shadow": "1"})
        assert dropped(metrics, "queue_full") == 0  # neither took the one place in the queue
        shadow.offer(request, "client-1", 5, {})
        shadow.offer(request, "client-2", 5, {})  # before any worker ran: the queue is full
        assert dropped(metrics, "queue_full") == 1
    finally:
        await live.close()
    assert dropped(metrics, "closed") == 1  # the queued copy, never sent


def dropped(metrics: RouterMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("dpd_router_shadow_dropped_total", {"reason": reason}) or 0.0


def named(name: str, payload: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **payload}) + b"\n\n"


def test_messages_and_responses_copies_are_streams_read_in_their_own_api() -> None:
    for kind in ("messages", "responses"):
        body = {"model": "m", "input": "hi", "store": False} if kind == "responses" else {"messages": [], "model": "m"}
        sent = orjson.loads(shadow_body(ShadowCopy("r1", kind, orjson.dumps(body), None, 12), None))
        assert sent["stream"] is True and "stream_options" not in sent, "these APIs carry their usage in events"
    messages = Ending()
    answer = ShadowAnswer(messages, MESSAGES_WIRE)
    start = {"message": {"id": "m", "content": [], "usage": {"input_tokens": 12, "output_tokens": 0}}}
    answer.feed(named("message_start", start), 1.0)
    answer.feed(named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "a"}}), 2.0)
    answer.feed(named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "b"}}), 2.5)
    answer.feed(named("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}}), 3)
    answer.feed(named("message_stop", {}), 3.0)
    answer.end()
    assert messages.outcome == "ok" and answer.output.first_token_at == 2.0 and answer.output.completion_tokens == 2
    responses = Ending()
    answer = ShadowAnswer(responses, RESPONSES_WIRE)
    answer.feed(named("response.created", {"response": {"id": "r", "status": "in_progress", "usage": None}}), 1.0)
    answer.feed(named("response.output_text.delta", {"delta": "a", "output_index": 0}), 2.0)
    usage = {"input_tokens": 12, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 0}}
    answer.feed(named("response.completed", {"response": {"id": "r", "status": "completed", "usage": usage}}), 3)
    answer.end()
    assert responses.outcome == "ok" and answer.output.first_token_at == 2.0
    assert answer.output.completion_tokens == 1
    cut = Ending()
    answer = ShadowAnswer(cut, RESPONSES_WIRE)
    answer.feed(named("response.output_text.delta", {"delta": "a", "output_index": 0}), 2.0)
    answer.end()
    assert cut.outcome == "error", "a stream without its end event fails the copy"
