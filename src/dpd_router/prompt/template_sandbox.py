"""Chat templates rendered in a subprocess that can be stopped: a client's, and the server's over a body
of very many messages.

A Jinja template is a program: two nested loops of ten thousand, or `'x' * 300000000`, run for
seconds or take gigabytes, and Jinja's sandbox bounds neither. So a client's template (accepted
only with `trust_request_chat_template`) is rendered by a worker process of its own, through the
same `apply_chat_template` (and so the same sandboxed Jinja environment) as the server's template:
its address space is capped, its output is capped, and a render that outlives `timeout` seconds
kills the worker, which the next render starts again. The event loop only waits on a pipe.

The server's template over a body of hundreds of thousands of messages is rendered by such a worker
too (`render_body`): transformers copies the conversation three times on its way to Jinja, and
freeing each copy is one call that holds the interpreter, and so the event loop, for tens of
milliseconds. The worker parses the body's bytes itself, so the router's process never makes them.

The worker speaks length-prefixed frames on its stdin and stdout: a job is a JSON header and a
payload (a body's bytes, or nothing), an answer a JSON header and the rendered text in UTF-8.
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

from dpd_router.prompt.chat_inputs import client_template, template_inputs
from dpd_router.request.errors import InvalidRequest

log = logging.getLogger("dpd_router.tokenizer")

_FRAME = struct.Struct(">I")
# What the worker may allocate beyond what it holds once its tokenizer is loaded.
WORKER_MEMORY_BYTES = 1 << 30
# What a worker rendering bodies may allocate for each byte of the largest body: the parsed messages
# and transformers' copies of them, dozens of bytes of objects for each byte of JSON.
BODY_MEMORY_PER_BYTE = 64
# Seconds a new worker may take to import transformers and load the tokenizer.
WORKER_START_TIMEOUT = 120.0


class RenderedTooLarge(Exception):
    """The rendered text is larger than the caller said it could use; it was not sent back."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes of UTF-8")
        self.size = size


class TemplateSandbox:
    """One worker process rendering templates, one at a time; stopped after `idle_timeout` seconds
    without a job, when one is given (the next job starts it again)."""

    def __init__(
        self,
        tokenizer_dir: Path,
        *,
        timeout: float,
        max_output_chars: int,
        memory_bytes: int = WORKER_MEMORY_BYTES,
        idle_timeout: float | None = None,
    ) -> None:
        self._tokenizer_dir = tokenizer_dir
        self._timeout = timeout
        self._max_output_chars = max_output_chars
        self._memory_bytes = memory_bytes
        self._idle_timeout = idle_timeout
        self._worker: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._last_job = 0.0
        self._idle_check: asyncio.TimerHandle | None = None
        self._idle_stop: asyncio.Task[None] | None = None

    async def render_body(self, raw: bytes, *, from_client: bool = False, max_bytes: int | None = None) -> str:
        """The prompt text of the chat body `raw` (its messages, tools and template arguments, as
        LocalTokenizer renders them): by the template it brought when `from_client` (output capped),
        else by the tokenizer's own. InvalidRequest when rendering fails, takes longer than the
        timeout, or uses more memory than the worker may; RenderedTooLarge, without the text, when it
        is more than `max_bytes` bytes of UTF-8."""
        header = orjson.dumps({"client_template": from_client, "max_bytes": max_bytes})
        if from_client:
            return await self._job(header, raw, what="The request's chat template", param="chat_template")
        return await self._job(header, raw, what="The request's messages", param="messages")

    async def _job(self, header: bytes, payload: bytes, *, what: str, param: str) -> str:
        async with self._lock:
            worker = await self._running_worker()
            try:
                async with asyncio.timeout(self._timeout):
                    answer, text = await _exchange(worker, header, payload)
            except TimeoutError:
                await self._stop()
                raise InvalidRequest(
                    f"{what} did not finish rendering within {self._timeout:g} s.", param=param
                ) from None
            except (ConnectionError, asyncio.IncompleteReadError):
                await self._stop()
                raise InvalidRequest(
                    f"{what} could not be rendered: it used more memory than allowed.", param=param
                ) from None
            except asyncio.CancelledError:
                await self._stop()  # the client left mid-render: do not let its render run on
                raise
            finally:
                self._arm_idle_stop()
        if "error" in answer:
            raise InvalidRequest(f"The chat template could not render these messages: {answer['error']}")
        if "size" in answer:
            raise RenderedTooLarge(answer["size"])
        return text

    def _arm_idle_stop(self) -> None:
        if self._idle_timeout is None:
            return
        loop = asyncio.get_running_loop()
        self._last_job = loop.time()
        if self._idle_check is None:
            self._idle_check = loop.call_later(self._idle_timeout, self._check_idle)

    def _check_idle(self) -> None:
        assert self._idle_timeout is not None
        loop = asyncio.get_running_loop()
        left = self._last_job + self._idle_timeout - loop.time()
        if left > 0:
            self._idle_check = loop.call_later(left, self._check_idle)
            return
        self._idle_check = None
        self._idle_stop = loop.create_task(self._stop_when_idle())

    async def _stop_when_idle(self) -> None:
        async with self._lock:
            if self._idle_check is None:  # no job came meanwhile
                await self._stop()

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
            "dpd_router.prompt.template_sandbox",
            str(self._tokenizer_dir),
            str(self._max_output_chars),
            str(self._memory_bytes),
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
        if self._idle_check is not None:
            self._idle_check.cancel()
            self._idle_check = None
        async with self._lock:
            await self._stop()


