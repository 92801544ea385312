"""Chat templates sent by clients, rendered in a subprocess that can be stopped.

A Jinja template is a program: two nested loops of ten thousand, or `'x' * 300000000`, run for
seconds or take gigabytes, and Jinja's sandbox bounds neither. So a client's template (accepted
only with `trust_request_chat_template`) is rendered by a worker process of its own, through the
same `apply_chat_template` (and so the same sandboxed Jinja environment) as the server's template:
its address space is capped, its output is capped, and a render that outlives `timeout` seconds
kills the worker, which the next render starts again. The event loop only waits on a pipe.

The worker speaks length-prefixed JSON frames on its stdin and stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import struct
import sys
from pathlib import Path
from typing import Any

import orjson

from dpd_router.errors import InvalidRequest

log = logging.getLogger("dpd_router.tokenizer")

_FRAME = struct.Struct(">I")
# What the worker may allocate beyond what it holds once its tokenizer is loaded.
WORKER_MEMORY_BYTES = 1 << 30
# Seconds a new worker may take to import transformers and load the tokenizer.
WORKER_START_TIMEOUT = 120.0


class TemplateSandbox:
    """One worker process rendering client templates, one at a time."""

    def __init__(self, tokenizer_dir: Path, *, timeout: float, max_output_chars: int) -> None:
        self._tokenizer_dir = tokenizer_dir
        self._timeout = timeout
        self._max_output_chars = max_output_chars
        self._worker: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def render(
        self, conversation: list[dict[str, Any]], *, template: str, tools: Any, kwargs: dict[str, Any]
    ) -> str:
        """The prompt text `template` makes of the conversation; InvalidRequest when it fails, takes
        longer than the timeout, or writes more than the output cap."""
        job = orjson.dumps({"conversation": conversation, "template": template, "tools": tools, "kwargs": kwargs})
        async with self._lock:
            worker = await self._running_worker()
            try:
                async with asyncio.timeout(self._timeout):
                    answer = await _exchange(worker, job)
            except TimeoutError:
                await self._stop()
                raise InvalidRequest(
                    f"The request's chat template did not finish rendering within {self._timeout:g} s.",
                    param="chat_template",
                ) from None
            except (ConnectionError, asyncio.IncompleteReadError):
                await self._stop()
                raise InvalidRequest(
                    "The request's chat template could not be rendered: it used more memory than allowed.",
                    param="chat_template",
                ) from None
            except asyncio.CancelledError:
                await self._stop()  # the client left mid-render: do not let its template run on
                raise
        if "error" in answer:
            raise InvalidRequest(f"The chat template could not render these messages: {answer['error']}")
        return str(answer["text"])

    async def start(self) -> None:
        """Start the worker now rather than on the first template (it loads the tokenizer first)."""
        async with self._lock:
            await self._running_worker()

    async def _running_worker(self) -> asyncio.subprocess.Process:
        if self._worker is not None and self._worker.returncode is None:
            return self._worker
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dpd_router.template_sandbox",
            str(self._tokenizer_dir),
            str(self._max_output_chars),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            # Its first frame says the tokenizer is loaded: a render's time starts after that.
            async with asyncio.timeout(WORKER_START_TIMEOUT):
                assert worker.stdout is not None
                await worker.stdout.readexactly(_FRAME.size)
        except BaseException:
            worker.kill()
            await worker.wait()
            raise
        self._worker = worker
        return worker

    async def _stop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None and worker.returncode is None:
            worker.kill()
            await worker.wait()

    async def close(self) -> None:
        async with self._lock:
            await self._stop()


async def _exchange(worker: asyncio.subprocess.Process, job: bytes) -> dict[str, Any]:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(_FRAME.pack(len(job)) + job)
    await worker.stdin.drain()
    (size,) = _FRAME.unpack(await worker.stdout.readexactly(_FRAME.size))
    answer = orjson.loads(await worker.stdout.readexactly(size))
    assert isinstance(answer, dict)
    return answer


def _serve(tokenizer_dir: str, max_output_chars: int) -> None:
    """The worker: load the tokenizer, cap the address space, then render jobs until stdin closes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    limit = mapped + WORKER_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sink.write(_FRAME.pack(0))  # ready
    sink.flush()
    while True:
        header = source.read(_FRAME.size)
        if len(header) < _FRAME.size:
            return
        job = orjson.loads(source.read(_FRAME.unpack(header)[0]))
        answer: dict[str, Any]
        try:
            text = tokenizer.apply_chat_template(
                job["conversation"], chat_template=job["template"], tools=job["tools"], tokenize=False, **job["kwargs"]
            )
            if len(text) > max_output_chars:
                answer = {"error": f"it rendered more than {max_output_chars} characters"}
            else:
                answer = {"text": text}
        except MemoryError:
            answer = {"error": "it used more memory than allowed"}
        except Exception as exc:  # jinja errors, raise_exception(), bad shapes: the client's template's fault
            answer = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        frame = orjson.dumps(answer)
        sink.write(_FRAME.pack(len(frame)) + frame)
        sink.flush()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        _serve(sys.argv[1], int(sys.argv[2]))
