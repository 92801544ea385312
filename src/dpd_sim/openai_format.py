"""The bytes of OpenAI completion answers as vLLM writes them: JSON bodies and SSE chunks.

Per-token chunks are assembled from pre-encoded pieces; the rarer first, last and usage
chunks go through orjson.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from dpd_sim.completion_request import Api

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})


class ResponseFormat:
    """Builds one response's chunks and body: `text_completion` or `chat.completion[.chunk]`."""

    def __init__(self, api: Api, *, response_id: str, model: str, created: int) -> None:
        self.api = api
        self.response_id = response_id
        self.model = model
        self.created = created
        chunk_object = "chat.completion.chunk" if api == "chat" else "text_completion"
        self._chunk_header = {"id": response_id, "object": chunk_object, "created": created, "model": model}
        head = orjson.dumps(self._chunk_header)[:-1]
        self._token_prefix = b"data: " + head + b',"choices":[{"index":'
        if api == "chat":
            self._token_key = b',"delta":{"content":'
            self._token_suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._token_key = b',"text":'
            self._token_suffix = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def token_chunk(
        self, choice: int, token_json: bytes, token_id: int | None = None, prompt_ids: Sequence[int] | None = None
    ) -> bytes:
        """An SSE chunk carrying one token (already a JSON string) for one choice; with `token_id`, its id
        (vLLM's return_token_ids), and the prompt's ids where the stream gives them (a text completion's first)."""
        if token_id is None:
            return b"".join((self._token_prefix, str(choice).encode(), self._token_key, token_json, self._token_suffix))
        entry: dict[str, Any] = {"index": choice}
        if self.api == "chat":
            entry["delta"] = {"content": orjson.loads(token_json)}
        else:
            entry["text"] = orjson.loads(token_json)
        entry.update(logprobs=None, finish_reason=None)
        if self.api != "chat":
            entry["stop_reason"] = None
            if prompt_ids is not None:
                entry["prompt_token_ids"] = list(prompt_ids)
        entry["token_ids"] = [token_id]
        return _sse({**self._chunk_header, "choices": [entry]})

    def final_chunk(
        self,
        choice: int,
        text: str,
        finish_reason: str,
        kv_transfer_params: dict[str, Any] | None = None,
        stop_reason: int | None = None,
        token_ids: Sequence[int] | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> bytes:
        """The chunk that ends a choice: its last token (or none), its finish_reason and what stopped it
        (and, asked for, the last token's id and, in a text completion's first chunk, the prompt's)."""
        entry: dict[str, Any] = {"index": choice}
        if self.api == "chat":
            entry["delta"] = {"content": text}
        else:
            entry["text"] = text
        entry.update(logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason)
        if token_ids is not None:
            if prompt_ids is not None and self.api != "chat":
                entry["prompt_token_ids"] = list(prompt_ids)
            entry["token_ids"] = list(token_ids)
        chunk: dict[str, Any] = {**self._chunk_header, "choices": [entry]}
        if kv_transfer_params is not None:
            chunk["kv_transfer_params"] = kv_transfer_params
        return _sse(chunk)

    def role_chunk(self, choice: int, prompt_ids: Sequence[int] | None = None) -> bytes:
        """The chat stream's opening delta for a choice (the stream's first carries the prompt's ids, asked)."""
        entry = {
            "index": choice,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunk: dict[str, Any] = {**self._chunk_header, "choices": [entry]}
        if prompt_ids is not None:
            chunk["prompt_token_ids"] = list(prompt_ids)
        return _sse(chunk)

    @staticmethod
    def with_running_usage(chunk: bytes, prompt_tokens: int, completion_tokens: int) -> bytes:
        """A chunk with the usage so far, as vLLM adds it with continuous_usage_stats (no details block)."""
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        return chunk.removesuffix(b"}\n\n") + b',"usage":' + orjson.dumps(usage) + b"}\n\n"

    def usage_chunk(self, usage: Usage) -> bytes:
        return _sse({**self._chunk_header, "choices": [], "usage": usage.as_dict()})

    def body(
        self,
        texts: Sequence[str],
        finish_reason: str | Sequence[str],
        usage: Usage,
        kv_transfer_params: dict[str, Any] | None,
        stop_reasons: Sequence[int | None] | None = None,
        token_ids: tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]] | None = None,
    ) -> bytes:
        """The non-streaming answer, one choice per prompt (a finish_reason for all, or one each);
        `token_ids` (each choice's prompt and output ids) where the request asked for them, as vLLM puts
        them: the prompt's at the top of a chat answer, in each choice of a text completion."""
        reasons = [finish_reason] * len(texts) if isinstance(finish_reason, str) else list(finish_reason)
        stops = list(stop_reasons) if stop_reasons is not None else [None] * len(texts)
        choices: list[dict[str, Any]]
        if self.api == "chat":
            choices = [
                {
                    "index": index,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": reasons[index],
                    "stop_reason": stops[index],
                }
                for index, text in enumerate(texts)
            ]
            obj = "chat.completion"
        else:
            choices = [
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": reasons[index],
                    "stop_reason": stops[index],
                    "prompt_logprobs": None,
                }
                for index, text in enumerate(texts)
            ]
            obj = "text_completion"
        answer: dict[str, Any] = {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage.as_dict(),
            "prompt_logprobs": None,
            "kv_transfer_params": kv_transfer_params,
        }
        if token_ids is not None:
            prompts, outputs = token_ids
            for choice, prompt, output in zip(choices, prompts, outputs, strict=True):
                choice["token_ids"] = list(output)
                if self.api != "chat":
                    choice["prompt_token_ids"] = list(prompt)
            if self.api == "chat":
                answer["prompt_token_ids"] = list(prompts[0])
        return orjson.dumps(answer)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
