"""The LMCache PD connector: prefill, wait for the ProxyNotifs, then the decoder's continuation; KV no
decode call will retrieve is drained."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import httpx
import orjson

from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.transport import EngineCalls
from dpd_router.prompt.tokenizer import Prompt
from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import PrefillFailed
from dpd_router.transfer.base import (
    DecodeCall,
    Handoff,
    StagedKV,
    hop_limits,
    new_transfer_id,
    post_prefill,
    prefill_usage,
)
from dpd_router.transfer.lmcache.bodies import decode_body, drain_body, prefill_body, requested_max_tokens
from dpd_router.transfer.lmcache.compat import unsupported
from dpd_router.transfer.lmcache.notify import ProxyNotifications
from dpd_router.transfer.lmcache.receivers import ReceiverMap
from dpd_router.transfer.lmcache.rewrite import Continuation, FirstToken, answered_by_prefill

log = logging.getLogger("dpd_router.lmcache")

COMPLETIONS_PATH = "/v1/completions"
# How long after a hand-off is given up (its client left, its notification was late) the router still
# listens for its ProxyNotif, to drain KV that lands after all.
LATE_NOTIFICATION_WINDOW = 60.0


class LMCacheConnector:
    """Sequential prefill-then-decode over LMCache's PD push, with the first token sent early.

    Pushed KV that no decode call will retrieve is drained in the background (`release_unused`, and
    a hand-off given up after its prefill answered); `close()` cancels the drains still running.
    """

    name = "lmcache"
    concurrent = False
    batches = False
    serves_direct = True
    # The KV lands in the chosen decoder's buffer: it serves that decoder only.
    pushes_to_decoder = True
    holds_kv = True

    def __init__(
        self,
        engines: EngineCalls,
        *,
        timeout: httpx.Timeout,
        receivers: ReceiverMap,
        notifications: ProxyNotifications,
        notify_timeout: float,
        notify_count: int | None = None,
        local_tokenizer: bool = True,
        late_notification_window: float = LATE_NOTIFICATION_WINDOW,
    ) -> None:
        self._engines = engines
        self._timeout = timeout
        self._hop_limits = hop_limits(timeout)
        self._receivers = receivers
        self.notifications = notifications
        self._notify_timeout = notify_timeout
        self._notify_count = notify_count
        self._local_tokenizer = local_tokenizer
        self._late_window = late_notification_window
        self._drains: set[asyncio.Task[None]] = set()
        self.drained = 0

    async def start(self) -> None:
        await self.notifications.start()

    async def close(self) -> None:
        drains, self._drains = set(self._drains), set()
        for task in drains:
            task.cancel()
        if drains:
            await asyncio.wait(drains)
        await self.notifications.close()

    def unsupported(self, request: ClientRequest) -> str | None:
        return unsupported(request, local_tokenizer=self._local_tokenizer)

    def handoff(
        self, request: ClientRequest, prompt: Prompt, prefiller: Endpoint, decoder: Endpoint, request_id: str
    ) -> Handoff:
        receiver = self._receivers.for_decoder(decoder)
        req_id = f"{request_id}-{new_transfer_id()[:12]}"
        return Handoff(request, prompt, prefiller, decoder, request_id, transfer={"disagg_spec": receiver.spec(req_id)})

    def expected_notifications(self, handoff: Handoff) -> int:
        return self._notify_count or len(handoff.transfer["disagg_spec"]["receiver_init_port"]) or 1

    async def stage(self, handoff: Handoff) -> StagedKV:
        """The prefill call, then its ProxyNotifs. A hand-off given up once the prefiller answered
        (its client left, the notifications were late) may still land: it is drained if it does."""
        spec = handoff.transfer["disagg_spec"]
        req_id = spec["req_id"]
        self.notifications.expect(req_id, self.expected_notifications(handoff))
        first: FirstToken | None = None
        landed = False
        try:
            payload = await post_prefill(
                self._engines,
                handoff.prefiller,
                COMPLETIONS_PATH,
                prefill_body(handoff.request, handoff.prompt, spec),
                request_id=handoff.request_id,
                limits=self._hop_limits,
            )
            first = FirstToken.from_answer(payload)
            landed = await self.notifications.wait(req_id, self._notify_timeout)
        finally:
            if first is not None and not landed:
                self._drain_if_it_lands(handoff, first, req_id)  # it forgets the id when done
            else:
                self.notifications.forget(req_id)
        if not landed:
            raise PrefillFailed(
                "no_notification",
                f"{handoff.prefiller.url} answered, but the KV did not reach {spec['receiver_host']} "
                f"(no ProxyNotif for {req_id} within {self._notify_timeout:g} s)",
            )
        prompt_tokens, cached_tokens = prefill_usage(payload)
        return StagedKV(
            params={"first_tok": first.token_id},
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            answer=payload,
        )

    def decode_call(self, handoff: Handoff, staged: StagedKV) -> DecodeCall:
        first = FirstToken.from_answer(staged.answer or {})
        request = handoff.request
        answer = Continuation(request.kind, first)
        wanted = requested_max_tokens(request)
        if first.ends_the_answer or (wanted is not None and wanted <= 1):
            # No decoder call: the gateway releases the pushed KV when the request ends.
            prompt_tokens = staged.prompt_tokens if staged.prompt_tokens is not None else handoff.prompt.num_tokens
            answered = answered_by_prefill(request, prompt_tokens, first)
            return DecodeCall(COMPLETIONS_PATH, b"", answer, answered=answered)
        body = decode_body(request, handoff.prompt, first.token_id)
        return DecodeCall(COMPLETIONS_PATH, orjson.dumps(body), answer)

    def release_unused(self, staged: StagedKV, *, after: float = 0.0) -> None:
        """Drain the KV `staged` left in its decoder's buffer, in the background."""
        handoff = staged.handoff
        if handoff is None or staged.answer is None:
            return
        first = staged.params.get("first_tok")
        if isinstance(first, int):
            self._track(self._drain(handoff, first), handoff)

    def _drain_if_it_lands(self, handoff: Handoff, first: FirstToken, req_id: str) -> None:
        self._track(self._drain_once_landed(handoff, first.token_id, req_id), handoff)

    def _track(self, work: Coroutine[Any, Any, None], handoff: Handoff) -> None:
        task = asyncio.create_task(work, name=f"lmcache-drain {handoff.request_id}")
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain_once_landed(self, handoff: Handoff, first_token: int, req_id: str) -> None:
        try:
            landed = await self.notifications.wait(req_id, self._late_window)
        finally:
            self.notifications.forget(req_id)
        if landed:
            log.info("the KV of %s reached %s after its hand-off was given up", req_id, handoff.decoder.url)
            await self._drain(handoff, first_token)

    async def _drain(self, handoff: Handoff, first_token: int) -> None:
        """Ask the decoder for one token of the continuation: LMCache frees pushed KV only when a
        decode call retrieves it. The answer is dropped; a failure is logged."""
        decoder = handoff.decoder
        body = orjson.dumps(drain_body(handoff.request, handoff.prompt, first_token))
        headers = {"X-Request-Id": f"{handoff.request_id}-drain", "Content-Type": "application/json"}
        try:
            response = await self._engines.whole(
                f"{decoder.url}{COMPLETIONS_PATH}", body, headers, limits=self._timeout
            )
        except httpx.HTTPError as exc:
            log.warning(
                "request %s: could not drain the KV pushed to %s (%s: %s); it stays in that decoder's LMCache buffer",
                handoff.request_id,
                decoder.url,
                type(exc).__name__,
                exc,
            )
            return
        if response.status_code != 200:
            log.warning(
                "request %s: draining the KV pushed to %s got status %d: %s",
                handoff.request_id,
                decoder.url,
                response.status_code,
                response.text[:300],
            )
            return
        self.drained += 1
        log.debug("request %s: drained the KV pushed to %s", handoff.request_id, decoder.url)
