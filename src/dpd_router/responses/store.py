"""Where the Responses API's stored responses are kept (`responses_store`): the router's, not an engine's.

A response is kept with what it was generated from that its own request brought (its input items, and the
id of the response it continued), so a conversation is a chain: `previous_response_id` is expanded by
walking it back to its start. Each record is kept once, however long the conversation grows, and one
that has expired or been evicted ends every conversation that ran through it (the follow-up gets 404),
never a silently shortened history.

Two backends behind one contract:
- SQLite (the default): one file, shared by every worker process of a router and kept across restarts;
  every call runs on one thread of its own, so the event loop never waits on the disk.
- Redis (`redis://...`): shared by replicas; a Lua script keeps each put, eviction and chain walk atomic.
  The scripts name keys they build from ids, so a single Redis (with replicas) is needed, not a Cluster.

Both bound what they keep by age (`responses_ttl`) and by size (`responses_store_max_mb`, the oldest
evicted first). Records belong to the API key that made them: any other key is told they do not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

# The longest chain walked back for one request: a bound on the work a stored cycle could ask for
# (none can be made through the API, but a store is shared and outlives the router that wrote it).
MAX_CHAIN = 10_000

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One response as kept: its own input items and the response object (JSON), and what it continued."""

    id: str
    owner: str
    previous: str | None
    created: float
    input: bytes
    response: bytes

    @property
    def size(self) -> int:
        return len(self.input) + len(self.response) + len(self.id) + len(self.owner) + len(self.previous or "")


class ResponseStore(Protocol):
    """The contract every backend keeps."""

    async def put(self, record: StoredResponse) -> bool:
        """Keep `record` (replacing one of the same id); False when it alone is larger than the size bound."""
        ...

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """`response_id` as kept; None when it is not (or belongs to another owner)."""
        ...

    async def chain(self, response_id: str, owner: str) -> list[StoredResponse] | None:
        """`response_id` and every response before it, newest first; None when it or any of them is not
        kept (expired, evicted, deleted) or belongs to another owner."""
        ...

    async def delete(self, response_id: str, owner: str) -> bool:
        """Forget `response_id`; False when no such response of `owner` is kept."""
        ...

    async def aclose(self) -> None: ...


