"""The prefill and decode pools: built at startup from settings, changed at runtime by discovery."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dpd_router.pool.breaker import HALF_OPEN, BreakerPolicy, CircuitBreaker
from dpd_router.pool.endpoint import Endpoint, Role


class Pool:
    """The router's view of a set of engines, split by role.

    The shared pool and each tenant's reserved pool are separate Pools; `Pool.union` gives one
    live view of every engine (sharing the same Endpoint objects) for health probes, load scraping
    and metrics. Discovery changes a pool in place with `add`, `drain` and `remove`; each change
    replaces the role's member list rather than editing it, so a list already handed out stays as
    it was.
    """

    def __init__(
        self,
        prefill_urls: Iterable[str],
        decode_urls: Iterable[str],
        *,
        breaker: BreakerPolicy | None = None,
        name: str = "shared",
    ) -> None:
        self.name = name
        self._policy = breaker or BreakerPolicy()
        self._members: dict[Role, list[Endpoint]] = {
            "prefill": [self._endpoint(url, "prefill") for url in prefill_urls],
            "decode": [self._endpoint(url, "decode") for url in decode_urls],
        }
        self._parts: tuple[Pool, ...] = ()
        # A view's test of which of its parts' members it shows (None: all of them).
        self._shows: Callable[[Endpoint], bool] | None = None

    @classmethod
    def union(cls, pools: Iterable[Pool]) -> Pool:
        """Every engine of `pools`, read through to them: an engine added to or removed from one of
        them is in or out of the union at once."""
        merged = cls((), (), name="all")
        merged._parts = tuple(pools)
        return merged

    @classmethod
    def where(cls, pool: Pool, shows: Callable[[Endpoint], bool], *, name: str) -> Pool:
        """The members of `pool` that `shows` passes, read through to it (a LoRA adapter's engines: those
        that list it, as each health round finds them)."""
        view = cls((), (), name=name)
        view._parts = (pool,)
        view._shows = shows
        return view

    @property
    def parts(self) -> tuple[Pool, ...]:
        """The pools a union reads through to (a plain pool: itself)."""
        return self._parts or (self,)

    @property
    def prefillers(self) -> list[Endpoint]:
        return self.members("prefill")

    @property
    def decoders(self) -> list[Endpoint]:
        return self.members("decode")

    def endpoints(self) -> list[Endpoint]:
        return [*self.prefillers, *self.decoders]

    def members(self, role: Role) -> list[Endpoint]:
        """The endpoints of `role`, draining ones included (they still have calls open)."""
        if self._parts:
            shows = self._shows
            return [
                endpoint for part in self._parts for endpoint in part.members(role) if shows is None or shows(endpoint)
            ]
        return self._members[role]

    def healthy(self, role: Role) -> list[Endpoint]:
        """The endpoints of `role` that may take new calls now (probes pass, breaker not open, not draining)."""
        return [endpoint for endpoint in self.members(role) if endpoint.available]

    def recovering(self, role: Role) -> list[Endpoint]:
        """When no endpoint of `role` is available: those whose breaker is half-open with its trial
        call still running (probes passing, not draining).

        A half-open breaker lets one trial through at a time so that a healthy pool sends a
        recovering engine a trickle. With nothing else up, refusing a burst because one call is
        on trial would turn away requests an engine can take: they go to the recovering engines,
        whose first failure opens the breaker again (and a hung one misses its learned deadline).
        """
        return [
            endpoint
            for endpoint in self.members(role)
            if endpoint.healthy and not endpoint.draining and endpoint.breaker.state == HALF_OPEN
        ]

    def last_resort(self, role: Role) -> list[Endpoint]:
        """When no endpoint of `role` is available: those failing nothing but their health probes.

        An engine too busy to answer `/health` in time still serves its requests; turning every
        client away with 503 because its probes are slow would be worse than trying it (Envoy's
        panic routing). Only engines that answered a probe before, whose breaker lets calls through
        (real calls are not failing) and that are not draining qualify: a dead engine fails its
        calls, its breaker opens, and it leaves this list too.
        """
        return [
            endpoint
            for endpoint in self.members(role)
            if not endpoint.healthy and endpoint.probed_ok and not endpoint.draining and endpoint.breaker.allows()
        ]

    def ready(self) -> bool:
        """At least one decoder has answered a health probe and may take traffic now."""
        return any(endpoint.probed_ok and endpoint.available for endpoint in self.decoders)

    def get(self, url: str) -> Endpoint | None:
        """The member whose base URL is `url`, of either role."""
        return next((endpoint for endpoint in self.endpoints() if endpoint.url == url), None)

    def add(self, url: str, role: Role) -> Endpoint:
        """Add the engine at `url`, or take back a draining member of the same URL.

        A member keeps its Endpoint object, with its breaker, load and place in routing (prefix
        affinity and session hashing key on the URL, so a new object for an old URL finds them too).
        """
        self._check_mutable()
        existing = self.get(url)
        if existing is not None:
            if existing.role != role:
                raise ValueError(f"{url} is already a {existing.role} endpoint of the {self.name} pool")
            existing.draining = False
            return existing
        endpoint = self._endpoint(url, role)
        self._members[role] = [*self._members[role], endpoint]
        return endpoint

    def drain(self, url: str) -> Endpoint | None:
        """Send no new calls to the engine at `url`; the ones open go on. None when it is not a member."""
        self._check_mutable()
        endpoint = self.get(url)
        if endpoint is not None:
            endpoint.draining = True
        return endpoint

    def remove(self, endpoint: Endpoint) -> bool:
        """Take `endpoint` out of the pool (calls still holding it are unaffected); False if it was not in."""
        self._check_mutable()
        members = self._members[endpoint.role]
        if not any(member is endpoint for member in members):
            return False
        self._members[endpoint.role] = [member for member in members if member is not endpoint]
        return True

    def _endpoint(self, url: str, role: Role) -> Endpoint:
        return Endpoint(url, role, breaker=CircuitBreaker(self._policy))

    def _check_mutable(self) -> None:
        if self._parts:
            raise TypeError("a union of pools is a view: change one of its pools instead")
