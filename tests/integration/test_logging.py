"""`dpd-router serve` as a real process writes one JSON line a request to its stderr (record/logs.py), through
uvicorn's start: uvicorn's own logging configuration, applied, closed the router's log writer, and the lines
were kept in memory unwritten."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from dpd_sim.cluster import SimCluster

from .conftest import MODEL, chat_body, openai_client, router_process


def request_lines(log: Path) -> list[dict[str, Any]]:
    """The router's per-request lines in its output so far."""
    found = []
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{"):
            entry = orjson.loads(line)
            if entry.get("logger") == "dpd_router.request":
                found.append(entry)
    return found


async def test_the_router_process_writes_a_json_line_for_each_request(
    cluster: SimCluster, tokenizer_dir: Path, tmp_path: Path
) -> None:
    args = ["--tokenizer", str(tokenizer_dir), "--model", MODEL, "--routing-threshold", "100000"]
    for url in cluster.decode_urls:
        args += ["--decode", url]
    log = tmp_path / "router.log"
    async with router_process(log, *args) as base_url:
        async with openai_client(base_url) as client:
            asked = []
            for number in range(3):
                answer = await client.chat.completions.with_raw_response.create(**chat_body(f"Line {number}, please."))
                asked.append(answer.headers["x-request-id"])
        for _ in range(200):  # the writer writes what gathered every 50 ms
            lines = request_lines(log)
            if len(lines) >= len(asked):
                break
            await asyncio.sleep(0.05)
    assert [line["request_id"] for line in lines] == asked, log.read_text()
    assert {(line["level"], line["path"], line["status"], line["outcome"]) for line in lines} == {
        ("info", "direct", 200, "ok")
    }
    assert all(line["model"] == MODEL and line["prompt_tokens"] > 0 for line in lines)
