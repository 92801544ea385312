"""A client's request as the router sees it: parsed once, validated, original body kept.

Only the fields the router acts on are checked; every other field is forwarded untouched,
so tools, response_format, logprobs, seed and whatever an engine adds next keep working.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import orjson

from dpd_router.messages import api as messages_api
from dpd_router.request.errors import InvalidRequest
from dpd_router.responses import api as responses_api

if TYPE_CHECKING:
    from dpd_router.responses.api import Turn

# chat and text completions and the Responses API (OpenAI's), and the Anthropic Messages API.
RequestKind = Literal["chat", "completion", "messages", "responses"]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# orjson, which encodes every body the router forwards, refuses anything nested deeper.
MAX_JSON_DEPTH = 254
# A \u escape of half a surrogate pair: a body with one is parsed by orjson, whose verdict on a lone half
# the standard library's parser does not share.
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1
# A body whose parse made more containers than this is rendered in another process and freed in pieces:
# freeing hundreds of thousands of objects at once holds the interpreter, every thread's, for tens of ms.
MANY_CONTAINERS = 20_000


@dataclass
class ClientRequest:
    """One client request: its kind, its parsed body and the raw bytes it arrived as."""

    kind: RequestKind
    body: dict[str, Any]
    raw: bytes
    stream: bool
    # Set when the router changed the body (for example filled in the model): raw is stale then.
    body_changed: bool = field(default=False)
    # How many `[` and `{` its bytes hold, in strings too: a bound on the containers its parse made, which
    # says what rendering and freeing them costs before either is done.
    brackets: int = field(default=0)
    # A Messages or Responses body converted to the chat body the engine's template renders it as.
    converted: dict[str, Any] | None = field(default=None, repr=False)
    # A Responses request that asked to be stored (`store`, true by default): the router keeps it, and
    # the engines are sent `store: false` (responses.history).
    store_asked: bool = field(default=False)
    # A Responses request the router keeps or continues (responses.history), set before it is served.
    turn: Turn | None = field(default=None, repr=False)

    @property
    def template_body(self) -> dict[str, Any] | None:
        """The chat body the engine's chat template renders of this request; None for a text completion."""
        if self.kind == "chat":
            return self.body
        return self.converted

    def template_raw(self) -> bytes:
        """The bytes of `template_body` (a chat request's as it came), for a render in another process."""
        return self.raw if self.kind == "chat" else orjson.dumps(self.converted)

    @property
    def batch_size(self) -> int:
        """How many prompts the request carries (text completions accept a list of prompts)."""
        if self.kind != "completion":
            return 1
        prompt = self.body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return len(prompt)
        return 1

    def encoded(self) -> bytes:
        """The body to forward as the client sent it (re-encoded only if the router filled something in)."""
        return orjson.dumps(self.body) if self.body_changed else self.raw


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(
    kind: RequestKind,
    raw: bytes,
    *,
    trust_chat_template: bool = False,
    yielding: bool = False,
    counting: bool = False,
) -> ClientRequest:
    """Parse and check a chat, text completion, Messages or Responses body; raise a RouterError naming the
    bad field (InvalidRequest).

    A chat template the client sends is refused unless `trust_chat_template` (as vLLM refuses it
    unless started with --trust-request-chat-template). `yielding`, for a large body parsed on another
    thread: parse it so that the event loop's thread gets the interpreter while it is parsed
    (load_yielding). `counting`: a Messages body to count the tokens of, which needs no `max_tokens`.
    """
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        body = load_yielding(raw) if yielding else orjson.loads(raw)
    except (orjson.JSONDecodeError, ValueError, RecursionError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    brackets = _brackets(raw, yielding=yielding)
    converted = None
    try:
        if kind == "chat":
            _check_messages(body)
            _check_chat_template(body, trusted=trust_chat_template)
        elif kind == "messages":
            messages_api.check_body(body, counting=counting)
            _check_chat_template(body, trusted=trust_chat_template)
        elif kind == "responses":
            responses_api.check_body(body)
            _check_chat_template(body, trusted=trust_chat_template)
        else:
            _check_prompt(body)
        _check_common(body, kind)
        _check_depth(body, brackets, yielding=yielding)
        if kind == "messages":
            converted = messages_api.template_body(body)
        elif kind == "responses":
            converted = responses_api.template_body(body)
    except InvalidRequest:
        if yielding and brackets > MANY_CONTAINERS:
            free_in_pieces(body)
        raise
    stream = bool(body.get("stream", False))
    request = ClientRequest(kind=kind, body=body, raw=raw, stream=stream, brackets=brackets, converted=converted)
    if kind == "responses":
        request.store_asked = body.get("store") is not False
        if request.store_asked:
            body["store"] = False  # no engine keeps what the next request, sent elsewhere, could not find
            request.body_changed = True
    return request


# Past this many brackets found one at a time, the rest of the body is counted in one pass.
FEW_BRACKETS = 16
# Below this many bytes, counting every byte costs less than the searches' calls.
COUNTED_WHOLE_BYTES = 1024


def count_brackets(raw: bytes) -> int:
    """How many `[` and `{` the body holds.

    Found one by one while there are few (a chat body holds a handful): each search skips the prose
    between them at memchr's pace, where `bytes.count` reads every byte (6 us for 10 kB of prompt, more
    than orjson takes to parse it); a body with many, or a short one, is counted by `bytes.count`."""
    if len(raw) < COUNTED_WHOLE_BYTES:
        return raw.count(b"[") + raw.count(b"{")
    found = 0
    for bracket in (b"[", b"{"):
        at = raw.find(bracket)
        while at >= 0:
            found += 1
            if found > FEW_BRACKETS:
                return raw.count(b"[") + raw.count(b"{")
            at = raw.find(bracket, at + 1)
    return found


def _brackets(raw: bytes, *, yielding: bool) -> int:
    """How many `[` and `{` the body holds; a `yielding` one counted a megabyte at a time (one count over
    tens of MB holds the interpreter for milliseconds)."""
    if not yielding:
        return count_brackets(raw)
    step = 1 << 20
    return sum(raw.count(b"[", at, at + step) + raw.count(b"{", at, at + step) for at in range(0, len(raw), step))


def load_yielding(raw: bytes) -> Any:
    """JSON as orjson reads it, parsed so that other threads (the event loop's) run meanwhile.

    orjson holds the interpreter for the whole parse: a 20 MB body of small objects stops every other
    thread for a quarter of a second. The standard library's parser, given a hook per object, returns to
    the interpreter at each one, so the event loop is never kept waiting longer than a switch interval.
    Its hooks give orjson's verdicts where the two differ: no NaN or Infinity, no float that overflows,
    an integer outside 64 bits read as a float; a body with an escaped surrogate goes to orjson itself.
    """
    if _ESCAPED_SURROGATE.search(raw):
        return orjson.loads(raw)
    return json.loads(
        raw.decode("utf-8"),
        object_hook=_same,
        parse_constant=_no_constant,
        parse_float=_finite_float,
        parse_int=_int_as_orjson_reads_it,
    )


def free_in_pieces(value: Any) -> None:
    """Drop a parsed body one object at a time, so that other threads (the event loop's) run meanwhile.

    Freeing a list of many objects is one call into the interpreter that frees them all; here each
    container hands what it holds to a stack and is emptied, and the loop frees one object an
    iteration. Only for a body nothing else refers to any more: its containers are emptied.
    """
    stack: list[Any] = [value]
    del value
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            item.clear()
        elif isinstance(item, list):
            stack.extend(item)
            item.clear()


def _same(value: dict[str, Any]) -> dict[str, Any]:
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def _int_as_orjson_reads_it(text: str) -> int | float:
    if len(text) <= 18:  # within 64 bits however it is signed
        return int(text)
    value = int(text)
    return value if _INT64_MIN <= value <= _UINT64_MAX else _finite_float(text)


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("'messages' is a required property.", param="messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array of messages.", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{index}] must be an object.", param=f"messages[{index}]")
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"messages[{index}].role is required and must be a string.", param=f"messages[{index}].role"
            )
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest(f"messages[{index}].name must be a string.", param=f"messages[{index}].name")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequest(
                f"messages[{index}].content must be a string or an array of content parts.",
                param=f"messages[{index}].content",
            )
        for number, part in enumerate(content):
            _check_content_part(part, f"messages[{index}].content[{number}]")


