"""`POST /v1/completions` and `POST /v1/chat/completions`: streaming and whole answers, faults, disconnects."""

from __future__ import annotations

import asyncio
import time
import uuid

from dpd_sim.asgi import (
    SSE_HEADERS,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    run_until_disconnect,
    send_body,
    send_json,
    send_start,
)
from dpd_sim.completion_request import Api, GenerationRequest, InvalidRequest, ModelNotFound, load_object
from dpd_sim.core import EngineCore, Protocol
from dpd_sim.faults import FaultMode
from dpd_sim.generation import Generation
from dpd_sim.openai_format import DONE, ResponseFormat, error_body
from dpd_sim.stats import RequestKind

_LARGE_BODY = 64 * 1024
"""Bodies at least this big are tokenized off the event loop."""


class CompletionsEndpoint:
    """An ASGI app for one completion API; a client that disconnects cancels its request at once."""

    def __init__(self, core: EngineCore, api: Api) -> None:
        self.core = core
        self.api = api
        self.id_prefix = "chatcmpl-" if api == "chat" else "cmpl-"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        if raw is None:
            return
        core = self.core
        request_id = header(scope, b"x-request-id") or uuid.uuid4().hex
        try:
            request = await self._parse(raw)
            kind = core.classify(request)
        except InvalidRequest as exc:
            if isinstance(exc, ModelNotFound):
                await _give_up_remote_kv(core, raw)
            body = error_body(exc.message, exc.error_type, exc.status_code, exc.param)
            await send_json(send, exc.status_code, body)
            return
        refusal = core.refuses(request)
        if refusal is not None:
            core.stats.open(request_id, kind, request.prompt_tokens).status = "error"
            await send_json(send, 500, error_body(refusal, "InternalServerError", 500))
            return
        fault = core.faults.take(*_faults_for(kind, core.protocol(request), core.holds_pushed_kv(request)))
        if fault == "dead":
            await send_json(send, 503, error_body("the engine is dead", "ServiceUnavailableError", 503))
            return
        if fault == "error_500":
            core.stats.open(request_id, kind, request.prompt_tokens).status = "error"
            await send_json(send, 500, error_body("simulated engine error", "InternalServerError", 500))
            return
        generation = Generation(
            core,
            request,
            kind,
            request_id,
            reject_kv=fault == "reject_kv",
            withhold_kv_params=fault == "no_kv_params",
            ignore_kv=fault == "ignore_kv",
            withhold_first_token=fault == "no_first_tok",
            withhold_notification=fault == "no_notification",
            withhold_bootstrap=fault == "no_bootstrap",
        )
        response = ResponseFormat(
            self.api,
            response_id=self.id_prefix + request_id,
            model=request.adapter or core.config.model,
            created=int(time.time()),
        )
        if fault == "hang":
            work = _hang(generation)
        elif request.stream:
            work = _stream(generation, response, send)
        else:
            work = _answer(generation, response, send)
        await run_until_disconnect(work, receive)

    async def _parse(self, raw: bytes) -> GenerationRequest:
        if len(raw) >= _LARGE_BODY:
            return await asyncio.to_thread(self.core.parser.parse, self.api, raw)
        return self.core.parser.parse(self.api, raw)


async def _give_up_remote_kv(core: EngineCore, raw: bytes) -> None:
    """vLLM's serving layer frees the remote blocks of a request it refuses past validation (the model
    check among them; a malformed body never gets that far, and neither does the simulator here)."""
    params = load_object(raw).get("kv_transfer_params")
    if isinstance(params, dict):
        await core.kv_puller.give_up(params)


def _faults_for(kind: RequestKind, protocol: Protocol, pushed_kv: bool) -> tuple[FaultMode, ...]:
    if kind == "kv_decode" or pushed_kv:  # an LMCache decode finds its KV pushed here
        return ("dead", "error_500", "hang", "reject_kv", "ignore_kv")
    if kind == "remote_prefill" and protocol == "lmcache":
        return ("dead", "error_500", "hang", "no_kv_params", "no_first_tok", "no_notification")
    if kind == "remote_prefill" and protocol == "sglang":
        return ("dead", "error_500", "hang", "no_bootstrap")
    if kind == "remote_prefill":
        return ("dead", "error_500", "hang", "no_kv_params")
    return ("dead", "error_500", "hang")


