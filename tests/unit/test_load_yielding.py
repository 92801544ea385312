"""A large body is parsed by the standard library (so that the event loop runs meanwhile) with orjson's
verdicts: the same value for what orjson reads, an error for what orjson refuses."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpd_router.request.client_request import free_in_pieces, load_yielding, parse_request
from dpd_router.request.errors import InvalidRequest


def verdict(loader: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "value", loader(raw)
    except (orjson.JSONDecodeError, ValueError, RecursionError):
        return "refused", None


def same(left: Any, right: Any) -> bool:
    """Equal, and of the same types all the way down (1 is not 1.0 here), NaN nowhere."""
    if type(left) is not type(right):
        return False
    if isinstance(left, dict):
        return list(left) == list(right) and all(same(left[k], right[k]) for k in left)
    if isinstance(left, list):
        return len(left) == len(right) and all(same(a, b) for a, b in zip(left, right, strict=True))
    if isinstance(left, float):
        return left == right or (math.isnan(left) and math.isnan(right))
    return bool(left == right)


# Number and string spellings where parsers disagree, in every place a value can stand.
tricky = st.sampled_from(
    [
        b"1e400", b"-1e400", b"NaN", b"Infinity", b"-Infinity", b"123456789012345678901234567890",
        b"18446744073709551615", b"18446744073709551616", b"-9223372036854775808", b"-9223372036854775809",
        b"-0", b"0.0", b"1E5", b"1e-400", b"01", b"1.", b".5", b'"\\ud800"', b'"\\udfff x"', b'"\\ud83d\\ude00"',
        b'"\\u0000"', b'"\\x"', b'"\xff"', b'"\xed\xa0\x80"', b'"\x01"', b'"\\/"', b"true", b"nul",
        b"1" * 400, b"[]", b"{}", b'{"a":1,"a":2}',
    ]
)  # fmt: skip
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
)


def spelled(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


@given(st.lists(values.map(spelled) | tricky, min_size=1, max_size=5), st.sampled_from([b",", b" , ", b",\n"]))
def test_the_yielding_parser_gives_orjsons_verdict(parts: list[bytes], separator: bytes) -> None:
    for raw in (b"[" + separator.join(parts) + b"]", b'{"k": ' + parts[0] + b"}", parts[0]):
        ours, theirs = verdict(load_yielding, raw), verdict(orjson.loads, raw)
        assert ours[0] == theirs[0], raw
        assert same(ours[1], theirs[1]), raw


def test_a_large_body_parsed_yielding_is_the_body_parsed_at_once() -> None:
    raw = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": f"part {i}"} for i in range(2000)], "seed": 2**63}
    )
    at_once, yielding = parse_request("chat", raw), parse_request("chat", raw, yielding=True)
    assert same(yielding.body, at_once.body) and yielding.raw == raw


@pytest.mark.parametrize("depth", [253, 254, 255, 400])
def test_the_depth_limit_is_the_same_either_way(depth: int) -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    outcomes = []
    for yielding in (False, True):
        try:
            parse_request("chat", raw, yielding=yielding)
            outcomes.append("served")
        except InvalidRequest as exc:
            outcomes.append(str(exc.message)[:30])
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0] == "served") == (depth <= 254)


def test_a_body_is_counted_alike_either_way_and_freed_in_pieces_to_nothing() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "[{" * (i % 7)}]} for i in range(40_000)]
    raw = orjson.dumps({"messages": messages, "tools": [{"a": [[], {}]}]})
    assert len(raw) > 2 << 20  # counted in several pieces when yielding
    at_once, yielding = parse_request("chat", raw), parse_request("chat", raw, yielding=True)
    assert at_once.brackets == yielding.brackets == raw.count(b"[") + raw.count(b"{")
    body = yielding.body
    parts, tools = body["messages"][7]["content"], body["tools"]
    free_in_pieces(body)
    assert body == {} and parts == [] and tools == []


def test_a_refused_body_of_many_containers_is_still_refused_naming_its_field() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 30_000 + [{"role": 5}]
    with pytest.raises(InvalidRequest) as refused:
        parse_request("chat", orjson.dumps({"messages": messages}), yielding=True)
    assert refused.value.param == "messages[30000].role"
