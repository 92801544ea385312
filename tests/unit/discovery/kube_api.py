"""A stand-in Kubernetes API server on 127.0.0.1: pods, listed and watched as the real one does.

It speaks the part of the core/v1 API discovery uses: `GET /api/v1/namespaces/{ns}/pods` with a
`labelSelector`, answering a PodList stamped with `metadata.resourceVersion`, or with `watch=true`
a stream of newline-delimited watch events (ADDED, MODIFIED, DELETED) after the `resourceVersion`
asked for. A watch from a version older than the history kept is answered with an ERROR event
carrying a 410 Status, as the real server does once etcd has compacted it.

Tests change pods with `put_pod`, `set_ready`, `terminate` and `delete`, end open watches with
`close_watches`, drop history with `expire`, make requests fail with `fail_next`, and read what the
client asked in `requests`.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

ROLE_LABEL = "dpd-router.io/role"
PORT_ANNOTATION = "dpd-router.io/port"


@dataclass
class SeenRequest:
    namespace: str
    watch: bool
    resource_version: str | None
    label_selector: str | None
    authorization: str | None


@dataclass
class FakeKubernetes:
    """Pods in namespaces, a resourceVersion counter and the event history watches replay."""

    token: str | None = None
    version: int = 1
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    requests: list[SeenRequest] = field(default_factory=list)
    # Watches from versions at or below this get 410 Gone.
    expired_before: int = 0
    # Answer the next N requests with 500.
    fail_next: int = 0
    url: str = ""
    _uids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _closing: int = 0

    # --- what tests do to the cluster -------------------------------------------------------

    def put_pod(
        self,
        name: str,
        *,
        role: str | None = None,
        port: int | None = None,
        ip: str | None = "127.0.0.1",
        ready: bool = True,
        labels: dict[str, str] | None = None,
        namespace: str = "engines",
    ) -> dict[str, Any]:
        """Create the pod, or replace its labels, IP and readiness (ADDED or MODIFIED)."""
        existing = self.pods.get((namespace, name))
        uid = existing["metadata"]["uid"] if existing else f"uid-{next(self._uids)}"
        all_labels = {**({ROLE_LABEL: role} if role else {}), **(labels or {})}
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "labels": all_labels,
                "annotations": {PORT_ANNOTATION: str(port)} if port is not None else {},
            },
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {
                "phase": "Running",
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": "True" if ready else "False"},
                ],
                **({"podIP": ip} if ip else {}),
            },
        }
        return self._record("MODIFIED" if existing else "ADDED", pod)

    def set_ready(self, name: str, ready: bool, *, namespace: str = "engines") -> None:
        pod = self._copy(namespace, name)
        for condition in pod["status"]["conditions"]:
            if condition["type"] == "Ready":
                condition["status"] = "True" if ready else "False"
        self._record("MODIFIED", pod)

    def terminate(self, name: str, *, namespace: str = "engines") -> None:
        """The pod is being deleted: a deletionTimestamp, and not Ready any more (MODIFIED)."""
        pod = self._copy(namespace, name)
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
        self._record("MODIFIED", pod)
        self.set_ready(name, False, namespace=namespace)

    def delete(self, name: str, *, namespace: str = "engines", unseen: bool = False) -> None:
        """The pod is gone (DELETED); `unseen`: no watch hears of it, as if the event was compacted away."""
        pod = self.pods.pop((namespace, name))
        self.version += 1
        if not unseen:
            pod = orjson.loads(orjson.dumps(pod))
            pod["metadata"]["resourceVersion"] = str(self.version)
            self.history.append((self.version, "DELETED", pod))
        self._notify()

    def close_watches(self) -> None:
        """End every open watch stream cleanly, as the API server does when a watch times out."""
        self._closing += 1
        self._notify()

    def expire(self) -> None:
        """Forget the history: open watches get a 410 ERROR event, and so does any watch resumed from it."""
        self.expired_before = self.version
        self.history.clear()
        self._notify()

    def lists(self) -> list[SeenRequest]:
        return [request for request in self.requests if not request.watch]

    def watches(self) -> list[SeenRequest]:
        return [request for request in self.requests if request.watch]

    # --- the API ----------------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/api/v1/namespaces/{namespace}/pods", self._pods)])

    async def _pods(self, request: Request) -> Response:
        namespace = request.path_params["namespace"]
        params = request.query_params
        watch = params.get("watch") in ("true", "1")
        self.requests.append(
            SeenRequest(
                namespace,
                watch,
                params.get("resourceVersion"),
                params.get("labelSelector"),
                request.headers.get("authorization"),
            )
        )
        if self.token is not None and request.headers.get("authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        if self.fail_next > 0:
            self.fail_next -= 1
            return _status(500, "InternalError", "the stand-in was told to fail")
        selector = Selector(params.get("labelSelector") or "")
        if not watch:
            items = [pod for (ns, _), pod in sorted(self.pods.items()) if ns == namespace and selector.matches(pod)]
            body = {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
            return Response(orjson.dumps(body), media_type="application/json")
        since = params.get("resourceVersion")
        events = self._events(namespace, selector, since, closing=self._closing)
        return StreamingResponse(events, media_type="application/json")

    async def _events(
        self, namespace: str, selector: Selector, since: str | None, *, closing: int
    ) -> AsyncIterator[bytes]:
        if since is None or since == "":
            # No version: the current pods as ADDED, then what follows.
            cursor = self.version
            for (ns, _), pod in sorted(self.pods.items()):
                if ns == namespace and selector.matches(pod):
                    yield _line("ADDED", pod)
        else:
            cursor = int(since)
        while True:
            changed = self._changed
            if cursor < self.expired_before:
                yield _line("ERROR", _status_body(410, "Expired", f"too old resource version: {cursor}"))
                return
            for version, kind, pod in self.history:
                if version > cursor:
                    cursor = version
                    if pod["metadata"]["namespace"] == namespace and selector.matches(pod):
                        yield _line(kind, pod)
            if self._closing != closing:
                return
            await changed.wait()

    # --- bookkeeping ------------------------------------------------------------------------

    def _record(self, kind: str, pod: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        meta = pod["metadata"]
        self.pods[(meta["namespace"], meta["name"])] = pod
        self.history.append((self.version, kind, orjson.loads(orjson.dumps(pod))))
        self._notify()
        return pod

    def _copy(self, namespace: str, name: str) -> dict[str, Any]:
        return orjson.loads(orjson.dumps(self.pods[(namespace, name)]))

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        """Serve on a free 127.0.0.1 port; yields the base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: asyncio turns Nagle off
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = uvicorn.Server(
            uvicorn.Config(
                self.app(),
                loop="none",
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=1,
            )
        )
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            async with asyncio.timeout(10):
                while not server.started:
                    if task.done():
                        task.result()
                    await asyncio.sleep(0.01)
            yield self.url
        finally:
            self.close_watches()
            server.should_exit = True
            await task
            sock.close()


