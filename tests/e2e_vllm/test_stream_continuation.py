"""A stream whose decoder connection breaks mid-answer is continued on real vLLM: the uninterrupted text."""

from __future__ import annotations

import pytest

from dpd_sim.vllm_cpu import MODEL_NAME, VllmPair
from tests.e2e_vllm.conftest import ANSWER_TOKENS, _say, anthropic_client, ask, long_text, metric_total, router_for
from tests.integration.cut_link import CutLinks

# The first streamed answer through the links is cut after this many SSE events (the chat stream's role
# chunk and a few tokens).
CUT_AFTER = 6
# Every answer runs its full length: the CPU suite's model has random weights, and its greedy answer to a
# prompt can end (EOS) within CUT_AFTER events, a complete answer there is nothing to continue then.
FULL_LENGTH = {"extra_body": {"min_tokens": ANSWER_TOKENS}}


@pytest.mark.parametrize(
    ("kind", "long"), [("chat", False), ("chat", True), ("completion", False)], ids=["chat", "chat-long", "completion"]
)
async def test_a_stream_cut_off_its_decoder_continues_with_the_engines_uninterrupted_answer(
    nixl_pair: VllmPair, kind: str, long: bool
) -> None:
    """The decoder is reached through two links; the first stream through them breaks after a few tokens.
    The router continues it from the generated token ids through the other link (a long prompt through
    the prefiller again): greedy, the client's text is what the engine answers in one piece."""
    decoder = nixl_pair.decode.url
    prompt = long_text(seed=f"continued-{kind}") if long else f"Say something about rivers and {kind}s."
    async with (
        CutLinks([decoder, decoder], after=CUT_AFTER) as links,
        router_for(nixl_pair, decode_urls=links.urls) as router,
    ):
        text, usage = await ask(router, kind, prompt, stream=True, **FULL_LENGTH)
        assert links.cut.is_set(), (
            f"the stream was cut (requests through the links: {links.requests}; their answers: {links.answers}; "
            f"the client's text: {len(text)} characters, usage {usage})"
        )
        assert await metric_total(router, "dpd_router_stream_continuations_total", outcome="continued") == 1
        if long:
            assert await metric_total(router, "dpd_router_route_decisions_total", path="disaggregated") == 2
    reference, reference_usage = await ask(decoder, kind, prompt, stream=False, **FULL_LENGTH)
    assert text == reference
    assert usage is not None and reference_usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        reference_usage.prompt_tokens,
        reference_usage.completion_tokens,
    )


async def test_a_messages_stream_cut_off_its_decoder_goes_on_as_one_message(nixl_pair: VllmPair) -> None:
    """A Messages stream is continued from its text (the engine's Messages endpoint returns no ids): a text
    completion of its prompt as the router renders it and the text said, encoded. One message, no error,
    the engine's stop reason and usage; whether the text is the engine's own at the cut depends on the text
    encoding back to the ids it was generated as, which is reported, not asserted."""
    decoder = nixl_pair.decode.url
    body = {
        "model": MODEL_NAME,
        "max_tokens": ANSWER_TOKENS,
        "messages": [{"role": "user", "content": "Say something about rivers and lakes."}],
        "extra_body": {"temperature": 0},
    }
    async with (
        CutLinks([decoder, decoder], after=CUT_AFTER) as links,
        router_for(nixl_pair, decode_urls=links.urls) as router,
    ):
        async with (
            anthropic_client(router) as client,
            client.messages.stream(**body) as events,
        ):
            pieces = [text async for text in events.text_stream]
            message = await events.get_final_message()
        assert links.cut.is_set(), "the stream was cut"
        assert await metric_total(router, "dpd_router_stream_continuations_total", outcome="continued") == 1
    async with anthropic_client(decoder) as client:
        reference = await client.messages.create(**body)
    text, expected = "".join(pieces), reference.content[0].text
    assert message.content[0].text == text and len(text) > len(pieces[0])
    assert (message.stop_reason, message.usage.output_tokens) == (reference.stop_reason, reference.usage.output_tokens)
    assert message.usage.input_tokens == reference.usage.input_tokens
    same = "the engine's own text" if text == expected else f"another text than the engine's {expected!r}"
    _say(f"Messages stream continued from its text: {text!r}, {same}")
