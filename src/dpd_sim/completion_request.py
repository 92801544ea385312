"""Reading OpenAI completion bodies into token ids, with vLLM's validation and error wording.

Fields the simulator does not model are accepted and ignored, as vLLM tolerates most extras.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import orjson
from transformers import PreTrainedTokenizerBase

from dpd_sim.bootstrap import Bootstrap, bootstraps_from_body

Api = Literal["text", "chat"]
DEFAULT_MAX_TOKENS = 16


# The most choices one request may ask for: each is a sequence the simulator holds in memory.
MAX_CHOICES = 1024


class InvalidRequest(Exception):
    """The body cannot be served; answered as an OpenAI error object."""

    status_code = 400
    error_type = "BadRequestError"
    param: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param


class ModelNotFound(InvalidRequest):
    """The body names a model this engine does not serve."""

    status_code = 404
    error_type = "NotFoundError"
    param = "model"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One completion request: a prompt per choice, and how to answer."""

    api: Api
    prompts: list[list[int]]
    max_tokens: int
    seed: int
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None
    # SGLang's bootstrap fields, one entry per prompt (None: the request has none).
    bootstraps: list[Bootstrap] | None = None
    # vLLM's stop_token_ids, and min_tokens: no stop token is drawn before that many tokens.
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    # `sim_poison: true` in the body: a request that trips an engine bug, which every engine fails with 500.
    poisoned: bool = False
    # stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far.
    continuous_usage: bool = False
    # Choices per prompt (vLLM's parallel sampling: n child requests of one prompt).
    n: int = 1
    # vLLM's return_token_ids: an answer carries the prompt's ids and each choice's (a stream: each chunk
    # its token's, the first chunk the prompt's).
    return_token_ids: bool = False
    # The LoRA adapter the body names (None: the base model): it changes what is generated.
    adapter: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)


