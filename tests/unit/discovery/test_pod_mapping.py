"""Which pods become which endpoints: readiness, the URL, the role selectors, and the settings."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from lightkube import operators
from lightkube.core.selector import build_selector
from lightkube.resources.core_v1 import Pod

from dpd_router.config import Settings, SettingsError, load_settings
from dpd_router.pool.discovery import parse_selector, pod_ready, pod_url, role_selector

PORT_ANNOTATION = "dpd-router.io/port"


def pod(
    *,
    ip: str | None = "10.0.0.7",
    ready: str | None = "True",
    terminating: bool = False,
    annotations: dict[str, str] | None = None,
) -> Pod:
    """A pod as the API server sends it."""
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": ready})
    metadata: dict[str, Any] = {"name": "decode-0", "uid": "u-1", "annotations": annotations or {}}
    if terminating:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": conditions}
    if ip is not None:
        status["podIP"] = ip
    return Pod.from_dict({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "status": status})


def url_of(p: Pod, port: int = 8000) -> str | None:
    return pod_url(p, port=port, port_annotation=PORT_ANNOTATION)


def test_a_running_pod_with_ready_true_takes_traffic() -> None:
    assert pod_ready(pod())


@pytest.mark.parametrize(
    "unready",
    [
        pod(ready="False"),
        pod(ready="Unknown"),
        pod(ready=None),
        pod(ip=None),
        pod(terminating=True),
    ],
    ids=["ready_false", "ready_unknown", "no_ready_condition", "no_ip_yet", "terminating"],
)
def test_pods_that_are_not_ready_or_are_terminating_take_none(unready: Pod) -> None:
    assert not pod_ready(unready)


def test_the_url_is_the_pod_ip_and_the_configured_port() -> None:
    assert url_of(pod(), port=8000) == "http://10.0.0.7:8000"


def test_a_port_annotation_overrides_the_configured_port() -> None:
    assert url_of(pod(annotations={PORT_ANNOTATION: "8100"}), port=8000) == "http://10.0.0.7:8100"


@pytest.mark.parametrize("bad", ["http", "0", "70000", ""])
def test_a_pod_with_an_unreadable_port_annotation_is_skipped_loudly(bad: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dpd_router.discovery"):
        assert url_of(pod(annotations={PORT_ANNOTATION: bad})) is None
    assert "not a port number" in caplog.text


def test_an_ipv6_pod_ip_is_bracketed() -> None:
    assert url_of(pod(ip="fd00::7")) == "http://[fd00::7]:8000"


def test_a_pod_without_an_ip_has_no_url() -> None:
    assert url_of(pod(ip=None)) is None


def kubernetes_settings(**extra: Any) -> Settings:
    return load_settings(discovery="kubernetes", **extra)


def test_each_role_is_selected_by_the_role_label_and_the_common_selector() -> None:
    settings = kubernetes_settings(kubernetes_selector="app.kubernetes.io/instance=chat")
    assert role_selector(settings, "prefill") == "dpd-router.io/role=prefill,app.kubernetes.io/instance=chat"
    assert role_selector(settings, "decode") == "dpd-router.io/role=decode,app.kubernetes.io/instance=chat"


def test_the_role_label_is_configurable() -> None:
    settings = kubernetes_settings(kubernetes_role_label="example.com/pool")
    assert role_selector(settings, "decode") == "example.com/pool=decode"


def test_a_role_selector_replaces_the_role_label_rule_for_that_role() -> None:
    settings = kubernetes_settings(kubernetes_prefill_selector="app=vllm-prefill,tier in (gpu,h100)")
    assert role_selector(settings, "prefill") == "app=vllm-prefill,tier in (gpu,h100)"
    assert role_selector(settings, "decode") == "dpd-router.io/role=decode"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a=b", [("a", operators.equal("b"))]),
        ("a==b", [("a", operators.equal("b"))]),
        ("a!=b", [("a", operators.not_equal("b"))]),
        ("example.com/role in (prefill, decode)", [("example.com/role", operators.in_(["prefill", "decode"]))]),
        ("tier notin (cpu)", [("tier", operators.not_in(["cpu"]))]),
        ("gpu", [("gpu", operators.exists())]),
        ("!canary", [("canary", operators.not_exists())]),
        (
            "dpd-router.io/role=decode, app.kubernetes.io/instance=chat ,!canary",
            [
                ("dpd-router.io/role", operators.equal("decode")),
                ("app.kubernetes.io/instance", operators.equal("chat")),
                ("canary", operators.not_exists()),
            ],
        ),
    ],
)
def test_label_selectors_parse_to_the_same_requirements(text: str, expected: list[tuple[str, Any]]) -> None:
    assert build_selector(parse_selector(text)) == build_selector(expected)


@pytest.mark.parametrize("bad", ["a=b=c", "a in ()", "a in (b", "=b", "a,,b", "a b"])
def test_malformed_label_selectors_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_selector(bad)


def test_kubernetes_discovery_needs_no_static_urls() -> None:
    settings = kubernetes_settings()
    assert settings.prefill_urls == [] and settings.decode_urls == []


def test_a_role_given_static_urls_keeps_them_beside_discovery() -> None:
    settings = kubernetes_settings(decode_urls="127.0.0.1:8000")
    assert settings.decode_urls == ["http://127.0.0.1:8000"]


def test_kubernetes_discovery_with_both_url_lists_set_is_refused() -> None:
    with pytest.raises(SettingsError, match="both set"):
        kubernetes_settings(prefill_urls="10.0.0.1:8000", decode_urls="10.0.0.2:8000")


def test_static_discovery_still_needs_a_decoder() -> None:
    with pytest.raises(SettingsError, match="decode_urls"):
        load_settings()


def test_kubernetes_settings_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    token = tmp_path / "token"
    token.write_text("secret")
    monkeypatch.setenv("DPD_DISCOVERY", "kubernetes")
    monkeypatch.setenv("DPD_KUBERNETES_API_URL", "127.0.0.1:6443/")
    monkeypatch.setenv("DPD_KUBERNETES_TOKEN_FILE", str(token))
    monkeypatch.setenv("DPD_KUBERNETES_NAMESPACE", "engines")
    monkeypatch.setenv("DPD_KUBERNETES_PORT", "8100")
    settings = load_settings()
    assert settings.kubernetes_api_url == "http://127.0.0.1:6443"
    assert settings.kubernetes_token_file == token
    assert (settings.kubernetes_namespace, settings.kubernetes_port) == ("engines", 8100)


def test_a_missing_token_file_is_named() -> None:
    with pytest.raises(SettingsError, match="kubernetes_token_file"):
        kubernetes_settings(kubernetes_token_file="/nonexistent/token")
