"""The Responses API's history, kept by the router: stored responses, and conversations continued from them.

The engines never store (each is sent `store: false`, responses.api): a response an engine kept would be
known to that one process only, and the router spreads a conversation's turns over many. So the router
keeps them (responses.store), and a request naming `previous_response_id` is expanded before it is
counted or routed: the input of every response before it and their output, then its own input, sent to
both hops as one explicit conversation. The engine renders what a client sending that history itself
would have sent, token for token.

A request's `Turn` (responses.api) is what the router remembers of it while it is served: who asked (a
stored response is its API key's alone), whether to keep it, what it continued and its own input. The
relay shows it the answer's response objects as they pass (wires.KeptResponsesWire), which are told the
router's own id and the client's `store` and `previous_response_id`; the whole response is kept before the
client is sent its end (relay.EventStream, api/openai.py for a whole answer), so a follow-up sent the
moment it arrives finds it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson

from dpd_router.prompt.tokenizer import LARGE_REQUEST_BYTES
from dpd_router.record.metrics import RouterMetrics
from dpd_router.request.client_request import ClientRequest, count_brackets
from dpd_router.request.errors import InvalidRequest, ResponseNotFound, StoreUnavailable
from dpd_router.responses import api as responses_api
from dpd_router.responses.store import ResponseStore, StoredResponse

log = logging.getLogger("dpd_router.responses")

T = TypeVar("T")


def default_store_path() -> Path:
    """Where the default SQLite store lives: the user's state directory (XDG), kept across restarts."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "dpd-router" / "responses.sqlite3"


class ResponsesHistory:
    """The stored responses of one router process, over its store (None: `responses_store: off`)."""

    def __init__(self, store: ResponseStore | None, metrics: RouterMetrics) -> None:
        self._store = store
        self._metrics = metrics

    async def begin(self, request: ClientRequest, owner: str) -> None:
        """Give a Responses request its turn: its history expanded into its input (ResponseNotFound when
        `previous_response_id` names nothing this owner has kept), and the answer to keep if it asks."""
        body = request.body
        keeping = request.store_asked and self._store is not None
        previous = body.get("previous_response_id")
        own_input = _items(body["input"])
        if previous is not None:
            chain = await self._read(self._chain(previous, owner))
            if chain is None:
                raise ResponseNotFound(previous)
            del body["previous_response_id"]  # the engines are sent the whole history instead
            if sum(len(record.input) + len(record.response) for record in chain) > LARGE_REQUEST_BYTES:
                # Parsed and converted on a thread, as a client's body that large is (client_request).
                await asyncio.to_thread(_expand, request, chain, own_input)
            else:
                _expand(request, chain, own_input)
        if previous is not None or keeping:
            request.turn = responses_api.Turn(self, owner, keeping, previous, own_input)

    async def keep(self, turn: responses_api.Turn, response: dict[str, Any]) -> None:
        """Keep `response` under the turn's id; a store that fails is counted and logged, never the client's
        failure (the client has its answer; a follow-up naming it gets 404)."""
        assert self._store is not None
        record = StoredResponse(
            id=turn.id,
            owner=turn.owner,
            previous=turn.previous,
            # When kept, by this router's clock: both stores drop the oldest first by it.
            created=time.time(),
            input=orjson.dumps(turn.own_input),
            response=orjson.dumps(response),
        )
        try:
            kept = await self._store.put(record)
        except Exception as exc:  # the answer is the client's either way: a store down costs the history
            self._metrics.responses_store_errors.inc()
            log.warning("response %s not stored: %s: %s", turn.id, type(exc).__name__, exc)
            return
        if not kept:
            self._metrics.responses_store_errors.inc()
            log.warning("response %s not stored: larger than responses_store_max_mb on its own", turn.id)

    async def retrieve(self, response_id: str, owner: str) -> dict[str, Any]:
        """The stored response object; ResponseNotFound when this owner has none of that id."""
        record = await self._read(self._get(response_id, owner))
        if record is None:
            raise ResponseNotFound(response_id)
        response: dict[str, Any] = orjson.loads(record.response)
        return response

    async def delete(self, response_id: str, owner: str) -> dict[str, Any]:
        if not await self._read(self._delete(response_id, owner)):
            raise ResponseNotFound(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(
        self, response_id: str, owner: str, *, limit: int, order: str, after: str | None
    ) -> dict[str, Any]:
        """The items the response was generated from (every earlier turn's input and output, then its
        own input), each with an id, as the API lists them: `order` asc or desc, `limit` from `after`."""
        chain = await self._read(self._chain(response_id, owner))
        if chain is None:
            raise ResponseNotFound(response_id)
        items = list(_listed(chain))
        if order == "desc":
            items.reverse()
        if after is not None:
            at = next((index for index, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise InvalidRequest(f"No item with id '{after[:200]}' in this response's input.", param="after")
            items = items[at + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    async def aclose(self) -> None:
        if self._store is not None:
            await self._store.aclose()

    async def _chain(self, response_id: str, owner: str) -> list[StoredResponse] | None:
        return None if self._store is None else await self._store.chain(response_id, owner)

    async def _get(self, response_id: str, owner: str) -> StoredResponse | None:
        return None if self._store is None else await self._store.get(response_id, owner)

    async def _delete(self, response_id: str, owner: str) -> bool:
        return self._store is not None and await self._store.delete(response_id, owner)

    async def _read(self, asking: Awaitable[T]) -> T:
        """What the store answers; StoreUnavailable (503) when it fails: a history not read is never taken
        for one that does not exist."""
        try:
            return await asking
        except Exception as exc:
            self._metrics.responses_store_errors.inc()
            log.warning("responses store failed: %s: %s", type(exc).__name__, exc)
            raise StoreUnavailable("The stored responses cannot be read right now; retry shortly.") from None


def _expand(request: ClientRequest, chain: list[StoredResponse], own_input: list[Any]) -> None:
    """The request as the engines get it: its history before its own input. Its `raw` becomes those bytes,
    so what is sized by the body (rendering and encoding on a thread, in another process) sizes the
    whole conversation, not the few bytes the client sent."""
    body = request.body
    body["input"] = [*_context(chain), *own_input]
    request.converted = responses_api.template_body(body)
    request.raw = orjson.dumps(body)
    request.brackets = count_brackets(request.raw)
    request.body_changed = True


def _items(given: str | list[Any]) -> list[Any]:
    """A request's input as a list of items (a string input is one user message)."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given)


def _output(record: StoredResponse) -> list[Any]:
    output = orjson.loads(record.response).get("output")
    return output if isinstance(output, list) else []


def _context(chain: list[StoredResponse]) -> Iterator[Any]:
    """Every item of a chain (newest first) in conversation order: each turn's input, then its output."""
    for record in reversed(chain):
        yield from orjson.loads(record.input)
        yield from _output(record)


def _listed(chain: list[StoredResponse]) -> Iterator[dict[str, Any]]:
    """The input items of the chain's newest response, oldest first, each with an id (the item's own, or
    one made of its response's id and place, the same on every listing)."""
    newest = chain[0]
    for record in reversed(chain):
        own = orjson.loads(record.input)
        given = own if record is newest else [*own, *_output(record)]
        for index, item in enumerate(given):
            if not isinstance(item, dict):
                continue
            listed = item if isinstance(item.get("id"), str) else {"id": f"{record.id}_item_{index}", **item}
            listed.setdefault("type", "message")
            yield listed
