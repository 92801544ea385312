"""An OpenAI-compatible engine that answers at once: raw ASGI on uvicorn, no batching, no model.

What a router in front of it adds is all that is left to measure: its HTTP, parsing, tokenizing and
relaying. A chat completion answers eight tokens, whole or as an SSE stream (with a usage chunk; a
stream has `--stream-tokens` chunks, sent at once, or one a step of `instant_gap_ms` where the body names
that field: a decoder's pace, every stream's next chunk at the same step's start, as a batching engine
sends them); a prefill call (NIXL's `do_remote_decode`) answers one token with `kv_transfer_params`, so a
router's two hops can run against it; asked for `return_token_ids`, with the prompt's ids as vLLM sends
them (as many as a body of its size holds at four bytes a token: a count, not an encoding, so the answer
is the size a real one is). `/v1/models` names the model with its context window, `/metrics` is empty,
every other GET answers `{}`.

    python -m benchmarks.instant_engine PORT [MODEL] [--stream-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import Any

import orjson
import uvicorn

OUTPUT_TOKENS = 8
CONTEXT_WINDOW = 131_072
# A stream's pace, named by the request (a field only this engine reads; a router passes it on).
_GAP = re.compile(rb'"instant_gap_ms":\s*(\d+(?:\.\d+)?)')


def answers(model: str) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """The whole answer, one stream chunk, the stream's end, the models list, and a prefill's answer."""
    usage = {"prompt_tokens": 30, "completion_tokens": OUTPUT_TOKENS, "total_tokens": 30 + OUTPUT_TOKENS}
    head = {"id": "chatcmpl-instant", "created": 1, "model": model}
    whole = {
        **head,
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok " * OUTPUT_TOKENS}, "finish_reason": "length"}
        ],
        "usage": usage,
    }
    chunk = {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ok "}}]}
    last = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
    models = {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": CONTEXT_WINDOW}]}
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "instant", "tp_size": 1}
    params |= {"remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 5600}
    first = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}
    prefill = {**whole, "choices": [first], "kv_transfer_params": params}
    prefill["usage"] = {**usage, "completion_tokens": 1, "total_tokens": 31}
    return (
        orjson.dumps(whole),
        b"data: " + orjson.dumps(chunk) + b"\n\n",
        b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n",
        orjson.dumps(models),
        orjson.dumps(prefill),
    )


def prefill_with_ids(prefill: bytes, tokens: int) -> bytes:
    """The prefill answer with `tokens` prompt ids at its top, its usage counting as many."""
    answer = orjson.loads(prefill)
    answer["usage"] = {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1}
    answer["prompt_token_ids"] = [(17 * index) % 30_000 for index in range(tokens)]
    return orjson.dumps(answer)


def build(model: str, stream_tokens: int = OUTPUT_TOKENS) -> Any:
    whole, chunk, end, models, prefill = answers(model)
    with_ids: dict[int, bytes] = {}  # a bench sends a few sizes of prompt: each answer is built once
    json_headers = [(b"content-type", b"application/json")]
    sse_headers = [(b"content-type", b"text/event-stream")]
    text_headers = [(b"content-type", b"text/plain; version=0.0.4")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            if scope["path"] == "/metrics":  # no load to report: an empty exposition
                await send({"type": "http.response.start", "status": 200, "headers": text_headers})
                await send({"type": "http.response.body", "body": b""})
                return
            payload = models if scope["path"].endswith("/models") else b"{}"
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": payload})
            return
        # A substring test, not a parse: parsing the body is the router's cost, not the engine's.
        if b'"do_remote_decode":true' in body:
            answer = prefill
            if b'"return_token_ids":true' in body:
                tokens = max(len(body) // 4, 1)
                answer = with_ids.get(tokens) or prefill_with_ids(prefill, tokens)
                if len(with_ids) < 64:
                    with_ids[tokens] = answer
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": answer})
            return
        if b'"stream":true' in body or b'"stream": true' in body:
            paced = _GAP.search(body)
            gap = float(paced[1]) / 1000 if paced else 0.0
            await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
            loop = asyncio.get_running_loop()
            # The steps start at multiples of the gap: every stream's next chunk goes out together, as a batch's
            # do. Each wait runs to its step's start (a timer that fired early does not move the next one).
            step = (loop.time() // gap + 1) * gap if gap else 0.0
            for _ in range(stream_tokens):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if gap:
                    await asyncio.sleep(max(step - loop.time(), 0.0))
                    step += gap
            await send({"type": "http.response.body", "body": end})
            return
        await send({"type": "http.response.start", "status": 200, "headers": json_headers})
        await send({"type": "http.response.body", "body": whole})

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("port", type=int)
    parser.add_argument("model", nargs="?", default="sim-model")
    parser.add_argument("--stream-tokens", type=int, default=OUTPUT_TOKENS, help="content chunks in a stream")
    args = parser.parse_args()
    app = build(args.model, args.stream_tokens)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