def _check_chat_template(body: dict[str, Any], *, trusted: bool) -> None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object.", param="chat_template_kwargs")
    given = {"chat_template": body.get("chat_template")}
    if kwargs:
        given["chat_template_kwargs.chat_template"] = kwargs.get("chat_template")
    given = {name: template for name, template in given.items() if template is not None}
    if not given:
        return
    if not trusted:
        raise InvalidRequest(
            "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request "
            "with untrusted chat template. (dpd-router: set trust_request_chat_template to accept it.)",
            param=next(iter(given)),
        )
    for name, template in given.items():
        if not isinstance(template, str):
            raise InvalidRequest(f"'{name}' must be a string.", param=name)


# Part types whose `text` is the part's text (vLLM's chat parser reads these three the same way).
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


def _check_content_part(part: Any, where: str) -> None:
    """A content part is a string (plain text, as vLLM accepts) or an object with a string `type`;
    a text part's `text` is a string."""
    if isinstance(part, str):
        return
    if not isinstance(part, dict):
        raise InvalidRequest(f"{where} must be a string or a content part object.", param=where)
    kind = part.get("type")
    if kind is not None and not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type must be a string.", param=f"{where}.type")
    text = part.get("text")
    if (kind in TEXT_PART_TYPES or kind is None) and text is not None and not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be a string.", param=f"{where}.text")


