"""vLLM's ExampleConnector (shared storage): the prefiller writes the KV to a shared directory.

See PROTOCOLS.md section 6. The prefill hop is the client's request cut to one token and not
streamed; a 200 answer means the prefiller computed the prompt and saved its KV. The decoder then
receives the client's request unchanged and finds the KV on disk by the prompt's hash: no
`kv_transfer_params` travel in either direction.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from dpd_router.errors import PrefillFailed
from dpd_router.pool.endpoint import Endpoint
from dpd_router.request import ClientRequest
from dpd_router.transfer.base import StagedKV

_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params")


def prefill_body(request: ClientRequest) -> dict[str, Any]:
    """The client's body turned into a KV-saving call: one token, not streamed."""
    body = {key: value for key, value in request.body.items() if key not in _DROPPED_FOR_PREFILL}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    return body


def staged_from_answer(payload: Any) -> StagedKV:
    """Read the prefiller's answer: the KV is on disk; keep its token counts for usage."""
    if not isinstance(payload, dict):
        raise PrefillFailed("bad_answer", "the prefill answer is not a JSON object")
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    prompt_tokens = usage.get("prompt_tokens")
    return StagedKV(
        params={},
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


class SharedStorageConnector:
    """Sequential prefill-then-decode through a directory both engines mount."""

    name = "shared_storage"

    def __init__(self, client: httpx.AsyncClient, *, timeout: httpx.Timeout, path_for: dict[str, str]):
        self._client = client
        self._timeout = timeout
        self._path_for = path_for

    async def prefill(self, request: ClientRequest, prefiller: Endpoint, request_id: str) -> StagedKV:
        url = f"{prefiller.url}{self._path_for[request.kind]}"
        try:
            response = await self._client.post(
                url,
                content=orjson.dumps(prefill_body(request)),
                headers={"X-Request-Id": request_id, "Content-Type": "application/json"},
                timeout=self._timeout,
            )
        except httpx.TimeoutException as exc:
            raise PrefillFailed("timeout", f"{prefiller.url}: {type(exc).__name__}") from None
        except httpx.HTTPError as exc:
            raise PrefillFailed("connect_error", f"{prefiller.url}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            reason = "status_5xx" if response.status_code >= 500 else "status_4xx"
            raise PrefillFailed(reason, f"{prefiller.url} answered {response.status_code}: {response.text[:300]}")
        try:
            payload = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            raise PrefillFailed("bad_answer", f"{prefiller.url} answered with invalid JSON") from None
        return staged_from_answer(payload)

    def decode_body(self, request: ClientRequest, staged: StagedKV) -> bytes:
        """The client's request as it came: the decoder looks the KV up by the prompt itself."""
        return request.encoded()
