"""Per-key budgets shared by every worker and replica: token buckets kept in Redis (`limits_store`).

Each check is one round trip: an atomic Lua script refills the key's bucket from the time passed, then
spends from it, with the same semantics as the in-process `TokenBucket` at the key's full rate. Redis
unreachable or slow (past `timeout`): the caller decides on its local buckets instead (its share,
limit / workers), the failure is counted, and one line is logged per outage, not per request. After a
failure the store is left alone for `retry_after` seconds, so an outage costs requests nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from dpd_router.config import without_password

if TYPE_CHECKING:
    from dpd_router.record.metrics import RouterMetrics

log = logging.getLogger("dpd_router.limits")

KEY_PREFIX = "dpd-router:limits:"

# KEYS[1]: the bucket (a hash of level and updated). ARGV: rate per minute, amount, and the time in
# seconds (empty: the server's clock, which every replica shares; tests pass their own). Returns the
# seconds until `amount` could be spent, as a string (Lua numbers reach the client as truncated integers),
# "0" when spent. The key expires once the bucket would be full again: a full bucket and no key are the same.
TAKE_SCRIPT = """
local rate = tonumber(ARGV[1])
local amount = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local state = redis.call('HMGET', KEYS[1], 'level', 'updated')
local level = tonumber(state[1])
local updated = tonumber(state[2])
if not level or not updated then
  level = rate
  updated = now
end
if now > updated then
  level = math.min(rate, level + (now - updated) * rate / 60)
  updated = now
end
local wait = 0
if amount <= level or (amount > rate and level >= rate) then
  -- spent; an amount larger than a full bucket is allowed only from a full one, leaving it in debt
  level = level - amount
elseif amount > rate then
  wait = (rate - level) * 60 / rate
else
  wait = (amount - level) * 60 / rate
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'updated', tostring(updated))
redis.call('PEXPIRE', KEYS[1], math.ceil((rate - level) * 60000 / rate) + 1000)
return tostring(wait)
"""


class RedisBuckets:
    """The shared token buckets behind `limits_store: redis://HOST:PORT/DB`, over one connection pool."""

    def __init__(
        self,
        url: str,
        metrics: RouterMetrics,
        *,
        timeout: float = 0.1,
        retry_after: float = 1.0,
        max_connections: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = url
        self._metrics = metrics
        self._timeout = timeout
        self._retry_after = retry_after
        self._clock = clock
        # A blocking pool: past `max_connections` checks in flight, a check waits for a connection (within
        # the timeout) instead of failing as a non-blocking pool's would, which would read as an outage.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # One retry, at once: a pooled connection the server closed (a restart) is replaced, while a
            # server that is down fails within the timeout; the local buckets take over, not a backoff.
            retry=Retry(NoBackoff(), 1),
        )
        self._client: redis.Redis = redis.Redis(connection_pool=pool)
        self._script = self._client.register_script(TAKE_SCRIPT)
        self._down_until: float | None = None  # set during an outage: when to try the store again
        self._failed_at: float | None = None  # the outage's last failure

    async def take(self, key: str, rate_per_minute: float, amount: float, *, now: float | None = None) -> float | None:
        """Spend `amount` from the shared bucket `key` refilling at `rate_per_minute`: 0 when allowed, else
        the seconds until it would be; None when the store could not say (the caller decides locally)."""
        if self._down_until is not None and self._clock() < self._down_until:
            return None
        args: list[Any] = [rate_per_minute, amount, "" if now is None else now]
        started = self._clock()
        try:
            async with asyncio.timeout(self._timeout):
                reply = await self._script(keys=[KEY_PREFIX + key], args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(exc)
            return None
        # Over only when a check that started after the last failure succeeds (one sent before it may still
        # come back, from a server that has just gone).
        if self._failed_at is not None and started >= self._failed_at:
            self._down_until = self._failed_at = None
            log.info("limits store %s reachable again: per-key limits are shared again", self._safe_url)
        return float(reply)

    def _failed(self, exc: BaseException) -> None:
        self._metrics.limits_store_errors.inc()
        now = self._clock()
        self._down_until = now + self._retry_after
        new_outage = self._failed_at is None
        self._failed_at = now
        if new_outage:
            log.warning(
                "limits store %s unreachable (%s): per-key limits are kept per process (limit / workers) until "
                "it answers again",
                self._safe_url,
                type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}",
                extra={"fields": {"event": "limits_store_down"}},
            )

    @property
    def _safe_url(self) -> str:
        return without_password(self._url)

    async def aclose(self) -> None:
        await self._client.aclose()
