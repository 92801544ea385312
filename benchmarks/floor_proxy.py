"""The Python floor of an OpenAI proxy: what any Python router pays before it does anything of its own.

A raw ASGI app on uvicorn (httptools, uvloop): a chat completion's body parsed and encoded again with
orjson, one call on dpd-router's own engine pool to the upstream engine, and its answer (or each streamed
chunk) passed back. It tokenizes nothing and routes nothing; a GET answers `{}` (its readiness probe).
The idea of ../shared/bench/floor_proxy.py, kept in the project so that a clone of it alone can run
benchmarks.stages.

Slowed (`GET /?burn_us=N`, 0 to stop), it spins N microseconds of Python on each request before its engine
call: the floor at the rate of a router whose own work takes that long, to tell what a slower process pays in
the kernel for the same reads and writes (its peers wait idle more often, and are woken for each) from what
its work itself makes the kernel do.

    python -m benchmarks.floor_proxy PORT UPSTREAM_URL
"""

from __future__ import annotations

import argparse
import time
from urllib.parse import parse_qs

import orjson
import uvicorn
from starlette.types import Receive, Scope, Send

from dpd_router.pool.engine_pool import EnginePool

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]


class FloorProxy:
    """Every POST relayed to `upstream`'s chat completions on one engine pool."""

    def __init__(self, upstream: str) -> None:
        self._url = upstream.rstrip("/") + "/v1/chat/completions"
        self._pool: EnginePool | None = None  # made in the server's loop, by the first request
        self._burn = 0.0  # seconds of Python spun on each request (slowed; 0: the floor itself)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            burn = parse_qs(scope["query_string"].decode()).get("burn_us")
            if burn:
                self._burn = float(burn[0]) / 1e6
            await send({"type": "http.response.start", "status": 200, "headers": JSON})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        if self._pool is None:
            self._pool = EnginePool(max_connections=256, keepalive_expiry=30)
        request = orjson.loads(body)
        if self._burn:
            until = time.perf_counter() + self._burn
            while time.perf_counter() < until:
                pass
        headers = {"content-type": "application/json"}
        answer = await self._pool.post(self._url, orjson.dumps(request), headers, connect_timeout=5)
        kind = SSE if request.get("stream") else JSON
        await send({"type": "http.response.start", "status": answer.status_code, "headers": kind})
        async for chunk in answer.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("port", type=int)
    parser.add_argument("upstream", help="the engine's base URL")
    args = parser.parse_args()
    app = FloorProxy(args.upstream)
    uvicorn.run(app, host="127.0.0.1", port=args.port, http="httptools", loop="uvloop", lifespan="off",
                log_level="warning", access_log=False)  # fmt: skip