async def _hang(generation: Generation) -> None:
    """Accept the request and never answer; the client's disconnect ends it."""
    with generation:
        await asyncio.Event().wait()


async def _stream(generation: Generation, response: ResponseFormat, send: Send) -> None:
    """SSE: a chunk per token (several per write when they pile up), then usage if asked, then [DONE]."""
    request = generation.request
    chat = response.api == "chat"
    token_json = generation.core.sampler.token_json
    token_text = generation.core.sampler.token_text

    def running_usage(chunk: bytes, completion_tokens: int) -> bytes:
        if not request.continuous_usage:
            return chunk
        return response.with_running_usage(chunk, len(request.prompts[0]), completion_tokens)

    with generation:
        await send_start(send, 200, SSE_HEADERS)
        parts: list[bytes] = []
        if not await generation.load_kv():
            if chat:
                parts.extend(response.role_chunk(choice) for choice in range(generation.choices))
            parts.extend(response.final_chunk(choice, "", "error") for choice in range(generation.choices))
        else:
            generation.schedule()
            opened = False
            produced = [0] * generation.choices
            # vLLM's return_token_ids: each chunk carries its token's id, the first the prompt's ids.
            with_ids = request.return_token_ids
            while tokens := await generation.next_tokens():
                if chat and not opened:
                    for choice in range(generation.choices):
                        prompt_ids = generation.prompts[0] if with_ids and choice == 0 else None
                        parts.append(running_usage(response.role_chunk(choice, prompt_ids), 0))
                for choice, token_id, last in tokens:
                    produced[choice] += 1
                    prompt_ids = generation.prompts[choice] if with_ids and not chat and produced[choice] == 1 else None
                    if last:
                        stop = generation.stopped_by(choice)
                        text = "" if stop is not None else token_text[token_id]  # a stop token is not output
                        finish = generation.finish_reason(choice)
                        ids = [token_id] if with_ids else None
                        chunk = response.final_chunk(
                            choice, text, finish, generation.kv_transfer_params, stop, ids, prompt_ids
                        )
                    else:
                        chunk = response.token_chunk(
                            choice, token_json[token_id], token_id if with_ids else None, prompt_ids
                        )
                    parts.append(running_usage(chunk, produced[choice]))
                opened = True
                await send_body(send, b"".join(parts), more=True)
                parts.clear()
            if not await generation.settle():
                parts.append(b"data: " + error_body(generation.settle_error, "InternalServerError", 500) + b"\n\n")
        if request.include_usage:
            parts.append(response.usage_chunk(generation.usage))
        parts.append(DONE)
        await send_body(send, b"".join(parts), more=False)


async def _answer(generation: Generation, response: ResponseFormat, send: Send) -> None:
    """One JSON body once every choice has finished."""
    sampler = generation.core.sampler
    with generation:
        if not await generation.load_kv():
            body = response.body([""] * generation.choices, "error", generation.usage, None)
            await send_json(send, 200, body)
            return
        generation.schedule()
        outputs: list[list[int]] = [[] for _ in range(generation.choices)]
        while tokens := await generation.next_tokens():
            for choice, token_id, last in tokens:
                if not (last and generation.stopped_by(choice) is not None):  # a stop token is not output
                    outputs[choice].append(token_id)
        if not await generation.settle():
            await send_json(send, 500, error_body(generation.settle_error, "InternalServerError", 500))
            return
        texts = [sampler.text(token_ids) for token_ids in outputs]
        choices = range(generation.choices)
        body = response.body(
            texts,
            [generation.finish_reason(choice) for choice in choices],
            generation.usage,
            generation.kv_transfer_params,
            [generation.stopped_by(choice) for choice in choices],
            (generation.prompts, outputs) if generation.request.return_token_ids else None,
        )
        await send_json(send, 200, body)