def _check_prompt(body: dict[str, Any]) -> None:
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequest("'prompt' is a required property.", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return
    message = "'prompt' must be a string, an array of strings, an array of token ids or an array of those."
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(message, param="prompt")
    if all(_is_int(token) for token in prompt):
        if any(token < 0 for token in prompt):
            raise InvalidRequest("Token ids in 'prompt' must not be negative.", param="prompt")
        return
    if all(isinstance(item, str) for item in prompt):
        return
    if all(isinstance(item, list) and item and all(_is_int(t) and t >= 0 for t in item) for item in prompt):
        return
    raise InvalidRequest(message, param="prompt")


def _check_common(body: dict[str, Any], kind: RequestKind) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string.", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    # vLLM's completions API has no max_completion_tokens (it ignores the field): only chat's counts.
    limits = {"chat": ("max_tokens", "max_completion_tokens"), "responses": ("max_output_tokens",)}.get(
        kind, ("max_tokens",)
    )
    for name in limits:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value):
            raise InvalidRequest(f"'{name}' must be an integer.", param=name)
        if value < 1:
            raise InvalidRequest(f"'{name}' must be at least 1, got {value}.", param=name)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise InvalidRequest("'n' must be an integer of at least 1.", param="n")
    if "kv_transfer_params" in body:
        raise InvalidRequest(
            "'kv_transfer_params' is set by the router and cannot be sent by clients.",
            param="kv_transfer_params",
        )


def _check_depth(body: dict[str, Any], brackets: int, *, yielding: bool) -> None:
    """Refuse a body nested deeper than the router can encode again (it re-encodes what it forwards).

    Only a body with more brackets than that depth can be that deep, so most are never re-encoded here;
    a `yielding` one is measured by a walk of its containers instead, which lets other threads run.
    """
    if brackets <= MAX_JSON_DEPTH:
        return
    if yielding:
        too_deep = _nested_deeper_than(body, MAX_JSON_DEPTH)
    else:
        try:
            orjson.dumps(body)
            too_deep = False
        except orjson.JSONEncodeError:
            too_deep = True
    if too_deep:
        raise InvalidRequest(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep.")


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest inside `value` more than `limit` levels deep (orjson's count: the
    outermost container is level 1). Depth first, holding one iterator a level: a walk level by level
    holds a list of every container of a level, and a collector's pass over such a list while it is
    young reads hundreds of thousands of objects, holding every thread meanwhile."""
    levels: list[Any] = [_children(value)]
    while levels:
        for child in levels[-1]:
            if _is_container(child):
                if len(levels) >= limit:
                    return True
                levels.append(_children(child))
                break
        else:
            levels.pop()
    return False


def _children(value: Any) -> Any:
    return iter(value.values() if isinstance(value, dict) else value)


def _is_container(value: Any) -> bool:
    return isinstance(value, dict | list)


def clean_request_id(given: str | None) -> str | None:
    """The client's X-Request-Id if it is safe to forward to engines and logs, else None."""
    if given and _REQUEST_ID.match(given):
        return given
    return None