class RequestParser:
    """Turns request bodies into token ids with the engine's tokenizer and limits."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model: str,
        max_model_len: int,
        adapters: dict[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        # The LoRA adapters loaded (name -> path), changed by the engine's load and unload endpoints.
        self.adapters = {} if adapters is None else adapters
        self.max_model_len = max_model_len
        self._backend = tokenizer.backend_tokenizer
        self._vocab_size = self._backend.get_vocab_size()

    def parse(self, api: Api, raw: bytes) -> GenerationRequest:
        body = load_object(raw)
        self._check_model(body)
        stream = _optional_bool(body, "stream", default=False)
        include_usage = _include_usage(body, stream)
        continuous_usage = include_usage and bool(body["stream_options"].get("continuous_usage_stats"))
        max_tokens = self._check_output_budget(*_max_tokens(body, api))
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequest("n must be at least 1.", param="n")
        if n > MAX_CHOICES:
            # A real engine runs out of memory or time on such a request; the simulator refuses it.
            raise InvalidRequest(f"n must be at most {MAX_CHOICES} in the simulator.", param="n")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise InvalidRequest("seed must be an integer")
        kv_params = body.get("kv_transfer_params")
        if kv_params is not None and not isinstance(kv_params, dict):
            raise InvalidRequest("kv_transfer_params must be an object")
        prompts = self._chat_prompt(body) if api == "chat" else self._text_prompts(body)
        for prompt in prompts:
            self._check_length(len(prompt), from_text=api == "chat" or _text_prompt(body["prompt"]))
        # vLLM caps the output at the room the longest prompt leaves (for each prompt, in fact).
        max_tokens = min(max_tokens, self.max_model_len - max(len(prompt) for prompt in prompts))
        if max_tokens < 1:
            raise InvalidRequest(
                f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, value={max_tokens})",
                param="max_tokens",
            )
        try:
            bootstraps = bootstraps_from_body(body, len(prompts))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if bootstraps is not None and n > 1:
            raise InvalidRequest("the simulator serves n > 1 without bootstrap fields only", param="n")
        stop_token_ids, min_tokens = _stopping(body, max_tokens)
        return GenerationRequest(
            api=api,
            prompts=prompts,
            max_tokens=max_tokens,
            seed=seed or 0,
            stream=stream,
            include_usage=include_usage,
            kv_transfer_params=kv_params,
            bootstraps=bootstraps,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            poisoned=body.get("sim_poison") is True,
            continuous_usage=continuous_usage,
            n=n,
            return_token_ids=_optional_bool(body, "return_token_ids", default=False),
            adapter=model if isinstance(model := body.get("model"), str) and model in self.adapters else None,
        )

    def tokenize(self, raw: bytes) -> tuple[list[int], list[str] | None]:
        """The `/tokenize` endpoint's view: a `prompt` string, or chat `messages`; the ids, and their
        token strings when `return_token_strs` asks for them."""
        body = load_object(raw)
        self._check_model(body)
        if "messages" in body:
            ids = self._chat_prompt(body)[0]
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidRequest("either prompt (a string) or messages is required")
            ids = self._encode(prompt, _optional_bool(body, "add_special_tokens", default=True))
        if body.get("return_token_strs") is not True:
            return ids, None
        return ids, [str(token) for token in self.tokenizer.convert_ids_to_tokens(ids)]

    def detokenize(self, raw: bytes) -> str:
        """The `/detokenize` endpoint's view: the text of `tokens`, decoded as vLLM does (special tokens kept)."""
        body = load_object(raw)
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_is_token_id(token) for token in tokens):
            raise InvalidRequest("tokens must be an array of non-negative integers")
        if tokens:
            self._checked_ids(tokens)
        return str(self.tokenizer.decode(tokens))

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model and not (isinstance(model, str) and model in self.adapters):
            raise ModelNotFound(f"The model `{model}` does not exist.")

    def _text_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        add_special = _optional_bool(body, "add_special_tokens", default=True)
        if isinstance(prompt, str):
            return [self._encode(prompt, add_special)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(item, str) for item in prompt):
                return [self._encode(item, add_special) for item in prompt]
            if all(_is_token_id(item) for item in prompt):
                return [self._checked_ids(prompt)]
            if all(isinstance(item, list) and all(_is_token_id(t) for t in item) for item in prompt):
                return [self._checked_ids(item) for item in prompt]
        if prompt is None:
            raise InvalidRequest("prompt is required")
        raise InvalidRequest(
            "prompt must be a string, an array of strings, an array of tokens, or an array of token arrays"
        )

    def _chat_prompt(self, body: dict[str, Any]) -> list[list[int]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages is required and must be a non-empty array")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequest("each message must be an object with a string role")
        add_generation_prompt = _optional_bool(body, "add_generation_prompt", default=True)
        # The last (assistant) message left open for the answer to continue, as vLLM renders it.
        continue_final = _optional_bool(body, "continue_final_message", default=False)
        add_special = _optional_bool(body, "add_special_tokens", default=False)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
                tokenize=False,
            )
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
            raise InvalidRequest(f"chat template failed: {exc}") from exc
        if not isinstance(text, str):
            raise InvalidRequest("chat template did not render text")
        return [self._encode(text, add_special)]

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not ids:
            raise InvalidRequest("The prompt cannot be empty.")
        return ids

    def _checked_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequest("The prompt cannot be empty.")
        for token_id in ids:
            if not 0 <= token_id < self._vocab_size:
                raise InvalidRequest(f"Token id {token_id} is out of vocabulary")
        return ids

    def _check_output_budget(self, name: str, max_tokens: int) -> int:
        if max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"{name}={max_tokens} cannot be greater than max_model_len={self.max_model_len}. Please request "
                f"fewer output tokens. (parameter={name}, value={max_tokens})",
                param=name,
            )
        return max_tokens

    def _check_length(self, prompt_tokens: int, *, from_text: bool) -> None:
        """vLLM's refusal of a prompt longer than the context; it tokenizes text one token past the limit only."""
        if prompt_tokens <= self.max_model_len:
            return
        counted, qualifier = (self.max_model_len + 1, "at least ") if from_text else (prompt_tokens, "")
        raise InvalidRequest(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
            f"{qualifier}{counted} input tokens, which exceeds this limit even without any output tokens. Please "
            f"reduce the length of the input prompt. (parameter=input_tokens, value={counted})",
            param="input_tokens",
        )


def load_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _text_prompt(prompt: Any) -> bool:
    """Whether a text completion's prompt is text (the engine tokenizes it) rather than token ids."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], str))


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_bool(body: dict[str, Any], name: str, *, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean")
    return value


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("Stream options can only be defined when `stream=True`.")
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object")
    return bool(options.get("include_usage"))


def _stopping(body: dict[str, Any], max_tokens: int) -> tuple[frozenset[int], int]:
    """`stop_token_ids` and `min_tokens`, checked as vLLM does."""
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(_is_token_id(token) for token in stop_ids):
        raise InvalidRequest("stop_token_ids must be a list of token ids")
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    if not _is_token_id(min_tokens) or min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    return frozenset(stop_ids), int(min_tokens)


def _max_tokens(body: dict[str, Any], api: Api) -> tuple[str, int]:
    """The output budget's field and value (text completions have no max_completion_tokens: ignored)."""
    name = "max_tokens"
    value = body.get("max_tokens")
    if api == "chat" and body.get("max_completion_tokens") is not None:
        name, value = "max_completion_tokens", body["max_completion_tokens"]
    if value is None:
        return name, DEFAULT_MAX_TOKENS
    if not _is_token_id(value):
        raise InvalidRequest(f"{name} must be an integer")
    if value < 1:
        raise InvalidRequest(f"{name} must be at least 1, got {value}.")
    return name, int(value)