class SqliteResponses:
    """Stored responses in one SQLite file (WAL, so several worker processes read and write it at once)."""

    _SCHEMA = """
    CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        previous TEXT,
        created REAL NOT NULL,
        expires REAL NOT NULL,
        size INTEGER NOT NULL,
        input BLOB NOT NULL,
        response BLOB NOT NULL
    );
    CREATE INDEX IF NOT EXISTS responses_by_created ON responses (created);
    CREATE INDEX IF NOT EXISTS responses_by_expires ON responses (expires);
    CREATE TABLE IF NOT EXISTS totals (one INTEGER PRIMARY KEY CHECK (one = 1), bytes INTEGER NOT NULL);
    INSERT OR IGNORE INTO totals (one, bytes) VALUES (1, 0);
    """

    def __init__(self, path: Path, *, ttl: float, max_bytes: int, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._ttl = ttl
        self._max_bytes = max_bytes
        self._clock = clock
        # One thread owns the connection: calls are serialised there, and none runs on the event loop.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-store")
        self._db: sqlite3.Connection | None = None

    async def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._on_thread, work)

    def _on_thread(self, work: Callable[[sqlite3.Connection], T]) -> T:
        if self._db is None:
            # The callers' conversations: readable by this user alone (SQLite gives its -wal and -shm
            # files the database file's mode).
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
            # Autocommit mode: each write below opens its own BEGIN IMMEDIATE, which takes the file's write
            # lock at once (a deferred transaction could fail to upgrade while another worker writes).
            db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.executescript(self._SCHEMA)
            except BaseException:
                db.close()
                raise
            self._db = db
        return work(self._db)

    async def put(self, record: StoredResponse) -> bool:
        size = record.size
        if size > self._max_bytes:
            return False
        now = self._clock()

        def write(db: sqlite3.Connection) -> bool:
            with _writing(db):
                freed = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses WHERE expires <= ?", (now,))
                freed_bytes = freed.fetchone()[0]
                db.execute("DELETE FROM responses WHERE expires <= ?", (now,))
                replaced = db.execute("SELECT size FROM responses WHERE id = ?", (record.id,)).fetchone()
                freed_bytes += replaced[0] if replaced else 0
                db.execute(
                    "INSERT OR REPLACE INTO responses (id, owner, previous, created, expires, size, input, response) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        record.id,
                        record.owner,
                        record.previous,
                        record.created,
                        now + self._ttl,
                        size,
                        record.input,
                        record.response,
                    ),
                )
                (total,) = db.execute(
                    "UPDATE totals SET bytes = bytes + ? WHERE one = 1 RETURNING bytes", (size - freed_bytes,)
                ).fetchone()
                while total > self._max_bytes:
                    oldest = db.execute(
                        "SELECT id, size FROM responses WHERE id != ? ORDER BY created LIMIT 64", (record.id,)
                    ).fetchall()
                    if not oldest:
                        break
                    for old_id, old_size in oldest:
                        if total <= self._max_bytes:
                            break
                        db.execute("DELETE FROM responses WHERE id = ?", (old_id,))
                        total -= old_size
                    db.execute("UPDATE totals SET bytes = ? WHERE one = 1", (total,))
            return True

        return await self._call(write)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        now = self._clock()

        return await self._call(lambda db: _read_row(db, response_id, owner, now))

    async def chain(self, response_id: str, owner: str) -> list[StoredResponse] | None:
        now = self._clock()

        def walk(db: sqlite3.Connection) -> list[StoredResponse] | None:
            found: list[StoredResponse] = []
            wanted: str | None = response_id
            while wanted is not None and len(found) < MAX_CHAIN:
                record = _read_row(db, wanted, owner, now)
                if record is None:
                    return None
                found.append(record)
                wanted = record.previous
            return found if wanted is None else None

        return await self._call(walk)

    async def delete(self, response_id: str, owner: str) -> bool:
        now = self._clock()

        def forget(db: sqlite3.Connection) -> bool:
            with _writing(db):
                row = db.execute(
                    "DELETE FROM responses WHERE id = ? AND owner = ? RETURNING size, expires", (response_id, owner)
                ).fetchone()
                if row is not None:
                    db.execute("UPDATE totals SET bytes = bytes - ? WHERE one = 1", (row[0],))
            return row is not None and row[1] > now

        return await self._call(forget)

    async def aclose(self) -> None:
        def close(db: sqlite3.Connection) -> None:
            db.close()

        if self._db is not None:
            await self._call(close)
            self._db = None
        self._thread.shutdown(wait=False)


