"""API keys: who is calling, which tenant they belong to, and what they may spend.

Keys are configured as SHA-256 hashes (never in the clear) in a YAML file and/or the environment;
a presented key is hashed and looked up. The key itself is never logged: logs carry `key_id`,
the first 12 hex digits of its hash.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dpd_router.api.keys import checked_digest
from dpd_router.api.keys import hash_key as hash_key  # where tests and scripts have imported it from
from dpd_router.api.limits import KeyLimits, SharedBuckets, SharedBudget, TokenBucket
from dpd_router.request.errors import Forbidden, RateLimited, RouterError, Unauthorized

if TYPE_CHECKING:
    from starlette.requests import Request

    from dpd_router.record.metrics import RouterMetrics

log = logging.getLogger("dpd_router.auth")

# Source addresses and wrong credentials whose failed attempts are remembered at once; the longest quiet
# ones are forgotten first.
MAX_TRACKED_SOURCES = 10_000


@dataclass
class Principal:
    """The caller behind one API key."""

    key_id: str
    tenant: str | None = None
    admin: bool = False
    limits: KeyLimits = field(default_factory=KeyLimits)


ANONYMOUS = Principal(key_id="anonymous")


class KeyRing:
    """Every configured key, by hash. With no API keys, the OpenAI API is open to anyone."""

    def __init__(self, principals: dict[str, Principal]) -> None:
        self._by_hash = principals

    @property
    def enabled(self) -> bool:
        """Whether the OpenAI API needs a key: yes once any non-admin key is configured.

        Admin keys alone protect only the admin endpoints (and are accepted on the API too).
        """
        return any(not principal.admin for principal in self._by_hash.values())

    @property
    def configured(self) -> bool:
        """Whether any key at all is configured (admin keys included)."""
        return bool(self._by_hash)

    def tenants(self) -> set[str]:
        return {p.tenant for p in self._by_hash.values() if p.tenant is not None}

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an `Authorization: Bearer <key>` header (anonymous when auth is off)."""
        if not self.enabled:
            return ANONYMOUS
        principal = self._lookup(authorization)
        if principal is None:
            raise Unauthorized("A valid API key is required: send it as 'Authorization: Bearer <key>'.")
        return principal

    def authenticate_admin(self, authorization: str | None) -> Principal:
        principal = self._lookup(authorization)
        if principal is None:
            raise Unauthorized("An admin API key is required: send it as 'Authorization: Bearer <key>'.")
        if not principal.admin:
            raise Forbidden("This API key may not use the admin endpoints.")
        return principal

    def _lookup(self, authorization: str | None) -> Principal | None:
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._by_hash.get(hash_key(key.strip()))

    @classmethod
    def load(
        cls,
        *,
        keys_file: Path | None,
        key_hashes: list[str],
        admin_key_hashes: list[str],
        workers: int = 1,
        store: SharedBuckets | None = None,
    ) -> KeyRing:
        """The keys; each key's per-minute rates are divided among `workers` processes, which keep them apart,
        unless a shared `store` keeps them whole (the shares then stand in while it cannot answer)."""
        principals: dict[str, Principal] = {}
        for digest in key_hashes:
            principals[checked_digest(digest)] = Principal(key_id=digest[:12])
        for digest in admin_key_hashes:
            principals[checked_digest(digest)] = Principal(key_id=digest[:12], admin=True)
        if keys_file is not None:
            for entry in _read_keys_file(keys_file):
                digest = checked_digest(str(entry["sha256"]))
                requests = _bucket(entry.get("requests_per_minute"), workers)
                prompt_tokens = _bucket(entry.get("prompt_tokens_per_minute"), workers)
                shared = None
                if store is not None and (requests is not None or prompt_tokens is not None):
                    shared = SharedBudget(
                        store,
                        digest[:12],
                        requests_per_minute=None if requests is None else float(entry["requests_per_minute"]),
                        prompt_tokens_per_minute=(
                            None if prompt_tokens is None else float(entry["prompt_tokens_per_minute"])
                        ),
                    )
                principals[digest] = Principal(
                    key_id=digest[:12],
                    tenant=entry.get("tenant"),
                    admin=bool(entry.get("admin", False)),
                    limits=KeyLimits(requests=requests, prompt_tokens=prompt_tokens, shared=shared),
                )
        return cls(principals)


class ClientAddresses:
    """Which address a request came from: its peer's, or, when the peer is a trusted proxy (an ingress, a
    load balancer), the client its `X-Forwarded-For` names: the rightmost entry that is not itself a trusted
    proxy, since every proxy appends the address it was reached from and only the trusted ones are believed.
    With no trusted proxies the header is ignored: anyone could write it."""

    def __init__(self, trusted_proxies: list[str]) -> None:
        self._trusted = [ipaddress.ip_network(entry, strict=False) for entry in trusted_proxies]

    def source_of(self, request: Request) -> str:
        peer = request.client.host if request.client is not None else "unknown"
        if not self._trusted or not self._is_trusted(peer):
            return peer
        forwarded = ",".join(request.headers.getlist("x-forwarded-for"))
        for hop in reversed([part.strip() for part in forwarded.split(",") if part.strip()]):
            if not self._is_trusted(hop):
                return hop
        return peer

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._trusted)


