"""NIXL as the simulator plays it: the prefiller's `kv_transfer_params`, its side channel, the decoder's pull.

The side channel is the prefiller's own HTTP server (`POST /sim/nixl/transfer`), so a decoder
proves the KV moved with a real call over a real socket, and fails the way vLLM's decoder does
when the blocks are gone, expired, or belong to another prompt.

A decoder that refuses a request carrying remote-prefill parameters before admitting it tells the
prefiller to free the blocks (`POST /sim/nixl/notify`), as vLLM's serving layer has its NIXL
connector send the prefiller a completion notification without reading
(`_with_kv_transfer_rejection_cleanup`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from dpd_sim.gpu import TimingModel
from dpd_sim.kv import KvLease, LeaseError, LeaseTable

TRANSFER_PATH = "/sim/nixl/transfer"
NOTIFY_PATH = "/sim/nixl/notify"


class KvTransferFailed(Exception):
    """The decoder could not load the remote KV; the request fails in-band."""

    def __init__(self, reason: str, *, expired: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.expired = expired


def prefill_answer_params(lease: KvLease, *, engine_id: str, host: str, port: int) -> dict[str, Any]:
    """The top-level `kv_transfer_params` a prefiller returns, shaped like vLLM's NixlConnector."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(lease.block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": lease.remote_request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": lease.num_tokens,
    }


def flatten_block_ids(value: object) -> tuple[int, ...]:
    """Accept `[[ids...]]` (one list per KV group) and the older flat `[ids...]`."""
    if not isinstance(value, list):
        raise ValueError("remote_block_ids must be a list")
    if all(isinstance(item, list) for item in value):
        flat = [block for group in value for block in group]
    else:
        flat = list(value)
    if not all(isinstance(block, int) and not isinstance(block, bool) for block in flat):
        raise ValueError("remote_block_ids must hold integers")
    return tuple(flat)


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decoder finds the KV a prefiller staged, read from the request's `kv_transfer_params`."""

    engine_id: str
    request_id: str
    block_ids: list[Any]
    host: str
    port: int

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemotePrefill:
        engine_id = params.get("remote_engine_id")
        request_id = params.get("remote_request_id")
        block_ids = params.get("remote_block_ids")
        host = params.get("remote_host")
        port = params.get("remote_port")
        if not isinstance(engine_id, str) or not isinstance(request_id, str):
            raise KvTransferFailed("kv_transfer_params lack remote_engine_id or remote_request_id")
        if not isinstance(block_ids, list):
            raise KvTransferFailed("kv_transfer_params lack remote_block_ids")
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            raise KvTransferFailed("kv_transfer_params lack remote_host or remote_port")
        return cls(engine_id, request_id, block_ids, host, port)

    @property
    def url(self) -> str:
        return self._url(TRANSFER_PATH)

    @property
    def notify_url(self) -> str:
        return self._url(NOTIFY_PATH)

    def _url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"


class NixlSideChannel:
    """The prefiller's end: hands leased blocks to the decoder that proves it prefilled the same prompt."""

    def __init__(self, engine_id: str, leases: LeaseTable, timing: TimingModel) -> None:
        self.engine_id = engine_id
        self.leases = leases
        self.timing = timing

    async def transfer(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Serve one transfer; answer (status, body). The copy takes kv_transfer_per_token per token."""
        engine_id = body.get("remote_engine_id")
        request_id = body.get("remote_request_id")
        digest = body.get("prompt_digest")
        if not isinstance(request_id, str) or not isinstance(digest, str):
            return 400, {"error": "remote_request_id and prompt_digest are required"}
        try:
            block_ids = flatten_block_ids(body.get("remote_block_ids"))
        except ValueError as exc:
            return 400, {"error": str(exc)}
        if engine_id != self.engine_id:
            return 404, {"error": f"engine {engine_id} is not this engine ({self.engine_id})"}
        try:
            lease = self.leases.claim(request_id, block_ids, digest)
        except LeaseError as exc:
            return exc.status_code, {"error": exc.reason}
        await asyncio.sleep(self.timing.kv_transfer_seconds(lease.num_tokens))
        return 200, {"num_tokens": lease.num_tokens}

    def notified(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """A decoder is done with a lease it never read: free the blocks now; answer (status, body)."""
        request_id = body.get("remote_request_id")
        if not isinstance(request_id, str):
            return 400, {"error": "remote_request_id is required"}
        if body.get("remote_engine_id") != self.engine_id:
            return 404, {"error": f"engine {body.get('remote_engine_id')} is not this engine ({self.engine_id})"}
        if not self.leases.release(request_id):
            return 404, {"error": f"no lease {request_id}"}  # vLLM logs it ("unrecognized request")
        return 200, {}


class KvPuller:
    """The decoder's end: reads the staged KV from the prefiller named in the params."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def pull(self, remote: RemotePrefill, digest: str) -> int:
        """Load the remote blocks; return how many prompt tokens arrived."""
        payload = {
            "remote_engine_id": remote.engine_id,
            "remote_request_id": remote.request_id,
            "remote_block_ids": remote.block_ids,
            "prompt_digest": digest,
        }
        try:
            response = await self.client.post(remote.url, json=payload)
        except httpx.HTTPError as exc:
            raise KvTransferFailed(f"prefiller {remote.host}:{remote.port} unreachable: {exc!r}") from exc
        if response.status_code != 200:
            reason = _reason(response)
            raise KvTransferFailed(reason, expired=response.status_code == 410)
        num_tokens = _json_or_empty(response).get("num_tokens")
        if not isinstance(num_tokens, int):
            raise KvTransferFailed("prefiller answered without num_tokens")
        return num_tokens

    async def give_up(self, params: Mapping[str, Any]) -> None:
        """A request refused before admission named remote blocks: have their prefiller free them
        (best effort, as vLLM's decoder only logs a notification that fails)."""
        if not params.get("do_remote_prefill"):
            return
        try:
            remote = RemotePrefill.from_params(params)
        except KvTransferFailed:
            return
        payload = {"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id}
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(remote.notify_url, json=payload)


def _reason(response: httpx.Response) -> str:
    error = _json_or_empty(response).get("error")
    return f"transfer refused ({response.status_code}): {error or response.text[:200]}"


def _json_or_empty(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
