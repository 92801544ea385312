"""Kubernetes discovery: engine pods, watched by label selector, as the shared pool's endpoints.

For each role it discovers, a `PodWatch` lists the pods its selector matches and watches them from
the list's resourceVersion (lightkube opens the watch again, from the last version seen, whenever
the API server ends it). A watch ended by 410 Gone is followed at once by a fresh list; any other
failure by a fresh list after a back-off that doubles up to `BACKOFF_MAX`. Every list replaces what
the watch knew, so no event missed in between can leave an engine behind.

A pod with the condition Ready=True that is not terminating is the endpoint
`http://<pod IP>:<port>`. `Discovery` adds such endpoints to the pool and drains the ones whose
pods are gone or unready: no new calls, and out of the pool once the last open call ends, or after
`drain_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import AsyncIterable, Callable, Collection, Iterable

from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig, NotReadyError, operators
from lightkube.config.models import Cluster, User
from lightkube.core.generic_client import ListAsyncIterable
from lightkube.resources.core_v1 import Pod

from dpd_router.config import Settings, SettingsError
from dpd_router.pool.endpoint import Endpoint, Role
from dpd_router.pool.pool import Pool
from dpd_router.record.metrics import RouterMetrics
from dpd_router.startup.tasks import cancel_and_wait

log = logging.getLogger("dpd_router.discovery")

ROLES: tuple[Role, ...] = ("prefill", "decode")
# Back-off between attempts after the API server failed to answer: doubled each time, from this ...
BACKOFF_INITIAL = 0.5
# ... up to this many seconds.
BACKOFF_MAX = 30.0
# The API server ends a watch after this many seconds and lightkube opens the next one.
WATCH_SECONDS = 300
# How long startup waits for the first list of each role before serving without it.
INITIAL_SYNC_TIMEOUT = 10.0

# A list of pairs, not lightkube's dict: a selector may repeat a key (`tier!=a,tier!=b`).
LabelSelector = list[tuple[str, operators.SequenceOperator | operators.BinaryOperator | operators.UnaryOperator]]

_KEY = r"[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s+\((?P<values>[^()]*)\)$")
_EQUALITY = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})$")
_EXISTS = re.compile(rf"^(?P<negated>!)?\s*(?P<key>{_KEY})$")


def parse_selector(text: str) -> LabelSelector:
    """A Kubernetes label selector (`a=b,c!=d,e in (f,g),h notin (i),j,!k`) as lightkube requirements."""
    requirements: LabelSelector = []
    for term in _terms(text):
        if match := _SET.match(term):
            values = [value.strip() for value in match["values"].split(",") if value.strip()]
            if not values or not all(re.fullmatch(_VALUE, value) for value in values):
                raise ValueError(f"{term!r}: a set needs one or more label values")
            op = operators.in_(values) if match["op"] == "in" else operators.not_in(values)
            requirements.append((match["key"], op))
        elif match := _EQUALITY.match(term):
            value = match["value"]
            requirements.append(
                (match["key"], operators.not_equal(value) if match["op"] == "!=" else operators.equal(value))
            )
        elif match := _EXISTS.match(term):
            requirements.append((match["key"], operators.not_exists() if match["negated"] else operators.exists()))
        else:
            raise ValueError(f"{term!r} is not a label selector requirement")
    return requirements


def _terms(text: str) -> Iterable[str]:
    """The comma-separated requirements of a selector; commas inside `(...)` belong to a set."""
    depth, start = 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            yield text[start:index].strip()
            start = index + 1
    last = text[start:].strip()
    if last or start:
        yield last


def role_selector(settings: Settings, role: Role) -> str:
    """The selector of `role`'s pods: its own setting, else `<role label>=<role>` and kubernetes_selector."""
    own = settings.kubernetes_prefill_selector if role == "prefill" else settings.kubernetes_decode_selector
    if own is not None:
        return own
    return ",".join(part for part in (f"{settings.kubernetes_role_label}={role}", settings.kubernetes_selector) if part)


