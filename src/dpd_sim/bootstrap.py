"""SGLang's bootstrap rendezvous as the simulator plays it: prefiller and decoder meet in a room.

A prefill engine started with `--bootstrap-port P` serves its bootstrap rooms on a TCP socket of
its own. Both engines get the same request with `bootstrap_host`, `bootstrap_port` and
`bootstrap_room` (one room per prompt). The decoder connects to the prefiller's bootstrap port and
asks for its room with a digest of its prompt (one JSON line); the prefiller answers (one JSON
line) once it has computed that prompt, after the KV copy's time, or with an error: another
prompt, or no prefill for the room within the wait. The prefiller's own answer waits until the
decoder has taken the KV. Either side may come first; both waits are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from dpd_sim.gpu import TimingModel

log = logging.getLogger(__name__)

_MAX_LINE = 64 * 1024


class BootstrapError(Exception):
    """The decoder could not get the room's KV."""


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """Where one prompt's KV is handed over: the prefiller's bootstrap server and the room."""

    host: str
    port: int
    room: int


def bootstraps_from_body(body: Mapping[str, Any], prompts: int) -> list[Bootstrap] | None:
    """The request's bootstrap fields, one entry per prompt; None when it has none.

    A scalar room with several prompts counts up from it, as SGLang does; lists give one value each.
    """
    fields = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    values = [body.get(name) for name in fields]
    if all(value is None for value in values):
        return None
    if any(value is None for value in values):
        raise ValueError("bootstrap_host, bootstrap_port and bootstrap_room go together")
    hosts, ports, rooms = (_spread(name, value, prompts) for name, value in zip(fields, values, strict=True))
    if isinstance(body.get("bootstrap_room"), int):
        rooms = [rooms[0] + index for index in range(prompts)]
    entries = []
    for host, port, room in zip(hosts, ports, rooms, strict=True):
        if not isinstance(host, str) or not host:
            raise ValueError("bootstrap_host must be a host name")
        if not _is_int(port) or not 0 < port < 65536:
            raise ValueError("bootstrap_port must be a port number")
        if not _is_int(room) or not 0 <= room < 2**63:
            raise ValueError("bootstrap_room must be an integer in [0, 2**63)")
        entries.append(Bootstrap(host, port, room))
    return entries


def _spread(name: str, value: Any, prompts: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != prompts:
            raise ValueError(f"{name} has {len(value)} entries for {prompts} prompts")
        return value
    return [value] * prompts


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Room:
    __slots__ = ("claimed", "computed", "digest", "tokens")

    def __init__(self) -> None:
        self.digest: str | None = None
        self.tokens = 0
        self.computed = asyncio.Event()
        self.claimed = asyncio.Event()


class BootstrapRooms:
    """The prefiller's rooms: computed prompts waiting for their decoder, decoders waiting for their prompt."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._rooms: OrderedDict[int, _Room] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rooms)

    def _room(self, room: int) -> _Room:
        entry = self._rooms.get(room)
        if entry is None:
            entry = self._rooms[room] = _Room()
            while len(self._rooms) > self.capacity:
                _, dropped = self._rooms.popitem(last=False)
                dropped.computed.set()  # wake a waiter: it finds no digest and fails
        return entry

    def computed(self, room: int, digest: str, tokens: int) -> None:
        """The prefiller computed the room's prompt: its KV is ready for the decoder."""
        entry = self._room(room)
        entry.digest, entry.tokens = digest, tokens
        entry.computed.set()

    async def handed_over(self, rooms: Sequence[int], within: float) -> bool:
        """Wait until the decoder took every room's KV (False after `within` seconds)."""
        try:
            async with asyncio.timeout(within):
                for room in rooms:
                    await self._room(room).claimed.wait()
        except TimeoutError:
            return False
        finally:
            for room in rooms:
                self._rooms.pop(room, None)
        return True

    def discard(self, rooms: Sequence[int]) -> None:
        for room in rooms:
            entry = self._rooms.pop(room, None)
            if entry is not None:
                entry.computed.set()

    async def claim(self, room: int, digest: str, within: float) -> int:
        """The decoder's request for a room: its prompt tokens once computed; BootstrapError otherwise."""
        entry = self._room(room)
        try:
            async with asyncio.timeout(within):
                await entry.computed.wait()
        except TimeoutError:
            self._rooms.pop(room, None)
            raise BootstrapError(f"no prefill for bootstrap room {room} within {within:g} s") from None
        if entry.digest is None:
            raise BootstrapError(f"bootstrap room {room} was given up by the prefiller")
        if entry.digest != digest:
            raise BootstrapError(f"bootstrap room {room} holds another prompt")
        entry.claimed.set()
        return entry.tokens


class BootstrapServer:
    """The prefiller's bootstrap socket: one JSON line in (`room`, `digest`), one JSON line out."""

    def __init__(self, host: str, port: int, rooms: BootstrapRooms, timing: TimingModel, wait: float) -> None:
        self.host = host
        self.port = port
        self.rooms = rooms
        self.timing = timing
        self.wait = wait
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=_MAX_LINE)
        log.info("SGLang bootstrap server on %s:%d", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            try:
                ask = orjson.loads(line)
                room, digest = ask["room"], ask["digest"]
                if not _is_int(room) or not isinstance(digest, str):
                    raise ValueError("room and digest are required")
            except (ValueError, KeyError, TypeError) as exc:
                answer: dict[str, Any] = {"error": f"bad bootstrap request: {exc}"}
            else:
                try:
                    tokens = await self.rooms.claim(room, digest, self.wait)
                    await asyncio.sleep(self.timing.kv_transfer_seconds(tokens))
                    answer = {"num_tokens": tokens}
                except BootstrapError as exc:
                    answer = {"error": str(exc)}
            writer.write(orjson.dumps(answer) + b"\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def fetch_kv(bootstrap: Bootstrap, digest: str, within: float) -> int:
    """The decoder's side: the room's prompt tokens from the prefiller's bootstrap server."""
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection(bootstrap.host, bootstrap.port, limit=_MAX_LINE)
            try:
                writer.write(orjson.dumps({"room": bootstrap.room, "digest": digest}) + b"\n")
                await writer.drain()
                line = await reader.readline()
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
    except TimeoutError:
        raise BootstrapError(
            f"bootstrap server {bootstrap.host}:{bootstrap.port} gave no KV within {within:g} s"
        ) from None
    except OSError as exc:
        raise BootstrapError(f"bootstrap server {bootstrap.host}:{bootstrap.port} unreachable: {exc!r}") from None
    try:
        answer = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise BootstrapError(f"bootstrap server {bootstrap.host}:{bootstrap.port} closed without an answer") from None
    if not isinstance(answer, dict) or not _is_int(answer.get("num_tokens")):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise BootstrapError(f"bootstrap room {bootstrap.room}: {error}")
    return int(answer["num_tokens"])