def _line(kind: str, obj: dict[str, Any]) -> bytes:
    return orjson.dumps({"type": kind, "object": obj}) + b"\n"


def _status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _status(code: int, reason: str, message: str) -> Response:
    return JSONResponse(_status_body(code, reason, message), status_code=code)


_TERM = re.compile(
    r"^\s*(?:(?P<key>[^\s!=,()]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s,()]*)"
    r"|(?P<skey>[^\s!=,()]+)\s+(?P<sop>in|notin)\s+\((?P<values>[^()]*)\)"
    r"|(?P<neg>!)?\s*(?P<ekey>[^\s!=,()]+))\s*$"
)


class Selector:
    """Label selector matching, written independently of the router's own parser."""

    def __init__(self, text: str) -> None:
        self.terms = [_TERM.match(term) for term in re.split(r",(?![^()]*\))", text) if term.strip()]
        if not all(self.terms):
            raise ValueError(f"bad label selector {text!r}")

    def matches(self, pod: dict[str, Any]) -> bool:
        labels: dict[str, str] = pod["metadata"].get("labels") or {}
        for term in self.terms:
            assert term is not None
            if term["key"]:
                equal = labels.get(term["key"]) == term["value"]
                if equal == (term["op"] == "!="):
                    return False
            elif term["skey"]:
                values = {value.strip() for value in term["values"].split(",")}
                inside = labels.get(term["skey"]) in values
                if inside != (term["sop"] == "in"):
                    return False
            elif (term["ekey"] in labels) == bool(term["neg"]):
                return False
        return True
