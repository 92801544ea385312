"""The Helm chart with `discovery.enabled`: the router is told to watch exactly this release's engine pods."""

from __future__ import annotations

from typing import Any

import pytest

from dpd_router.config import Settings
from dpd_router.pool.discovery import role_selector
from tests.deploy.chart import NAMESPACE, Release, render
from tests.unit.discovery.kube_api import Selector


def discovering_release(**router: Any) -> Release:
    return render({"discovery": {"enabled": True}, "router": router}, name="chat")


def pod_of(release: Release, role: str) -> dict[str, Any]:
    template: dict[str, Any] = release.component("StatefulSet", role)["spec"]["template"]
    return template


def selects(settings: Settings, role: str, pod: dict[str, Any]) -> bool:
    return Selector(role_selector(settings, role)).matches(pod)


def test_the_router_watches_this_releases_engine_pods_by_role() -> None:
    release = discovering_release()
    raw = release.router_settings()
    settings = Settings.model_validate(raw)
    assert settings.discovery == "kubernetes"
    assert (settings.prefill_urls, settings.decode_urls) == ([], []), "no names to guess: both roles discovered"
    assert settings.kubernetes_namespace == NAMESPACE
    assert settings.drain_timeout == release.values["engines"]["terminationGracePeriodSeconds"]
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        pod = pod_of(release, role)
        assert selects(settings, role, pod)
        assert not selects(settings, other, pod)
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports["http"] == settings.kubernetes_port
    another_release = render({}, name="rag")
    assert not selects(settings, "decode", pod_of(another_release, "decode")), "only this release's pods"


def test_discovery_gets_the_rbac_it_needs() -> None:
    release = discovering_release()
    role = release.component("Role", "router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    pod = release.component("Deployment", "router")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True


def test_a_sidecar_router_keeps_its_own_decoder_and_discovers_the_prefillers() -> None:
    release = discovering_release(mode="sidecar")
    settings = Settings.model_validate(release.router_settings())
    assert settings.decode_urls == ["http://127.0.0.1:8000"]
    assert settings.prefill_urls == []
    decode_pod = pod_of(release, "decode")["spec"]
    assert decode_pod["automountServiceAccountToken"] is True


@pytest.mark.parametrize("enabled", [False, True])
def test_the_role_label_setting_follows_the_chart(enabled: bool) -> None:
    release = render({"discovery": {"enabled": enabled, "roleLabel": "example.com/pool"}}, name="chat")
    settings = release.router_settings()
    assert pod_of(release, "decode")["metadata"]["labels"]["example.com/pool"] == "decode"
    assert settings.get("kubernetes_role_label") == ("example.com/pool" if enabled else None)
