"""Counting a request's prompt tokens exactly as the engine will see them.

Chat requests are rendered through the tokenizer's chat template with the generation prompt,
then encoded without extra special tokens (what vLLM does); text prompts are encoded with them.
Long prompts are tokenized in a worker thread so the event loop keeps relaying other streams.
Without a local tokenizer, the engines' own `POST /tokenize` answers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from dpd_router.client_request import TEXT_PART_TYPES, ClientRequest
from dpd_router.errors import InvalidRequest, UpstreamError
from dpd_router.template_sandbox import TemplateSandbox


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as tokens: what routing decides on.

    `token_ids` holds the first (or only) prompt's ids; `num_tokens` counts every prompt of a batch.
    """

    token_ids: Sequence[int]
    num_tokens: int
    seconds: float


class TokenCounter(Protocol):
    async def tokenize(self, request: ClientRequest, *, max_tokens: int | None = None) -> Prompt: ...

    async def aclose(self) -> None: ...


def _text_of_content(content: Any) -> Any:
    """Chat templates expect strings; flatten OpenAI content-part arrays to their text, one part per
    line, as vLLM does before it applies the template (plain strings in the array are text parts)."""
    if isinstance(content, list):
        return "\n".join(
            part if isinstance(part, str) else part.get("text") or ""
            for part in content
            if isinstance(part, str) or (isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES)
        )
    return content


_RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "tools", "tokenize", "return_dict", "return_tensors", "chat_template"}
)
# Requests of more bytes than this are tokenized in a lane of their own, so that a few huge prompts
# cannot keep every other long prompt waiting for a thread.
LARGE_REQUEST_BYTES = 1 << 20


