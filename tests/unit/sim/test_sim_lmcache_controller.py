"""The LMCache controller stand-in: what KV events teach it, and its /lookup and /query_instance."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest

from dpd_sim.kv import block_hashes
from dpd_sim.kv_events import (
    EventFormat,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
    external_hash,
)
from dpd_sim.lmcache_controller import Controller, create_app, parse_instance

PROMPT = list(range(500, 560))  # 3 full blocks and 12 tokens


def engine_hashes(tokens: list[int]) -> list[int]:
    return [external_hash(block) for block in block_hashes(tokens)]


@pytest.mark.parametrize("event_format", ["map", "array"])
def test_events_in_either_encoding_place_a_prefix_on_an_instance(event_format: EventFormat) -> None:
    controller = Controller({"a": "tcp://127.0.0.1:1", "b": "tcp://127.0.0.1:2"})
    hashes = engine_hashes(PROMPT)
    a, b = controller.instances["a"], controller.instances["b"]
    a.apply(encode_batch(time.time(), [block_stored(hashes[:1], None, PROMPT[:16])], event_format))
    a.apply(encode_batch(time.time(), [block_stored(hashes[1:], hashes[0], PROMPT[16:48])], event_format))
    b.apply(encode_batch(time.time(), [block_stored(hashes[:1], None, PROMPT[:16])], event_format))
    assert controller.lookup(PROMPT) == {"a": 48, "b": 16}
    assert controller.lookup([*PROMPT[:16], 1, 2, 3]) == {"a": 16, "b": 16}
    assert controller.lookup([9, *PROMPT[1:]]) == {}

    a.apply(encode_batch(time.time(), [block_removed(hashes[1:2])], event_format))
    assert controller.lookup(PROMPT) == {"a": 16, "b": 16}
    b.apply(encode_batch(time.time(), [all_blocks_cleared()], event_format))
    assert controller.lookup(PROMPT) == {"a": 16}
    assert (a.batches, len(a), b.batches, len(b)) == (3, 2, 2, 0)


def test_a_block_whose_parent_was_never_seen_is_not_placed() -> None:
    controller = Controller({"a": "tcp://127.0.0.1:1"})
    hashes = engine_hashes(PROMPT)
    controller.instances["a"].apply(
        encode_batch(time.time(), [block_stored(hashes[1:], hashes[0], PROMPT[16:48])], "map")
    )
    assert controller.lookup(PROMPT) == {}


async def test_lookup_and_query_instance_answer_as_the_lmcache_controller() -> None:
    controller = Controller({"a": "tcp://127.0.0.1:1", "b": "tcp://127.0.0.1:2"}, ips={"b": "10.0.0.5"})
    hashes = engine_hashes(PROMPT)
    controller.instances["b"].apply(encode_batch(time.time(), [block_stored(hashes, None, PROMPT[:48])], "map"))
    app = create_app(controller)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://controller") as http,
    ):
        found = (await http.post("/lookup", json={"tokens": PROMPT})).json()
        instance = (await http.post("/query_instance", json={"event_id": "e1", "ip": "10.0.0.5"})).json()
        unknown = (await http.post("/query_instance", json={"event_id": "e2", "ip": "10.0.0.6"})).json()
        bad = await http.post("/lookup", json={"tokens": "abc"})
        heard = (await http.get("/sim/instances")).json()
    assert found["event_id"] and found["layout_info"] == {"b": ["LocalCPUBackend", 48]}
    assert instance == {"event_id": "e1", "res": "b"} and unknown == {"event_id": "e2", "res": None}
    assert bad.status_code == 400
    assert heard == {"a": {"batches": 0, "blocks": 0}, "b": {"batches": 1, "blocks": 3}}


def test_instances_are_given_as_id_address_and_optional_ip() -> None:
    assert parse_instance("p0=tcp://127.0.0.1:5557") == ("p0", "tcp://127.0.0.1:5557", None)
    assert parse_instance("p0=tcp://10.0.0.5:5557@10.0.0.5") == ("p0", "tcp://10.0.0.5:5557", "10.0.0.5")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_instance("p0")
