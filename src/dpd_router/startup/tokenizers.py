"""The token counter of each pool of engines."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import httpx

from dpd_router.config import Settings
from dpd_router.pool.pool import Pool
from dpd_router.pool.served_model import ServedModel
from dpd_router.prompt.template_sandbox import BODY_MEMORY_PER_BYTE, WORKER_MEMORY_BYTES, TemplateSandbox
from dpd_router.prompt.tokenizer import EngineTokenizer, LocalTokenizer, TokenCounter
from dpd_router.record.metrics import RouterMetrics

log = logging.getLogger("dpd_router.app")

# A render of the server's template is bounded by the body's size, not by a client's program: this only
# stops a worker that no longer answers.
BODY_RENDER_TIMEOUT = 120.0
# Seconds without a body of very many messages after which their worker stops.
BODY_RENDERER_IDLE = 60.0


async def load_tokenizers(
    settings: Settings,
    client: httpx.AsyncClient,
    pools: Mapping[str | None, Pool],
    model: ServedModel,
    metrics: RouterMetrics,
) -> dict[str | None, TokenCounter]:
    """The token counter of each pool: the local tokenizer for all, or each pool's own decoders'
    /tokenize, so no prompt of a tenant's reaches an engine not reserved for it."""
    if settings.tokenizer is None:
        log.warning("no tokenizer directory configured: counting tokens with the engines' /tokenize")
        timeout = settings.tokenize_timeout
        return {tenant: engine_tokenizer(client, pool, model, timeout=timeout) for tenant, pool in pools.items()}
    sandbox = (
        TemplateSandbox(
            settings.tokenizer, timeout=settings.chat_template_timeout, max_output_chars=settings.max_body_bytes
        )
        if settings.trust_request_chat_template
        else None
    )
    if sandbox is not None:
        await sandbox.start()
    # Started on the first body of very many messages and stopped when none came for a while: most
    # routers never see one, and the worker holds a tokenizer and transformers.
    body_renderer = TemplateSandbox(
        settings.tokenizer,
        timeout=BODY_RENDER_TIMEOUT,
        max_output_chars=settings.max_body_bytes,
        memory_bytes=max(WORKER_MEMORY_BYTES, BODY_MEMORY_PER_BYTE * settings.max_body_bytes),
        idle_timeout=BODY_RENDERER_IDLE,
    )
    local = await asyncio.to_thread(
        LocalTokenizer.load,
        settings.tokenizer,
        inline_max_chars=settings.tokenize_inline_max_chars,
        threads=settings.tokenizer_threads,
        sandbox=sandbox,
        body_renderer=body_renderer,
        background_max_chars=settings.tokenize_background_max_chars,
        on_background_skip=metrics.background_encodes_skipped.inc,
        count_whole=settings.count_whole_prompts,
        piece_cache_chars=settings.tokenize_piece_cache_chars,
    )
    log.info("tokenizer %s: %s", settings.tokenizer, local.reading())
    return {tenant: local for tenant in pools}


def engine_tokenizer(
    client: httpx.AsyncClient, pool: Pool, model: ServedModel, *, timeout: float = 10.0
) -> EngineTokenizer:
    return EngineTokenizer(
        client, urls=lambda: [e.url for e in pool.healthy("decode")], model=lambda: model.name, timeout=timeout
    )