class PromptTooLong(Exception):
    """The prompt's size alone shows it has more tokens than the model holds; it was not tokenized."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


class _Abandoned(Exception):
    """The request was cancelled while its tokenizing waited or ran: the rest is not done."""


class LocalTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (nothing is downloaded)."""

    def __init__(
        self, tokenizer: Any, *, inline_max_chars: int, threads: int, sandbox: TemplateSandbox | None = None
    ) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust core, called directly: transformers' wrapper around it costs more
        # than the encoding itself for short prompts. `encode_batch` releases the GIL (plain `encode`
        # does not), so the worker threads use it and the event loop keeps running meanwhile.
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self._inline_max_chars = inline_max_chars
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self._large_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-large")
        self._sandbox = sandbox
        self.bytes_per_token = longest_token_bytes(tokenizer)

    @classmethod
    def load(
        cls, directory: Path, *, inline_max_chars: int, threads: int, sandbox: TemplateSandbox | None = None
    ) -> LocalTokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return cls(tokenizer, inline_max_chars=inline_max_chars, threads=threads, sandbox=sandbox)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    async def tokenize(self, request: ClientRequest, *, max_tokens: int | None = None) -> Prompt:
        """The request's prompt tokens. A prompt whose size already shows it holds more than
        `max_tokens` raises PromptTooLong before any tokenizing; a cancelled request stops its
        tokenizing at the next step (a queued one never starts)."""
        started = time.perf_counter()
        rendered = await self._render_client_template(request)
        work = self._work_for(request, rendered, max_tokens)
        size = len(request.raw) if rendered is None else len(rendered)
        if size > self._inline_max_chars:
            lane = self._large_executor if size > LARGE_REQUEST_BYTES else self._executor
            abandoned = threading.Event()
            try:
                batches = await asyncio.get_running_loop().run_in_executor(lane, work, True, abandoned)
            except asyncio.CancelledError:
                abandoned.set()
                raise
        else:
            batches = work(False, None)
        return Prompt(
            token_ids=batches[0],
            num_tokens=sum(len(ids) for ids in batches),
            seconds=time.perf_counter() - started,
        )

    def _work_for(
        self, request: ClientRequest, rendered: str | None, max_tokens: int | None
    ) -> Callable[[bool, threading.Event | None], list[Sequence[int]]]:
        """The tokenizing to do, called with whether it runs in a worker thread and the event that
        says its request was abandoned."""
        body = request.body

        def encode(texts: Callable[[], list[str]], special: bool) -> Callable[..., list[Sequence[int]]]:
            def run(threaded: bool, abandoned: threading.Event | None) -> list[Sequence[int]]:
                batches: list[Sequence[int]] = []
                for text in texts():
                    self._check_size(text, max_tokens)
                    if abandoned is not None and abandoned.is_set():
                        raise _Abandoned
                    batches.append(self._encode(text, special=special, threaded=threaded))
                return batches

            return run

        if request.kind == "chat":
            return encode(lambda: [rendered if rendered is not None else self._render(body)], False)
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return encode(lambda: [prompt], True)
        if prompt and isinstance(prompt[0], int):
            return lambda threaded, abandoned: [prompt]
        if prompt and isinstance(prompt[0], list):
            return lambda threaded, abandoned: list(prompt)
        return encode(lambda: list(prompt), True)

    def _check_size(self, text: str, max_tokens: int | None) -> None:
        """No tokenizer makes fewer tokens of a text than its bytes over its longest token's bytes."""
        if max_tokens is None or len(text) * 4 <= max_tokens * self.bytes_per_token:
            return  # too few characters to prove anything (a character is at most 4 bytes)
        at_least = len(text.encode("utf-8", "surrogatepass")) // self.bytes_per_token
        if at_least > max_tokens:
            raise PromptTooLong(at_least)

    def _encode(self, text: str, *, special: bool, threaded: bool) -> list[int]:
        if self._backend is None:
            return list(self._tokenizer.encode(text, add_special_tokens=special))
        if threaded:
            return list(self._backend.encode_batch([text], add_special_tokens=special)[0].ids)
        return list(self._backend.encode(text, add_special_tokens=special).ids)

    def _render(self, body: dict[str, Any]) -> str:
        """The prompt text of a chat request, by the tokenizer's own (trusted) template."""
        try:
            text = self._tokenizer.apply_chat_template(
                _conversation(body), tools=body.get("tools"), tokenize=False, **_template_kwargs(body)
            )
        except Exception as exc:  # jinja errors, template raise_exception(), bad message shapes
            raise InvalidRequest(f"The chat template could not render these messages: {exc}") from None
        return str(text)

    async def _render_client_template(self, request: ClientRequest) -> str | None:
        """The prompt text of a chat request that brought its own template (rendered in the sandbox)."""
        if request.kind != "chat":
            return None
        template = client_template(request.body)
        if template is None:
            return None
        if self._sandbox is None:  # parsing refuses client templates unless they are trusted
            raise InvalidRequest("Chat templates sent with requests are not accepted.", param="chat_template")
        return await self._sandbox.render(
            _conversation(request.body),
            template=template,
            tools=request.body.get("tools"),
            kwargs=_template_kwargs(request.body),
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._large_executor.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        self.close()
        if self._sandbox is not None:
            await self._sandbox.close()


def client_template(body: dict[str, Any]) -> str | None:
    """The chat template a chat request brought, as vLLM reads it: `chat_template`, else
    `chat_template_kwargs.chat_template`."""
    kwargs = body.get("chat_template_kwargs")
    template = body.get("chat_template")
    if template is None and isinstance(kwargs, dict):
        template = kwargs.get("chat_template")
    return template if isinstance(template, str) else None


def _conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**message, "content": _text_of_content(message.get("content"))} for message in body["messages"]]


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
    }
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, dict):
        kwargs.update({k: v for k, v in extra.items() if k not in _RESERVED_TEMPLATE_ARGS})
    return kwargs


def longest_token_bytes(tokenizer: Any) -> int:
    """A bound on the bytes of text one token can stand for: its longest token's, plus one for a
    leading space a decoder drops, times three when a normalizer may shrink the text first (NFKC
    and lowercasing map some three-byte characters to one byte)."""
    backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        size = backend.get_vocab_size(with_added_tokens=True)
        pieces = backend.decode_batch([[token] for token in range(size)], skip_special_tokens=False)
        shrinks = backend.normalizer is not None
    else:
        pieces = [tokenizer.convert_tokens_to_string([token]) for token in tokenizer.get_vocab()]
        shrinks = True
    longest = max((len(piece.encode("utf-8", "surrogatepass")) for piece in pieces), default=1)
    return (longest + 1) * (3 if shrinks else 1)


class EngineTokenizer:
    """Counts tokens with an engine's `POST /tokenize` when no local tokenizer is configured."""

    def __init__(self, client: httpx.AsyncClient, urls: Callable[[], list[str]], model: Callable[[], str | None]):
        self._client = client
        self._urls = urls
        self._model = model

    async def tokenize(self, request: ClientRequest, *, max_tokens: int | None = None) -> Prompt:
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

    async def aclose(self) -> None:
        pass


def _engine_error_message(response: httpx.Response) -> str:
    try:
        return str(orjson.loads(response.content)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return response.text[:500]
