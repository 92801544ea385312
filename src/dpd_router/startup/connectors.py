"""The KV connector the settings name, and what its settings make likely to fail."""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

import httpx

from dpd_router.config import Settings
from dpd_router.pool.transport import EngineCalls
from dpd_router.transfer.base import ENGINE_PATHS, Connector
from dpd_router.transfer.lmcache.connector import LMCacheConnector
from dpd_router.transfer.lmcache.notify import ProxyNotifications
from dpd_router.transfer.lmcache.receivers import Receiver, ReceiverMap
from dpd_router.transfer.nixl import NixlConnector
from dpd_router.transfer.sglang import SGLangConnector
from dpd_router.transfer.shared_storage import SharedStorageConnector

# The logger operators know these warnings under (they were logged by app.py).
log = logging.getLogger("dpd_router.app")


def build_connector(settings: Settings, engines: EngineCalls) -> Connector:
    timeout = httpx.Timeout(settings.prefill_timeout, connect=settings.connect_timeout)
    if settings.kv_connector == "nixl":
        return NixlConnector(engines, timeout=timeout, path_for=ENGINE_PATHS)
    if settings.kv_connector == "shared_storage":
        return SharedStorageConnector(engines, timeout=timeout, path_for=ENGINE_PATHS)
    if settings.kv_connector == "lmcache":
        receivers = {
            url: Receiver(
                receiver.host or urlsplit(url).hostname or "127.0.0.1",
                tuple(receiver.init_ports),
                tuple(receiver.alloc_ports),
            )
            for url, receiver in settings.lmcache_receivers.items()
        }
        return LMCacheConnector(
            engines,
            timeout=timeout,
            receivers=ReceiverMap(
                settings.lmcache_receiver_init_ports, settings.lmcache_receiver_alloc_ports, receivers
            ),
            notifications=ProxyNotifications(settings.lmcache_notify_address),
            notify_timeout=settings.lmcache_notify_timeout,
            notify_count=settings.lmcache_notify_count,
            local_tokenizer=settings.tokenizer is not None,
        )
    if settings.kv_connector == "sglang":
        return SGLangConnector(
            engines,
            timeout=timeout,
            path_for=ENGINE_PATHS,
            bootstrap_port=settings.sglang_bootstrap_port,
            bootstrap_ports=settings.sglang_bootstrap_ports,
        )
    raise ValueError(f"unknown kv_connector {settings.kv_connector!r}")


def warn_about_connector(settings: Settings) -> None:
    """Log what the connector's settings make likely to fail: a notification address on the loopback
    interface that prefillers on other hosts cannot reach."""
    if settings.kv_connector != "lmcache":
        return
    host = urlsplit(settings.lmcache_notify_address.replace("*", "0.0.0.0", 1)).hostname or ""
    if not _is_loopback(host):
        return
    prefillers = _engine_urls(settings, "prefill")
    remote = sorted({url for url in prefillers if not _is_loopback(urlsplit(url).hostname or "")})
    if remote:
        log.warning(
            "lmcache_notify_address %s listens on the loopback interface, but prefillers %s are on other "
            "hosts: their ProxyNotif messages cannot reach it, and every LMCache hand-off will fail. Bind "
            "an address they can reach (for example tcp://0.0.0.0:8500) and name it in their pd_proxy_host.",
            settings.lmcache_notify_address,
            remote,
        )


def _engine_urls(settings: Settings, role: str) -> list[str]:
    urls = list(settings.prefill_urls if role == "prefill" else settings.decode_urls)
    for pools in settings.tenants.values():
        urls.extend(pools.prefill_urls if role == "prefill" else pools.decode_urls)
    return urls


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
