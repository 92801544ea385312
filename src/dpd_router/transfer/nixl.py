"""vLLM's NixlConnector protocol: a max_tokens=1 prefill, then the decoder pulls the blocks.

See docs/connectors.md, "NIXL". The prefiller's `kv_transfer_params` are passed on verbatim:
rewriting `remote_host` breaks deployments whose side channel differs from the HTTP host.

The prefiller holds the staged blocks under a lease (30 s) until a decoder pulls them. When no
decode call will (the client left between the hops), the router hands the parameters to a decoder
in a call it refuses before admission: vLLM's serving layer then tells its connector
(`_with_kv_transfer_rejection_cleanup` -> `notify_kv_transfer_request_rejected`), whose
`request_finished` notifies the prefiller to free the blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import orjson

from dpd_router.pool.transport import EngineCalls
from dpd_router.request.client_request import ClientRequest
from dpd_router.request.errors import PrefillFailed
from dpd_router.startup.tasks import cancel_and_wait
from dpd_router.transfer.base import SequentialConnector, StagedKV, one_token_body, staged_from_prefill

log = logging.getLogger("dpd_router.transfer.nixl")

RELEASE_PATH = "/v1/completions"
# A model no engine serves: the decoder refuses the release call with 404 before its engine admits it.
RELEASE_MODEL = "dpd-router/release-kv"

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(request: ClientRequest, *, ids: bool = True) -> dict[str, Any]:
    """The client's body turned into a KV-staging call: one token, not streamed, remote decode asked for;
    `ids`: the prompt's ids asked for too."""
    body = one_token_body(request, ids=ids)
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return body


def decode_body(request: ClientRequest, params: dict[str, Any]) -> dict[str, Any]:
    """The client's original body plus the prefiller's transfer parameters."""
    return {**request.body, "kv_transfer_params": params}


def release_body(params: dict[str, Any]) -> dict[str, Any]:
    """A call that hands `params` to a decoder only to be refused: the refusal frees the prefiller's blocks."""
    return {"model": RELEASE_MODEL, "prompt": "release", "max_tokens": 1, "kv_transfer_params": params}


def staged_from_answer(payload: Any) -> StagedKV:
    """Read the prefiller's answer; raise PrefillFailed when it staged nothing."""
    if not isinstance(payload, dict):
        raise PrefillFailed("bad_answer", "the prefill answer is not a JSON object")
    params = payload.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        raise PrefillFailed("no_kv_params", "the prefill answer carries no kv_transfer_params")
    return staged_from_prefill(payload, params)


class NixlConnector(SequentialConnector):
    """Sequential prefill-then-decode over vLLM's NIXL KV transfer."""

    name = "nixl"
    holds_kv = True

    def __init__(self, engines: EngineCalls, *, timeout: httpx.Timeout, path_for: dict[str, str]):
        super().__init__(engines, timeout=timeout, path_for=path_for)
        self._releases: set[asyncio.Task[None]] = set()
        self.released = 0

    async def close(self) -> None:
        await cancel_and_wait(self._releases)

    def unsupported(self, request: ClientRequest) -> str | None:
        # vLLM prefills each of n children and answers with one child's parameters: the others'
        # blocks wait out their lease. A decoder given n > 1 has every child pull the same blocks,
        # which the prefiller frees after the first (it logs "Potentially invalid KV blocks").
        n = request.body.get("n")
        if n not in (None, 1):
            return "n > 1"
        return None

    def release_unused(self, staged: StagedKV, *, after: float = 0.0) -> None:
        """Hand `staged` to its decoder in a call refused before admission, in the background."""
        if staged.handoff is None or not staged.params:
            return
        task = asyncio.create_task(self._release(staged, after), name=f"nixl-release {staged.handoff.request_id}")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, staged: StagedKV, after: float) -> None:
        if after > 0:
            await asyncio.sleep(after)
        handoff = staged.handoff
        assert handoff is not None
        decoder = handoff.decoder
        headers = {"X-Request-Id": f"{handoff.request_id}-release", "Content-Type": "application/json"}
        try:
            response = await self._engines.whole(
                f"{decoder.url}{RELEASE_PATH}",
                orjson.dumps(release_body(staged.params)),
                headers,
                limits=self._timeout,
            )
        except httpx.HTTPError as exc:
            log.warning(
                "request %s: could not hand the unused KV to %s (%s: %s); the prefiller holds it until its lease ends",
                handoff.request_id,
                decoder.url,
                type(exc).__name__,
                exc,
            )
            return
        if response.status_code != 404:
            log.warning(
                "request %s: %s answered the KV release with %d, not the refusal that frees the blocks",
                handoff.request_id,
                decoder.url,
                response.status_code,
            )
            return
        self.released += 1

    def prefill_body(self, request: ClientRequest, *, ids: bool = True) -> dict[str, Any]:
        return prefill_body(request, ids=ids)

    def read_answer(self, payload: dict[str, Any]) -> StagedKV:
        return staged_from_answer(payload)

    def decode_body(self, request: ClientRequest, staged: StagedKV) -> bytes:
        return orjson.dumps(decode_body(request, staged.params))
