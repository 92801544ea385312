"""An OpenAI-compatible engine that answers at once: raw ASGI on uvicorn, no batching, no model.

What a router in front of it adds is all that is left to measure: its HTTP, parsing, tokenizing and
relaying. A chat completion answers eight tokens, whole or as an SSE stream (with a usage chunk);
`/v1/models` names the model with its context window, `/metrics` is empty, every other GET answers `{}`.

    python -m benchmarks.instant_engine PORT [MODEL]
"""

from __future__ import annotations

import sys
from typing import Any

import orjson
import uvicorn

OUTPUT_TOKENS = 8
CONTEXT_WINDOW = 131_072


def answers(model: str) -> tuple[bytes, bytes, bytes, bytes]:
    """The whole answer, one stream chunk, the stream's end, and the models list."""
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
    return (
        orjson.dumps(whole),
        b"data: " + orjson.dumps(chunk) + b"\n\n",
        b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n",
        orjson.dumps(models),
    )


def build(model: str) -> Any:
    whole, chunk, end, models = answers(model)
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
        if b'"stream":true' in body or b'"stream": true' in body:
            await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
            for _ in range(OUTPUT_TOKENS):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": end})
            return
        await send({"type": "http.response.start", "status": 200, "headers": json_headers})
        await send({"type": "http.response.body", "body": whole})

    return app


if __name__ == "__main__":
    port = int(sys.argv[1])
    model = sys.argv[2] if len(sys.argv) > 2 else "sim-model"
    uvicorn.run(build(model), host="127.0.0.1", port=port, log_level="warning", access_log=False)