async def _exchange(worker: asyncio.subprocess.Process, header: bytes, payload: bytes) -> tuple[dict[str, Any], str]:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(_FRAME.pack(len(header)) + header + _FRAME.pack(len(payload)))
    worker.stdin.write(payload)
    await worker.stdin.drain()
    answer = orjson.loads(await _read_frame(worker.stdout))
    text = (await _read_frame(worker.stdout)).decode("utf-8", "surrogatepass")
    assert isinstance(answer, dict)
    return answer, text


async def _read_frame(stream: asyncio.StreamReader) -> bytes:
    (size,) = _FRAME.unpack(await stream.readexactly(_FRAME.size))
    return await stream.readexactly(size)


def _serve(tokenizer_dir: str, max_output_chars: int, memory_bytes: int) -> None:
    """The worker: load the tokenizer, cap the address space, then render jobs until stdin closes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    limit = mapped + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sink.write(_FRAME.pack(0))  # ready
    sink.flush()
    while True:
        header = source.read(_FRAME.size)
        if len(header) < _FRAME.size:
            return
        job = orjson.loads(source.read(_FRAME.unpack(header)[0]))
        payload = source.read(_FRAME.unpack(source.read(_FRAME.size))[0])
        answer, text = _render_job(tokenizer, payload, bool(job.get("client_template")), max_output_chars)
        del payload
        encoded = text.encode("utf-8", "surrogatepass")
        if job.get("max_bytes") is not None and len(encoded) > job["max_bytes"]:
            answer, encoded = {"size": len(encoded)}, b""  # the caller refuses it for its size alone
        frame = orjson.dumps(answer)
        sink.write(_FRAME.pack(len(frame)) + frame + _FRAME.pack(len(encoded)))
        sink.write(encoded)
        sink.flush()


def _render_job(tokenizer: Any, payload: bytes, client: bool, max_output_chars: int) -> tuple[dict[str, Any], str]:
    """The answer to one job and the text it rendered ("" with an error)."""
    try:
        body = orjson.loads(payload)
        conversation, tools, kwargs = template_inputs(body)
        template = client_template(body) if client else None
        text = str(
            tokenizer.apply_chat_template(conversation, chat_template=template, tools=tools, tokenize=False, **kwargs)
        )
    except MemoryError:
        return {"error": "it used more memory than allowed"}, ""
    except Exception as exc:  # jinja errors, raise_exception(), bad shapes: worded as in-process renders word them
        return {"error": (f"{type(exc).__name__}: {exc}" if client else str(exc))[:1000]}, ""
    if client and len(text) > max_output_chars:
        return {"error": f"it rendered more than {max_output_chars} characters"}, ""
    return {}, text


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