@contextlib.contextmanager
def _writing(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, holding the file's write lock from its start; rolled back if it fails."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _read_row(db: sqlite3.Connection, response_id: str, owner: str, now: float) -> StoredResponse | None:
    """`response_id` as kept and unexpired at `now`; None when it is not, or is another owner's."""
    row = db.execute(
        "SELECT owner, previous, created, input, response FROM responses WHERE id = ? AND expires > ?",
        (response_id, now),
    ).fetchone()
    if row is None or row[0] != owner:
        return None
    return StoredResponse(response_id, row[0], row[1], row[2], row[3], row[4])


# The Redis layout, under one prefix: a hash per response (owner, previous, created, size, input, response)
# that expires with its TTL; a sorted set of every kept id by creation time and a hash of their sizes, with
# the running total, for the size bound; expired ids are dropped from those lazily, on the next put.
REDIS_PREFIX = "dpd-router:responses:"

# KEYS: the index (sorted set), the sizes (hash), the total (string). ARGV: prefix, id, owner, previous ("" for
# none), created, size, input, response, ttl in ms, max bytes, now (seconds). Returns 1 when kept, 0 when the
# record alone is over the bound.
_PUT = """
local prefix, id = ARGV[1], ARGV[2]
local size, ttl_ms, max_bytes, now = tonumber(ARGV[6]), tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
if size > max_bytes then return 0 end
local function forget(old)
  local old_size = tonumber(redis.call('HGET', KEYS[2], old) or '0')
  redis.call('DECRBY', KEYS[3], old_size)
  redis.call('HDEL', KEYS[2], old)
  redis.call('ZREM', KEYS[1], old)
  redis.call('DEL', prefix .. old)
end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl_ms / 1000, 'LIMIT', 0, 256)) do
  if redis.call('EXISTS', prefix .. old) == 0 then forget(old) end
end
if redis.call('HEXISTS', KEYS[2], id) == 1 then forget(id) end
redis.call('HSET', prefix .. id, 'owner', ARGV[3], 'previous', ARGV[4], 'created', ARGV[5], 'input', ARGV[7],
  'response', ARGV[8])
redis.call('PEXPIRE', prefix .. id, ttl_ms)
redis.call('ZADD', KEYS[1], now, id)
redis.call('HSET', KEYS[2], id, size)
local total = redis.call('INCRBY', KEYS[3], size)
while total > max_bytes do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not oldest or oldest == id then break end
  forget(oldest)
  total = tonumber(redis.call('GET', KEYS[3]))
end
return 1
"""

# ARGV: prefix, id, owner, the most records. Returns the chain newest first as flat [id, previous, created,
# input, response, ...], or an empty list when a record is missing or another owner's.
_CHAIN = """
local prefix, wanted, owner, most = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local out = {}
local count = 0
while wanted ~= '' and count < most do
  local row = redis.call('HMGET', prefix .. wanted, 'owner', 'previous', 'created', 'input', 'response')
  if not row[1] or row[1] ~= owner then return {} end
  table.insert(out, wanted)
  table.insert(out, row[2])
  table.insert(out, row[3])
  table.insert(out, row[4])
  table.insert(out, row[5])
  count = count + 1
  wanted = row[2]
end
if wanted ~= '' then return {} end
return out
"""

# KEYS as _PUT's. ARGV: prefix, id, owner. Returns 1 when forgotten.
_DELETE = """
local prefix, id = ARGV[1], ARGV[2]
if redis.call('HGET', prefix .. id, 'owner') ~= ARGV[3] then return 0 end
local size = tonumber(redis.call('HGET', KEYS[2], id) or '0')
redis.call('DECRBY', KEYS[3], size)
redis.call('HDEL', KEYS[2], id)
redis.call('ZREM', KEYS[1], id)
redis.call('DEL', prefix .. id)
return 1
"""


class RedisResponses:
    """Stored responses in Redis (`responses_store: redis://HOST:PORT/DB`), shared by every replica."""

    def __init__(
        self,
        url: str,
        *,
        ttl: float,
        max_bytes: int,
        # A round trip of a small script: a Redis that takes longer is down for this purpose, and every
        # Responses request waits on its store call before its end is sent.
        timeout: float = 1.0,
        prefix: str = REDIS_PREFIX,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import redis.asyncio as redis  # the client (and what it imports) only where Redis is used

        self._ttl_ms = max(int(ttl * 1000), 1)
        self._max_bytes = max_bytes
        self._prefix = prefix
        self._clock = clock
        self._keys = [f"{prefix}index", f"{prefix}sizes", f"{prefix}bytes"]
        self._client: Any = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._put = self._client.register_script(_PUT)
        self._chain = self._client.register_script(_CHAIN)
        self._delete = self._client.register_script(_DELETE)

    async def put(self, record: StoredResponse) -> bool:
        args: list[str | int | bytes] = [
            self._prefix,
            record.id,
            record.owner,
            record.previous or "",
            repr(record.created),
            record.size,
            record.input,
            record.response,
            self._ttl_ms,
            self._max_bytes,
            repr(self._clock()),
        ]
        return bool(await self._put(keys=self._keys, args=args))

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        fields = ("owner", "previous", "created", "input", "response")
        row = await self._client.hmget(self._prefix + response_id, fields)
        if row[0] is None or row[0].decode() != owner:
            return None
        return StoredResponse(response_id, owner, row[1].decode() or None, float(row[2]), row[3], row[4])

    async def chain(self, response_id: str, owner: str) -> list[StoredResponse] | None:
        flat = await self._chain(keys=[], args=[self._prefix, response_id, owner, MAX_CHAIN])
        if not flat:
            return None
        found = []
        for at in range(0, len(flat), 5):
            rid, previous, created, given, response = flat[at : at + 5]
            record = StoredResponse(rid.decode(), owner, previous.decode() or None, float(created), given, response)
            found.append(record)
        return found

    async def delete(self, response_id: str, owner: str) -> bool:
        return bool(await self._delete(keys=self._keys, args=[self._prefix, response_id, owner]))

    async def aclose(self) -> None:
        await self._client.aclose()


def open_store(where: str, *, ttl: float, max_bytes: int) -> ResponseStore | None:
    """The store `responses_store` names: `off` (None: nothing is kept), `redis://` or `rediss://` URLs, or an
    SQLite file's path."""
    if where == "off":
        return None
    if where.startswith(("redis://", "rediss://", "unix://")):
        return RedisResponses(where, ttl=ttl, max_bytes=max_bytes)
    return SqliteResponses(Path(where).expanduser(), ttl=ttl, max_bytes=max_bytes)
