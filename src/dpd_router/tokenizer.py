"""Counting a request's prompt tokens exactly as the engine will see them.

Chat requests are rendered through the tokenizer's chat template with the generation prompt,
then encoded without extra special tokens (what vLLM does); text prompts are encoded with them.
Long prompts are tokenized in a worker thread so the event loop keeps relaying other streams.
Without a local tokenizer, the engines' own `POST /tokenize` answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from dpd_router.errors import InvalidRequest, UpstreamError
from dpd_router.request import ClientRequest


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as tokens: what routing decides on.

    `token_ids` holds the first (or only) prompt's ids; `num_tokens` counts every prompt of a batch.
    """

    token_ids: Sequence[int]
    num_tokens: int
    seconds: float


class TokenCounter(Protocol):
    async def tokenize(self, request: ClientRequest) -> Prompt: ...

    def close(self) -> None: ...


def _text_of_content(content: Any) -> Any:
    """Chat templates expect strings; flatten OpenAI content-part arrays to their text, one part per
    line, as vLLM does before it applies the template."""
    if isinstance(content, list):
        return "\n".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    return content


_RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "tools", "tokenize", "return_dict", "return_tensors"})


class LocalTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (nothing is downloaded)."""

    def __init__(self, tokenizer: Any, *, inline_max_chars: int, threads: int) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust core, called directly: transformers' wrapper around it costs more
        # than the encoding itself for short prompts. `encode_batch` releases the GIL (plain `encode`
        # does not), so the worker threads use it and the event loop keeps running meanwhile.
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self._inline_max_chars = inline_max_chars
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    @classmethod
    def load(cls, directory: Path, *, inline_max_chars: int, threads: int) -> LocalTokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return cls(tokenizer, inline_max_chars=inline_max_chars, threads=threads)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    async def tokenize(self, request: ClientRequest) -> Prompt:
        started = time.perf_counter()
        work, size = self._work_for(request)
        if size > self._inline_max_chars:
            loop = asyncio.get_running_loop()
            batches = await loop.run_in_executor(self._executor, work, True)
        else:
            batches = work(False)
        return Prompt(
            token_ids=batches[0],
            num_tokens=sum(len(ids) for ids in batches),
            seconds=time.perf_counter() - started,
        )

    def _work_for(self, request: ClientRequest) -> tuple[Callable[[bool], list[Sequence[int]]], int]:
        """The tokenizing to do (called with whether it runs in a worker thread) and its size in characters."""
        body = request.body
        if request.kind == "chat":
            messages = body["messages"]
            size = sum(len(str(m.get("content") or "")) for m in messages)
            return (lambda threaded: [self._encode_chat(body, threaded)]), size
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return (lambda threaded: [self._encode_text(prompt, threaded)]), len(prompt)
        if prompt and isinstance(prompt[0], int):
            return (lambda threaded: [prompt]), 0
        if prompt and isinstance(prompt[0], list):
            return (lambda threaded: list(prompt)), 0
        size = sum(len(item) for item in prompt)
        return (lambda threaded: [self._encode_text(item, threaded) for item in prompt]), size

    def _encode(self, text: str, *, special: bool, threaded: bool) -> list[int]:
        if self._backend is None:
            return list(self._tokenizer.encode(text, add_special_tokens=special))
        if threaded:
            return list(self._backend.encode_batch([text], add_special_tokens=special)[0].ids)
        return list(self._backend.encode(text, add_special_tokens=special).ids)

    def _encode_text(self, text: str, threaded: bool = False) -> list[int]:
        return self._encode(text, special=True, threaded=threaded)

    def _encode_chat(self, body: dict[str, Any], threaded: bool = False) -> list[int]:
        messages = [{**message, "content": _text_of_content(message.get("content"))} for message in body["messages"]]
        kwargs: dict[str, Any] = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
        }
        extra = body.get("chat_template_kwargs")
        if isinstance(extra, dict):
            kwargs.update({k: v for k, v in extra.items() if k not in _RESERVED_TEMPLATE_ARGS})
        try:
            text = self._tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=False, **kwargs)
        except Exception as exc:  # jinja errors, template raise_exception(), bad message shapes
            raise InvalidRequest(f"The chat template could not render these messages: {exc}") from None
        return self._encode(text, special=False, threaded=threaded)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class EngineTokenizer:
    """Counts tokens with an engine's `POST /tokenize` when no local tokenizer is configured."""

    def __init__(self, client: httpx.AsyncClient, urls: Callable[[], list[str]], model: Callable[[], str | None]):
        self._client = client
        self._urls = urls
        self._model = model

    async def tokenize(self, request: ClientRequest) -> Prompt:
        started = time.perf_counter()
        body = request.body
        if request.kind == "chat":
            payload: dict[str, Any] = {"messages": body["messages"], "add_generation_prompt": True}
            model = self._model()
            if model:
                payload["model"] = model
            batches = [await self._ask(payload)]
        else:
            prompt = body["prompt"]
            if isinstance(prompt, str):
                batches = [await self._ask({"prompt": prompt, "add_special_tokens": True})]
            elif prompt and isinstance(prompt[0], int):
                batches = [prompt]
            elif prompt and isinstance(prompt[0], list):
                batches = list(prompt)
            else:
                batches = list(
                    await asyncio.gather(*(self._ask({"prompt": p, "add_special_tokens": True}) for p in prompt))
                )
        return Prompt(
            token_ids=batches[0],
            num_tokens=sum(len(ids) for ids in batches),
            seconds=time.perf_counter() - started,
        )

    async def _ask(self, payload: dict[str, Any]) -> list[int]:
        last_error = "no engine to ask"
        for url in self._urls():
            try:
                response = await self._client.post(f"{url}/tokenize", content=orjson.dumps(payload))
            except httpx.HTTPError as exc:
                last_error = f"{url}: {type(exc).__name__}"
                continue
            if response.status_code == 400:
                raise InvalidRequest(_engine_error_message(response))
            if response.status_code != 200:
                last_error = f"{url}: status {response.status_code}"
                continue
            return list(orjson.loads(response.content)["tokens"])
        raise UpstreamError(f"Could not tokenize the prompt: {last_error}")

    def close(self) -> None:
        pass


def _engine_error_message(response: httpx.Response) -> str:
    try:
        return str(orjson.loads(response.content)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response.text[:500]
