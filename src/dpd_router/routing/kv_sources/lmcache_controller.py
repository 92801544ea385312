"""The LMCache controller as a KV source for `kvaware` routing.

Per request, `POST /lookup {"tokens": [...]}` answers
`{"event_id": ..., "layout_info": {"<instance_id>": ["<location>", <matched_prefix_tokens>]}}`
(older controllers put the instances at the top level). Every instance's match is kept and routing
takes the longest, not the first key. Instances are mapped to endpoints by `lmcache_instance_ids`,
or learnt in the background with `POST /query_instance {"event_id": ..., "ip": <engine host>}` ->
`{"res": "<instance_id>"}` for engines that are alone on their host.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from dpd_router.config import Settings
from dpd_router.pool.endpoint import Endpoint
from dpd_router.record.metrics import RouterMetrics
from dpd_router.routing.request import KVHint

log = logging.getLogger("dpd_router.lmcache")

_JSON = {"Content-Type": "application/json"}


def parse_layout(body: Any) -> dict[str, int]:
    """Matched prefix tokens per LMCache instance id, from a `/lookup` answer (either shape)."""
    if not isinstance(body, dict):
        return {}
    layout = body.get("layout_info")
    if not isinstance(layout, dict):
        layout = {key: value for key, value in body.items() if key not in ("event_id", "layout_info")}
    matches: dict[str, int] = {}
    for instance, info in layout.items():
        tokens = info[1] if isinstance(info, list | tuple) and len(info) >= 2 else info
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            matches[str(instance)] = max(tokens, matches.get(str(instance), 0))
    return matches


class LMCacheController:
    """Asks an LMCache controller where a prompt's KV is; the only I/O on the request path, and bounded."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        metrics: RouterMetrics,
        *,
        lookup_timeout: float,
        probe_timeout: float,
        instance_ids: Mapping[str, str] | None = None,
    ) -> None:
        self._client = client
        self._url = url.rstrip("/")
        self._metrics = metrics
        self._lookup_timeout = lookup_timeout
        self._probe_timeout = probe_timeout
        # instance id -> endpoint URL; bounded by the pool.
        self._endpoints: dict[str, str] = {instance: url for url, instance in (instance_ids or {}).items()}
        self._warned_shared_hosts = False

    @classmethod
    def from_settings(
        cls, settings: Settings, client: httpx.AsyncClient, metrics: RouterMetrics
    ) -> LMCacheController | None:
        if settings.lmcache_controller_url is None:
            return None
        if settings.prefill_strategy != "kvaware":
            log.warning("lmcache_controller_url is set but prefill_strategy is not kvaware: not asking it")
            return None
        return cls(
            client,
            settings.lmcache_controller_url,
            metrics,
            lookup_timeout=settings.kv_lookup_timeout,
            probe_timeout=settings.health_timeout,
            instance_ids=settings.lmcache_instance_ids,
        )

    @property
    def instances(self) -> dict[str, str]:
        return dict(self._endpoints)

    async def lookup(self, token_ids: Sequence[int]) -> KVHint | None:
        """Tokens held per endpoint URL, or None when the controller did not answer within the timeout."""
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        try:
            async with asyncio.timeout(self._lookup_timeout):
                response = await self._client.post(
                    f"{self._url}/lookup", content=orjson.dumps({"tokens": tokens}), headers=_JSON
                )
            response.raise_for_status()
            body = orjson.loads(response.content)
        except TimeoutError:
            self._metrics.kv_lookups.labels("timeout").inc()
            return None
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            self._metrics.kv_lookups.labels("error").inc()
            log.debug("LMCache lookup failed: %s", exc)
            return None
        hint: dict[str, int] = {}
        for instance, matched in parse_layout(body).items():
            url = self._endpoints.get(instance)
            if url is not None:
                hint[url] = max(matched, hint.get(url, 0))
        self._metrics.kv_lookups.labels("hit" if hint else "miss").inc()
        return hint

    async def learn_instances(self, endpoints: Sequence[Endpoint]) -> None:
        """Ask the controller for the instance id of each unmapped engine alone on its host."""
        mapped = set(self._endpoints.values())
        hosts = Counter(urlsplit(endpoint.url).hostname for endpoint in endpoints)
        for endpoint in endpoints:
            host = urlsplit(endpoint.url).hostname
            if endpoint.url in mapped or not host:
                continue
            if hosts[host] > 1:
                self._warn_shared_host(host)
                continue
            instance = await self._query_instance(host)
            if instance is not None:
                self._endpoints[instance] = endpoint.url
                log.info("LMCache instance %s is %s", instance, endpoint.url)

    async def _query_instance(self, host: str) -> str | None:
        payload = {"event_id": f"dpd-query-instance-{uuid.uuid4().hex}", "ip": host}
        try:
            response = await self._client.post(
                f"{self._url}/query_instance", content=orjson.dumps(payload), headers=_JSON, timeout=self._probe_timeout
            )
            response.raise_for_status()
            body = orjson.loads(response.content)
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            log.debug("LMCache query_instance for %s failed: %s", host, exc)
            return None
        instance = body.get("res") or body.get("instance_id") if isinstance(body, dict) else None
        return str(instance) if instance else None

    def _warn_shared_host(self, host: str) -> None:
        if not self._warned_shared_hosts:
            self._warned_shared_hosts = True
            log.warning(
                "several engines share host %s: the LMCache controller cannot tell them apart by IP; "
                "set lmcache_instance_ids to map them",
                host,
            )
