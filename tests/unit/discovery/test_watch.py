"""Discovery against a stand-in Kubernetes API server on loopback: add, modify, delete, drain, restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from dpd_router.config import SettingsError, load_settings
from dpd_router.pool.discovery import ROLES, Discovery, kubernetes_client, parse_selector, role_selector
from dpd_router.pool.endpoint import Endpoint
from dpd_router.pool.pool import Pool
from dpd_router.record.metrics import RouterMetrics
from tests.unit.discovery.kube_api import PORT_ANNOTATION, FakeKubernetes

TOKEN = "stand-in-token"


def engine(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def kube() -> AsyncIterator[FakeKubernetes]:
    api = FakeKubernetes(token=TOKEN)
    async with api.serve():
        yield api


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


@asynccontextmanager
async def discovering(
    kube: FakeKubernetes,
    token_file: Path,
    *,
    pool: Pool | None = None,
    drain_timeout: float = 10.0,
    reserved: Collection[str] = (),
    sync_timeout: float = 5.0,
    **settings: Any,
) -> AsyncIterator[tuple[Pool, RouterMetrics]]:
    """Discovery of both roles in namespace `engines`, with a back-off short enough for tests."""
    config = load_settings(
        discovery="kubernetes",
        kubernetes_api_url=kube.url,
        kubernetes_namespace="engines",
        kubernetes_token_file=str(token_file),
        **settings,
    )
    pool = pool if pool is not None else Pool([], [])
    metrics = RouterMetrics()
    discovery = Discovery(pool, metrics, drain_timeout=drain_timeout, reserved=reserved)
    selectors = {role: parse_selector(role_selector(config, role)) for role in ROLES}
    discovery.watch_with(
        kubernetes_client(config),
        selectors,
        port=config.kubernetes_port,
        port_annotation=PORT_ANNOTATION,
        backoff_initial=0.02,
        backoff_max=0.2,
    )
    await discovery.start(sync_timeout=sync_timeout)
    try:
        yield pool, metrics
    finally:
        await discovery.close()


async def eventually(check: Callable[[], bool | Awaitable[bool]], *, within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while True:
            result = check()
            if result if isinstance(result, bool) else await result:
                return
            await asyncio.sleep(0.01)


def urls(endpoints: list[Endpoint]) -> list[str]:
    return [endpoint.url for endpoint in endpoints]


def events(metrics: RouterMetrics, role: str, event: str) -> float:
    value = metrics.registry.get_sample_value("dpd_router_discovery_events_total", {"role": role, "event": event})
    return value or 0.0


def exported(metrics: RouterMetrics, endpoint: str) -> bool:
    return metrics.registry.get_sample_value(
        "dpd_router_endpoint_in_flight_requests", {"endpoint": endpoint, "role": "decode"}
    ) is not None or (
        metrics.registry.get_sample_value(
            "dpd_router_endpoint_in_flight_requests", {"endpoint": endpoint, "role": "prefill"}
        )
        is not None
    )


async def test_ready_pods_are_in_the_pool_when_start_returns(kube: FakeKubernetes, token_file: Path) -> None:
    kube.put_pod("prefill-0", role="prefill", port=9001)
    kube.put_pod("decode-0", role="decode", port=9002)
    kube.put_pod("decode-1", role="decode", port=9003, ready=False)
    kube.put_pod("decode-2", role="decode", port=9004, ip=None, ready=False)
    kube.put_pod("web-0", role="web", port=9005)
    kube.put_pod("decode-other", role="decode", port=9006, namespace="elsewhere")

    async with discovering(kube, token_file) as (pool, metrics):
        assert urls(pool.prefillers) == [engine(9001)]
        assert urls(pool.decoders) == [engine(9002)]
        assert exported(metrics, engine(9002))
        assert events(metrics, "decode", "added") == 1

    selectors = {request.label_selector for request in kube.lists()}
    assert selectors == {"dpd-router.io/role=prefill", "dpd-router.io/role=decode"}
    assert {request.namespace for request in kube.requests} == {"engines"}
    assert {request.authorization for request in kube.requests} == {f"Bearer {TOKEN}"}


async def test_the_common_selector_narrows_both_roles(kube: FakeKubernetes, token_file: Path) -> None:
    release = {"app.kubernetes.io/instance": "chat"}
    kube.put_pod("chat-prefill-0", role="prefill", port=9001, labels=release)
    kube.put_pod("chat-decode-0", role="decode", port=9002, labels=release)
    kube.put_pod("rag-decode-0", role="decode", port=9003, labels={"app.kubernetes.io/instance": "rag"})
    async with discovering(kube, token_file, kubernetes_selector="app.kubernetes.io/instance=chat") as (pool, _):
        assert urls(pool.endpoints()) == [engine(9001), engine(9002)]


async def test_a_pod_that_becomes_ready_is_added(kube: FakeKubernetes, token_file: Path) -> None:
    kube.put_pod("decode-0", role="decode", port=9002)
    kube.put_pod("decode-1", role="decode", port=9003, ready=False)
    async with discovering(kube, token_file) as (pool, metrics):
        assert urls(pool.decoders) == [engine(9002)]
        kube.set_ready("decode-1", True)
        await eventually(lambda: urls(pool.healthy("decode")) == [engine(9002), engine(9003)])
        assert exported(metrics, engine(9003)), "exported by metrics"


async def test_a_pod_that_stops_being_ready_drains_and_leaves_after_its_last_call(
    kube: FakeKubernetes, token_file: Path
) -> None:
    kube.put_pod("decode-0", role="decode", port=9002)
    kube.put_pod("decode-1", role="decode", port=9003)
    async with discovering(kube, token_file) as (pool, metrics):
        leaving = pool.get(engine(9003))
        assert leaving is not None
        leaving.start()  # a call in flight

        kube.set_ready("decode-1", False)
        await eventually(lambda: leaving.draining)
        assert urls(pool.healthy("decode")) == [engine(9002)], "no new calls"
        await asyncio.sleep(0.05)
        assert pool.get(engine(9003)) is leaving, "still a member while its call is open"
        assert exported(metrics, engine(9003))

        leaving.finish()
        await eventually(lambda: pool.get(engine(9003)) is None)
        assert not exported(metrics, engine(9003)), "its series are gone"
        assert (events(metrics, "decode", "draining"), events(metrics, "decode", "removed")) == (1, 1)


async def test_a_pod_ready_again_while_draining_keeps_its_endpoint(kube: FakeKubernetes, token_file: Path) -> None:
    kube.put_pod("decode-0", role="decode", port=9002)
    async with discovering(kube, token_file) as (pool, metrics):
        endpoint = pool.get(engine(9002))
        assert endpoint is not None
        endpoint.start()
        kube.set_ready("decode-0", False)
        await eventually(lambda: endpoint.draining)
        kube.set_ready("decode-0", True)
        await eventually(lambda: not endpoint.draining)
        endpoint.finish()
        await asyncio.sleep(0.05)
        assert pool.decoders == [endpoint], "the same Endpoint, not removed by the cancelled drain"
        assert events(metrics, "decode", "restored") == 1


async def test_a_deleted_pod_drains_then_leaves(kube: FakeKubernetes, token_file: Path) -> None:
    kube.put_pod("prefill-0", role="prefill", port=9001)
    kube.put_pod("prefill-1", role="prefill", port=9004)
    async with discovering(kube, token_file) as (pool, _):
        leaving = pool.get(engine(9004))
        assert leaving is not None
        leaving.start()
        kube.terminate("prefill-1")
        await eventually(lambda: leaving.draining)
        kube.delete("prefill-1")
        await asyncio.sleep(0.05)
        assert leaving in pool.prefillers
        leaving.finish()
        await eventually(lambda: urls(pool.prefillers) == [engine(9001)])


async def test_a_drain_ends_after_drain_timeout_even_with_calls_open(kube: FakeKubernetes, token_file: Path) -> None:
    kube.put_pod("decode-0", role="decode", port=9002)
    async with discovering(kube, token_file, drain_timeout=0.2) as (pool, _):
        stuck = pool.get(engine(9002))
        assert stuck is not None
        stuck.start()
        started = time.monotonic()
        kube.delete("decode-0")
        await eventually(lambda: not pool.decoders)
        assert time.monotonic() - started >= 0.15


async def test_a_watch_the_server_ends_is_reopened_from_the_last_version(
    kube: FakeKubernetes, token_file: Path
) -> None:
    kube.put_pod("decode-0", role="decode", port=9002)
    async with discovering(kube, token_file) as (pool, _):
        await eventually(lambda: len(kube.watches()) == 2)
        kube.put_pod("decode-1", role="decode", port=9003)
        await eventually(lambda: len(pool.decoders) == 2)
        last_version = kube.version

        kube.close_watches()
        await eventually(lambda: len(kube.watches()) == 4)
        decode_watches = [w for w in kube.watches() if w.label_selector == "dpd-router.io/role=decode"]
        assert decode_watches[-1].resource_version == str(last_version), "resumed where it left off"
        assert len(kube.lists()) == 2, "no relist needed"

        kube.put_pod("decode-2", role="decode", port=9004)
        await eventually(lambda: len(pool.decoders) == 3)


async def test_410_gone_relists_and_catches_up_on_changes_the_watch_missed(
    kube: FakeKubernetes, token_file: Path
) -> None:
    kube.put_pod("decode-0", role="decode", port=9002)
    kube.put_pod("decode-1", role="decode", port=9003)
    async with discovering(kube, token_file) as (pool, metrics):
        await eventually(lambda: len(kube.watches()) == 2)
        kube.delete("decode-1", unseen=True)  # no watch hears of it ...
        kube.expire()  # ... and the history it was in is gone: the watch gets 410
        await eventually(lambda: urls(pool.healthy("decode")) == [engine(9002)])
        assert events(metrics, "decode", "watch_gone") == 1
        assert len(kube.lists()) == 4, "each role listed again"
        kube.put_pod("decode-2", role="decode", port=9004)
        await eventually(lambda: engine(9004) in urls(pool.decoders))


async def test_api_failures_back_off_and_start_again_with_a_list(kube: FakeKubernetes, token_file: Path) -> None:
    kube.put_pod("decode-0", role="decode", port=9002)
    async with discovering(kube, token_file) as (pool, metrics):
        await eventually(lambda: len(kube.watches()) == 2)
        kube.fail_next = 3
        kube.close_watches()
        await eventually(lambda: kube.fail_next == 0 and len(kube.watches()) >= 4)
        kube.put_pod("decode-1", role="decode", port=9003)
        await eventually(lambda: len(pool.decoders) == 2)
        assert events(metrics, "prefill", "watch_error") + events(metrics, "decode", "watch_error") == 3


async def test_startup_does_not_wait_forever_for_an_unreachable_api(token_file: Path) -> None:
    unreachable = FakeKubernetes()
    async with unreachable.serve():
        pass  # the port is closed again
    started = time.monotonic()
    async with discovering(unreachable, token_file, sync_timeout=0.3) as (pool, metrics):
        assert time.monotonic() - started < 1
        assert not pool.endpoints()
        await eventually(lambda: events(metrics, "decode", "watch_error") >= 2)


async def test_tenant_engines_are_never_taken_into_the_shared_pool(kube: FakeKubernetes, token_file: Path) -> None:
    kube.put_pod("decode-0", role="decode", port=9002)
    kube.put_pod("acme-decode-0", role="decode", port=9007)
    async with discovering(kube, token_file, reserved={engine(9007)}) as (pool, metrics):
        assert urls(pool.decoders) == [engine(9002)]
        assert events(metrics, "decode", "conflict") == 1


async def test_a_pod_both_selectors_match_serves_one_role(kube: FakeKubernetes, token_file: Path) -> None:
    kube.put_pod("both-0", port=9008, labels={"tier": "gpu"})
    async with discovering(
        kube, token_file, kubernetes_prefill_selector="tier=gpu", kubernetes_decode_selector="tier in (gpu)"
    ) as (pool, metrics):
        assert urls(pool.endpoints()) == [engine(9008)]
        assert sum(events(metrics, role, "conflict") for role in ROLES) == 1


def test_roles_given_static_urls_are_not_discovered(kube: FakeKubernetes, token_file: Path) -> None:
    settings = load_settings(
        discovery="kubernetes",
        decode_urls="127.0.0.1:8000",
        kubernetes_api_url=kube.url,
        kubernetes_token_file=str(token_file),
    )
    pool = Pool(settings.prefill_urls, settings.decode_urls)
    assert Discovery.from_settings(settings, pool, RouterMetrics()).roles == ["prefill"]


def test_in_cluster_config_without_a_service_account_is_a_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = load_settings(discovery="kubernetes")
    with pytest.raises(SettingsError, match="kubernetes_api_url"):
        Discovery.from_settings(settings, Pool([], []), RouterMetrics())


def test_a_malformed_selector_is_a_settings_error(kube: FakeKubernetes) -> None:
    settings = load_settings(discovery="kubernetes", kubernetes_api_url=kube.url, kubernetes_decode_selector="a in (")
    with pytest.raises(SettingsError, match="kubernetes_decode_selector"):
        Discovery.from_settings(settings, Pool([], []), RouterMetrics())
