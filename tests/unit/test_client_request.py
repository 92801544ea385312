from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpd_router.api.errors import response_for
from dpd_router.request.client_request import (
    COUNTED_WHOLE_BYTES,
    FEW_BRACKETS,
    clean_request_id,
    count_brackets,
    parse_request,
)
from dpd_router.request.errors import InvalidRequest, ModelNotFound, NoHealthyDecoder


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


# Bodies around both cut-offs: short ones counted whole, long ones searched, with few brackets or many.
_BRACKET_BYTES = st.lists(
    st.one_of(st.sampled_from([b"[", b"{", b"]", b"}", b"x", b" "]), st.binary(min_size=1, max_size=64)),
    max_size=FEW_BRACKETS * 3,
).map(b"".join)


@given(_BRACKET_BYTES, st.integers(0, 3 * COUNTED_WHOLE_BYTES))
def test_brackets_are_counted_as_every_byte_counted_would(parts: bytes, prose: int) -> None:
    for raw in (parts, b"a" * prose + parts, parts + b"z" * prose, b"[" + b"q" * prose + parts + b"{"):
        assert count_brackets(raw) == raw.count(b"[") + raw.count(b"{")


def test_unknown_fields_are_kept_untouched() -> None:
    raw = chat(tools=[{"type": "function", "function": {"name": "f"}}], seed=7, logprobs=True)
    request = parse_request("chat", raw)
    assert request.encoded() == raw
    assert request.body["seed"] == 7


@pytest.mark.parametrize(
    ("kind", "raw", "param"),
    [
        ("chat", b"{not json", None),
        ("chat", b"", None),
        ("chat", b"[1, 2]", None),
        ("chat", orjson.dumps({"model": "m"}), "messages"),
        ("chat", orjson.dumps({"messages": []}), "messages"),
        ("chat", orjson.dumps({"messages": ["hi"]}), "messages[0]"),
        ("chat", orjson.dumps({"messages": [{"content": "hi"}]}), "messages[0].role"),
        ("chat", chat(max_tokens=-1), "max_tokens"),
        ("chat", chat(max_tokens=0), "max_tokens"),
        ("chat", chat(max_tokens="ten"), "max_tokens"),
        ("chat", chat(max_completion_tokens=-5), "max_completion_tokens"),
        ("chat", chat(stream="yes"), "stream"),
        ("chat", chat(n=0), "n"),
        ("chat", chat(kv_transfer_params={"remote_host": "10.0.0.1"}), "kv_transfer_params"),
        ("completion", orjson.dumps({"model": "m"}), "prompt"),
        ("completion", orjson.dumps({"prompt": []}), "prompt"),
        ("completion", orjson.dumps({"prompt": [1, "a"]}), "prompt"),
        ("completion", orjson.dumps({"prompt": [1, -2]}), "prompt"),
        ("completion", orjson.dumps({"prompt": {"a": 1}}), "prompt"),
    ],
)
def test_bad_bodies_are_400_with_the_field_named(kind: str, raw: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(kind, raw)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("prompt", "batch"),
    [("one", 1), (["a", "b", "c"], 3), ([1, 2, 3], 1), ([[1, 2], [3]], 2)],
)
def test_every_completion_prompt_form_is_accepted(prompt: object, batch: int) -> None:
    request = parse_request("completion", orjson.dumps({"prompt": prompt, "stream": True}))
    assert request.batch_size == batch
    assert request.stream is True


def test_error_types_map_to_openai_bodies_and_statuses() -> None:
    for error, status, kind in [
        (InvalidRequest("bad", param="x"), 400, "BadRequestError"),
        (ModelNotFound("nope"), 404, "NotFoundError"),
        (NoHealthyDecoder("down"), 503, "ServiceUnavailableError"),
    ]:
        response = response_for(error)
        assert response.status_code == status
        body = orjson.loads(response.body)
        assert body["error"]["type"] == kind
        assert body["error"]["code"] == status
        assert body["error"]["message"] == error.message


def test_request_ids_are_forwarded_only_when_safe() -> None:
    assert clean_request_id("abc-123_x.y:z") == "abc-123_x.y:z"
    assert clean_request_id("has space") is None
    assert clean_request_id("x" * 200) is None
    assert clean_request_id(None) is None