class AuthThrottled(RateLimited):
    """This source address, or this wrong key, failed to authenticate too often; its attempts wait."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message, kind="auth_failures", retry_after=retry_after)


class Gatekeeper:
    """Checks each call's key against the key ring, and throttles the callers that keep failing.

    A valid key is always let in: what others sent from its address costs it nothing, so behind an
    ingress, where every client shares one address, a misconfigured client cannot lock the others out.
    A failed attempt is counted twice, in token buckets of `failures_per_minute`: for its address and for
    the credential it presented (by hash). An attempt with a wrong key from an address, or with a key,
    that spent its bucket gets 429 instead of 401 until the bucket refills, so a client retrying a bad key
    is slowed down and told why. Keys are random 256-bit secrets (`dpd-router hash-key`): the throttle
    is there to quiet broken clients and to make noise (the log line, the counter), not to stop guessing.
    """

    def __init__(
        self,
        keys: KeyRing,
        metrics: RouterMetrics,
        *,
        failures_per_minute: float,
        addresses: ClientAddresses | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = keys
        self.addresses = addresses or ClientAddresses([])
        self._metrics = metrics
        self._rate = failures_per_minute
        self._clock = clock
        self._failures: OrderedDict[str, _FailedSource] = OrderedDict()

    def source_of(self, request: Request) -> str:
        """The address whose failures a request's failure counts against (ClientAddresses)."""
        return self.addresses.source_of(request)

    def authenticate(self, authorization: str | None, source: str) -> Principal:
        """The caller of the OpenAI API (anonymous when no API keys are configured)."""
        if not self.keys.enabled:
            return ANONYMOUS
        return self._checked(lambda: self.keys.authenticate(authorization), authorization, source)

    def caller(self, request: Request) -> Principal:
        """The caller of the API, from the request's headers alone (its key) and its address. The anthropic
        clients send their key as `x-api-key`: read as a bearer key where no Authorization header came."""
        authorization = request.headers.get("authorization")
        if authorization is None and (api_key := request.headers.get("x-api-key")) is not None:
            authorization = f"Bearer {api_key}"
        return self.authenticate(authorization, self.source_of(request))

    def authenticate_admin(self, authorization: str | None, source: str) -> Principal:
        """The caller of an admin endpoint: an admin key, always required."""
        return self._checked(lambda: self.keys.authenticate_admin(authorization), authorization, source)

    def _checked(self, check: Callable[[], Principal], authorization: str | None, source: str) -> Principal:
        try:
            return check()
        except RouterError:
            if self._rate <= 0:
                self._metrics.auth_failures.inc()
                raise
            counted = [f"address {source}"]
            if authorization:  # by its hash: the router never holds a presented key in the clear
                counted.append(f"key {hash_key(authorization)[:12]}")
            wait = max(self._wait(name) for name in counted)
            if wait:
                self._metrics.auth_throttled.inc()
                raise AuthThrottled(
                    "Too many failed authentications from this address or with this key; retry later.",
                    retry_after=wait,
                ) from None
            self._metrics.auth_failures.inc()
            for name in counted:
                self._count_failure(name)
            raise

    def _wait(self, name: str) -> float:
        failed = self._failures.get(name)
        return 0.0 if failed is None else failed.bucket.wait_for(1)

    def _count_failure(self, name: str) -> None:
        failed = self._failures.get(name)
        if failed is None:
            failed = self._failures[name] = _FailedSource(TokenBucket(self._rate, clock=self._clock))
            if len(self._failures) > MAX_TRACKED_SOURCES:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(name)
        failed.bucket.take(1)
        now = self._clock()
        if failed.bucket.wait_for(1) and (failed.warned_at is None or now - failed.warned_at >= 60.0):
            failed.warned_at = now  # one line a minute for a source that keeps failing
            log.warning(
                "%s failed to authenticate %g times within a minute: its wrong keys get 429 until it slows down",
                name,
                self._rate,
                extra={"fields": {"event": "auth_throttled", "source": name}},
            )


@dataclass
class _FailedSource:
    bucket: TokenBucket
    warned_at: float | None = None


def _bucket(rate: Any, workers: int) -> TokenBucket | None:
    if rate is None:
        return None
    if not isinstance(rate, int | float) or rate <= 0:
        raise ValueError(f"a rate limit must be a positive number, got {rate!r}")
    return TokenBucket(float(rate) / workers)


def _read_keys_file(path: Path) -> list[dict[str, Any]]:
    data = yaml.safe_load(path.read_text()) or {}
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, dict) and "sha256" in k for k in keys):
        raise ValueError(f"{path}: expected 'keys:' with a list of entries that each have 'sha256'")
    return keys
