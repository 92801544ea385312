"""The client's answer: the prefiller's first token, then the decoder's continuation, as one answer in
the client's own API (chat chunks rebuilt from completion chunks, usage counting the first token as output)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import PrefillFailed
from dpd_router.transfer import chat_chunks

# A prefill answer's finish reasons that mean it failed, not that the answer is complete.
_FAILED_FINISH_REASONS = ("error", "abort")


@dataclass(frozen=True)
class FirstToken:
    """The prefiller's one token, as its answer gave it."""

    token_id: int
    text: str
    finish_reason: str | None
    response_id: str
    created: int
    model: str
    # What stopped it, when it stopped on its own (a stop token's id or a stop string).
    stop_reason: int | str | None = None

    @classmethod
    def from_answer(cls, payload: dict[str, Any]) -> FirstToken:
        """The first token of a prefill answer; PrefillFailed when it has none or the engine failed it."""
        choices = payload.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        finish_reason = choice.get("finish_reason")
        if finish_reason in _FAILED_FINISH_REASONS:
            raise PrefillFailed("in_band_error", f"the prefill ended with finish_reason={finish_reason}")
        params = payload.get("kv_transfer_params")
        token_id = params.get("first_tok") if isinstance(params, dict) else None
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise PrefillFailed("bad_answer", "the prefill answer carries no kv_transfer_params.first_tok")
        created = payload.get("created")
        stop_reason = choice.get("stop_reason")
        return cls(
            token_id=token_id,
            text=str(choice.get("text") or ""),
            finish_reason=finish_reason,
            response_id=str(payload.get("id") or "cmpl-lmcache"),
            created=created if isinstance(created, int) else int(time.time()),
            model=str(payload.get("model") or ""),
            stop_reason=stop_reason if isinstance(stop_reason, int | str) else None,
        )

    @property
    def ends_the_answer(self) -> bool:
        """The prefiller stopped on its own (an end-of-sequence token or a stop string)."""
        return self.finish_reason not in (None, "length")


class Continuation:
    """The decoder continues after the prefiller's first token: that token goes first (early, when
    streamed), counts as output, and the answer is given back in the client's own API.

    The decoder's usage counts the first token as prompt: the client's prompt is one shorter and
    its output one longer.
    """

    def __init__(self, kind: str, first: FirstToken) -> None:
        self._chat = kind == "chat"
        self._first = first
        self._response_id = chat_chunks.chat_id(first.response_id) if self._chat else first.response_id

    def head(self) -> bytes:
        first = self._first
        if self._chat:
            events = [
                chat_chunks.role_chunk(response_id=self._response_id, created=first.created, model=first.model),
                chat_chunks.chat_chunk(
                    response_id=self._response_id,
                    created=first.created,
                    model=first.model,
                    delta={"content": first.text},
                ),
            ]
        else:
            choice = {"index": 0, "text": first.text, "logprobs": None, "finish_reason": None, "stop_reason": None}
            events = [
                {
                    "id": self._response_id,
                    "object": "text_completion",
                    "created": first.created,
                    "model": first.model,
                    "choices": [choice],
                }
            ]
        return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)

    def chunk(self, payload: dict[str, Any]) -> dict[str, Any]:
        if "error" in payload:
            return payload
        _count_first_token(payload)
        self._as_one_answer(payload)
        return chat_chunks.chunk_to_chat(payload) if self._chat else payload

    def body(self, payload: dict[str, Any]) -> dict[str, Any]:
        if "error" in payload:
            return payload
        _count_first_token(payload)
        for choice in payload.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                choice["text"] = self._first.text + str(choice.get("text") or "")
        self._as_one_answer(payload)
        return chat_chunks.body_to_chat(payload) if self._chat else payload

    def _as_one_answer(self, payload: dict[str, Any]) -> None:
        """The id and creation time of the head: the client sees one answer, not two engines'."""
        payload["id"] = self._response_id
        payload["created"] = self._first.created


def _count_first_token(payload: dict[str, Any]) -> None:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        usage["prompt_tokens"] -= 1
    if isinstance(usage.get("completion_tokens"), int):
        usage["completion_tokens"] += 1


def answered_by_prefill(request: ClientRequest, prompt_tokens: int, first: FirstToken) -> bytes:
    """What a decoder would answer with no token left to generate, in its (text completion) format.

    The Continuation then adds the first token: a prefill whose first token ended the answer needs
    no decoder (its pushed KV is drained).
    """
    finish_reason = first.finish_reason or "length"
    choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
    choice["stop_reason"] = first.stop_reason
    usage = {"prompt_tokens": prompt_tokens + 1, "completion_tokens": 0, "total_tokens": prompt_tokens + 1}
    head = {"id": first.response_id, "object": "text_completion", "created": first.created, "model": first.model}
    if not request.stream:
        return orjson.dumps({**head, "choices": [choice], "usage": usage})
    events = [{**head, "choices": [choice]}]
    options = request.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        events.append({**head, "choices": [], "usage": usage})
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"