def pod_ready(pod: Pod) -> bool:
    """Whether the pod may take traffic: condition Ready=True, not terminating, and it has an IP."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletionTimestamp is not None or not status.podIP:
        return False
    return any(condition.type == "Ready" and condition.status == "True" for condition in status.conditions or ())


def pod_url(pod: Pod, *, port: int, port_annotation: str) -> str | None:
    """`http://<pod IP>:<port>`, the port from the pod's annotation, else `port`; None without an IP
    or when the annotation is not a port number (logged)."""
    ip = pod.status.podIP if pod.status is not None else None
    if not ip:
        return None
    annotations = (pod.metadata.annotations if pod.metadata is not None else None) or {}
    given = annotations.get(port_annotation)
    if given is not None:
        if not given.strip().isdigit() or not 1 <= int(given) <= 65535:
            log.warning(
                "pod %s: annotation %s=%r is not a port number; skipping it", _name(pod), port_annotation, given
            )
            return None
        port = int(given)
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def _name(pod: Pod) -> str:
    return (pod.metadata.name if pod.metadata is not None else None) or "?"


def _key(pod: Pod) -> str:
    meta = pod.metadata
    return (meta.uid or meta.name or "") if meta is not None else ""


def _gone(exc: Exception) -> bool:
    """Whether the API server said 410 Gone: the version the watch resumed from is no longer kept."""
    if isinstance(exc, ApiError):
        return exc.status.code == 410
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None) == 410


def kubernetes_client(settings: Settings) -> AsyncClient:
    """The API client: `kubernetes_api_url` (with its token and CA files) when set, else in-cluster config."""
    if settings.kubernetes_api_url is not None:
        token, ca = settings.kubernetes_token_file, settings.kubernetes_ca_file
        config = KubeConfig.from_one(
            cluster=Cluster(server=settings.kubernetes_api_url, certificate_auth=str(ca) if ca else None),
            user=User(token_file=str(token)) if token else User(),
            namespace=settings.kubernetes_namespace,
        )
    else:
        try:
            config = KubeConfig.from_service_account()
        except (ConfigError, KeyError) as exc:
            raise SettingsError(
                f"discovery: kubernetes needs in-cluster credentials ({exc}) or kubernetes_api_url"
            ) from None
    return AsyncClient(config, namespace=settings.kubernetes_namespace, trust_env=False)


class PodWatch:
    """One role's Ready pods, kept by list-then-watch; reports their engine URLs after every change."""

    def __init__(
        self,
        role: Role,
        client: AsyncClient,
        selector: LabelSelector,
        *,
        namespace: str,
        port: int,
        port_annotation: str,
        on_change: Callable[[Role, set[str]], None],
        metrics: RouterMetrics,
        backoff_initial: float = BACKOFF_INITIAL,
        backoff_max: float = BACKOFF_MAX,
    ) -> None:
        self.role = role
        self.synced = asyncio.Event()
        self._client = client
        self._selector = selector
        self._namespace = namespace
        self._port = port
        self._port_annotation = port_annotation
        self._on_change = on_change
        self._metrics = metrics
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        # Ready pods by uid -> engine URL.
        self._ready: dict[str, str] = {}

    async def run(self) -> None:
        """List and watch until cancelled; relist after 410 Gone, back off after other failures."""
        delay = self._backoff_initial
        while True:
            listed_at: float | None = None
            try:
                version = await self._list()
                listed_at = time.monotonic()
                await self._watch(version)
            except Exception as exc:
                if _gone(exc):
                    log.info("watch of %s pods expired (410 Gone): listing them again", self.role)
                    self._count("watch_gone")
                    continue
                if listed_at is not None and time.monotonic() - listed_at > self._backoff_max:
                    delay = self._backoff_initial  # the watch had been working: start the back-off afresh
                self._count("watch_error")
                log.warning(
                    "Kubernetes API failed while watching %s pods (%s: %s); retrying in %.1fs",
                    self.role,
                    type(exc).__name__,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self._backoff_max)

    async def _list(self) -> str | None:
        # lightkube annotates `labels` as a dict, while its build_selector also takes our list of pairs.
        pods: ListAsyncIterable[Pod] = self._client.list(  # type: ignore[call-overload]  # labels: pairs
            Pod, namespace=self._namespace, labels=self._selector
        )
        ready: dict[str, str] = {}
        async for pod in pods:
            url = self._url(pod)
            if url is not None:
                ready[_key(pod)] = url
        self._ready = ready
        self._count("relisted")
        self._changed()
        self.synced.set()
        try:
            return pods.resourceVersion
        except NotReadyError:  # the list carried no resourceVersion: watch from now
            return None

    async def _watch(self, version: str | None) -> None:
        """Apply watch events until the watch fails (lightkube reopens one the server ended)."""
        # lightkube annotates `labels` as a dict, while its build_selector also takes our list of pairs.
        events: AsyncIterable[tuple[str, Pod]] = self._client.watch(  # type: ignore[call-overload]  # labels: pairs
            Pod,
            namespace=self._namespace,
            labels=self._selector,
            resource_version=version,
            server_timeout=WATCH_SECONDS,
        )
        async for kind, pod in events:
            key = _key(pod)
            if kind in ("ADDED", "MODIFIED"):
                url = self._url(pod)
                if url == self._ready.get(key):
                    continue
                if url is None:
                    del self._ready[key]
                else:
                    self._ready[key] = url
            elif kind == "DELETED":
                if self._ready.pop(key, None) is None:
                    continue
            else:  # BOOKMARK
                continue
            self._changed()

    def _url(self, pod: Pod) -> str | None:
        if not pod_ready(pod):
            return None
        return pod_url(pod, port=self._port, port_annotation=self._port_annotation)

    def _changed(self) -> None:
        self._on_change(self.role, set(self._ready.values()))

    def _count(self, event: str) -> None:
        self._metrics.discovery_events.labels(self.role, event).inc()


class EngineOwners:
    """The served model each discovered engine belongs to, shared by every model's discovery: a pod two
    models' selectors match serves the one that found it first (an engine serves one model)."""

    def __init__(self) -> None:
        self._owners: dict[str, str | None] = {}

    def claim(self, url: str, model: str | None) -> bool:
        """Take `url` for `model`; False when another model holds it."""
        owner = self._owners.setdefault(url, model)
        return owner == model

    def owner(self, url: str) -> str | None:
        return self._owners.get(url)

    def release(self, url: str, model: str | None) -> None:
        if url in self._owners and self._owners[url] == model:
            del self._owners[url]


class Discovery:
    """Keeps the pool's discovered endpoints in step with the Ready pods its watches report.

    Only endpoints it added are ever drained; `reserved` URLs (tenants' engines) are never taken, nor an
    engine `owners` says another served model holds.
    """

    def __init__(
        self,
        pool: Pool,
        metrics: RouterMetrics,
        *,
        drain_timeout: float,
        reserved: Collection[str] = (),
        model: str | None = None,
        owners: EngineOwners | None = None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._drain_timeout = drain_timeout
        self._reserved = frozenset(reserved)
        self._model = model
        self._owners = owners if owners is not None else EngineOwners()
        self._client: AsyncClient | None = None
        self._watches: list[PodWatch] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._retiring: dict[str, asyncio.Task[None]] = {}
        # The URLs discovery put in the pool, by role (draining ones excluded).
        self._discovered: dict[Role, set[str]] = {role: set() for role in ROLES}

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        pool: Pool,
        metrics: RouterMetrics,
        *,
        reserved: Collection[str] = (),
        owners: EngineOwners | None = None,
    ) -> Discovery:
        """Discovery of each role the settings leave without static URLs, through the configured API server,
        for the model they serve (`owners`: which model each discovered engine serves, shared by all)."""
        discovery = cls(
            pool, metrics, drain_timeout=settings.drain_timeout, reserved=reserved, model=settings.model, owners=owners
        )
        roles = [role for role in ROLES if not pool.members(role)]
        selectors: dict[Role, LabelSelector] = {}
        for role in roles:
            text = role_selector(settings, role)
            try:
                selectors[role] = parse_selector(text)
            except ValueError as exc:
                raise SettingsError(f"kubernetes_{role}_selector: {exc}") from None
            if not selectors[role]:
                raise SettingsError(f"kubernetes_{role}_selector: an empty selector would take every pod")
        client = kubernetes_client(settings)
        discovery.watch_with(
            client, selectors, port=settings.kubernetes_port, port_annotation=settings.kubernetes_port_annotation
        )
        return discovery

    def watch_with(
        self,
        client: AsyncClient,
        selectors: dict[Role, LabelSelector],
        *,
        port: int,
        port_annotation: str,
        backoff_initial: float = BACKOFF_INITIAL,
        backoff_max: float = BACKOFF_MAX,
    ) -> None:
        """Use `client` to watch each role's pods by its selector (before `start`)."""
        self._client = client
        self._watches = [
            PodWatch(
                role,
                client,
                selector,
                namespace=client.namespace,
                port=port,
                port_annotation=port_annotation,
                on_change=self.reconcile,
                metrics=self._metrics,
                backoff_initial=backoff_initial,
                backoff_max=backoff_max,
            )
            for role, selector in selectors.items()
        ]

    @property
    def roles(self) -> list[Role]:
        return [watch.role for watch in self._watches]

    async def start(self, *, sync_timeout: float = INITIAL_SYNC_TIMEOUT) -> None:
        """Start the watches and wait, at most `sync_timeout`, for each role's first list."""
        self._tasks = [asyncio.create_task(watch.run(), name=f"discovery-{watch.role}") for watch in self._watches]
        try:
            async with asyncio.timeout(sync_timeout):
                await asyncio.gather(*(watch.synced.wait() for watch in self._watches))
        except TimeoutError:
            log.warning(
                "Kubernetes API has not answered within %.0fs: serving without discovered engines", sync_timeout
            )

    def reconcile(self, role: Role, urls: set[str]) -> None:
        """Make the discovered `role` endpoints exactly `urls`: add the new, drain the ones gone."""
        known = self._discovered[role]
        for url in sorted(urls - known):
            self._add(role, url)
        for url in sorted(known - urls):
            self._drain(role, url)

    def _add(self, role: Role, url: str) -> None:
        if url in self._reserved:
            self._conflict(role, url, "it belongs to a tenant's pool")
            return
        if not self._owners.claim(url, self._model):
            self._conflict(role, url, f"it serves model {self._owners.owner(url)}, which found it first")
            return
        existing = self._pool.get(url)
        try:
            endpoint = self._pool.add(url, role)
        except ValueError as exc:  # one of its pool's already, in the other role
            self._conflict(role, url, str(exc))
            return
        self._discovered[role].add(url)
        if existing is None:
            self._metrics.watch_endpoint(endpoint)
            self._count(role, "added")
            log.info("discovered %s endpoint %s", role, url)
            return
        retiring = self._retiring.pop(url, None)
        if retiring is not None:
            retiring.cancel()
        self._count(role, "restored")
        log.info("%s endpoint %s is ready again: no longer draining", role, url)

    def _drain(self, role: Role, url: str) -> None:
        self._discovered[role].discard(url)
        endpoint = self._pool.drain(url)
        if endpoint is None:
            return
        self._count(role, "draining")
        log.info("%s endpoint %s is draining (%d calls open)", role, url, endpoint.in_flight)
        self._retiring[url] = asyncio.create_task(self._retire(endpoint), name=f"drain {url}")

    async def _retire(self, endpoint: Endpoint) -> None:
        try:
            async with asyncio.timeout(self._drain_timeout):
                await endpoint.wait_idle()
        except TimeoutError:
            pass
        idle = endpoint.in_flight <= 0
        if self._retiring.get(endpoint.url) is asyncio.current_task():
            del self._retiring[endpoint.url]
        if not endpoint.draining or not self._pool.remove(endpoint):
            return
        self._owners.release(endpoint.url, self._model)
        self._metrics.forget_endpoint(endpoint)
        self._count(endpoint.role, "removed")
        if idle:
            log.info("%s endpoint %s drained and removed", endpoint.role, endpoint.url)
        else:
            log.warning(
                "%s endpoint %s removed after drain_timeout with %d calls still open",
                endpoint.role,
                endpoint.url,
                endpoint.in_flight,
            )

    def _conflict(self, role: Role, url: str, why: str) -> None:
        self._count(role, "conflict")
        log.warning("not adding %s pod at %s: %s", role, url, why)

    def _count(self, role: Role, event: str) -> None:
        self._metrics.discovery_events.labels(role, event).inc()

    async def close(self) -> None:
        tasks = [*self._tasks, *self._retiring.values()]
        await cancel_and_wait(tasks)
        self._tasks, self._retiring = [], {}
        if self._client is not None:
            await self._client.close()
