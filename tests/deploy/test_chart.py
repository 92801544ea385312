"""The Helm chart rendered by Helm itself with its defaults and every example values file, each
object validated against the Kubernetes schemas, and the topology checked object by object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from dpd_router.config import Settings
from dpd_router.pool.discovery import role_selector
from tests.unit.discovery.kube_api import Selector

from .chart import (
    CHART,
    DEPLOY,
    EXAMPLES,
    NAMESPACE,
    Release,
    example_files,
    example_id,
    load_values,
    monitoring_on,
    render,
    render_example,
)
from .crds import validate_custom_resource

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
VALUES_FILES = [None, *example_files()]
VALUES_IDS = ["defaults", *map(example_id, example_files())]


def test_there_is_an_example_for_each_topology() -> None:
    names = {example_id(path) for path in example_files()}
    assert {"chat-1to1.yaml", "chat-sidecar.yaml", "rag-2to1.yaml", "rag-3to1.yaml"} <= names
    assert len([n for n in names if n.startswith("multi-tenant/")]) >= 2


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_chart_lints_clean(values_file: Path | None) -> None:
    report = helm.lint(str(CHART), load_values(values_file), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_every_object_is_valid_for_kubernetes(values_file: Path | None) -> None:
    values = load_values(values_file)
    release = render(monitoring_on(values)) if values_file is None else render_example(values_file)
    assert release.objects
    for obj in release.objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            validate_custom_resource(obj)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} (Kubernetes {version}): {exc.message} at {list(exc.absolute_path)}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                pytest.fail(f"{where}: {exc.message}")


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_router_config_holds_only_real_router_settings(values_file: Path | None) -> None:
    settings = render_example(values_file).router_settings()
    unknown = set(settings) - set(Settings.model_fields)
    assert not unknown, f"router.yaml names settings the router does not have: {sorted(unknown)}"
    settings.pop("tokenizer", None)  # a directory inside the pod's model volume
    Settings.model_validate(settings)


def model_pools(release: Release) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(model name, role, component, the pool's values) of every engine pool the release's values ask for."""
    values = release.values
    pools = [(values["model"]["name"], role, role, values[role]) for role in ("prefill", "decode")]
    for extra in values.get("extraModels") or []:
        for role in ("prefill", "decode"):
            pools.append((extra["name"], role, f"{extra['key']}-{role}", merged(values[role], extra.get(role) or {})))
    return pools


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid over `base` as Helm's mergeOverwrite does: maps merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_router_is_told_every_engine_pod_by_its_stable_name(values_file: Path | None) -> None:
    """Each model's engines (several models: each its entry of `models`), by name, or (discovery) by label."""
    release = render_example(values_file)
    settings = release.router_settings()
    several = bool(release.values.get("extraModels"))
    each = Settings.model_validate({k: v for k, v in settings.items() if k != "tokenizer"}).each_model()
    for model, role, component, pool in model_pools(release):
        statefulset = release.component("StatefulSet", component)
        service = release.get("Service", statefulset["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None", "a headless Service gives each pod a DNS name"
        pod = statefulset["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        if release.values["discovery"]["enabled"]:
            others = [c for _, r, c, _ in model_pools(release) if c != component]
            assert Selector(role_selector(each[model], role)).matches(pod), "its model finds it"
            for other in others:
                other_pod = release.component("StatefulSet", other)["spec"]["template"]
                assert not Selector(role_selector(each[model], role)).matches(other_pod), f"{other} is not its"
            continue
        count = pool["autoscaling"]["maxReplicas"] if pool["autoscaling"]["enabled"] else pool["replicas"]
        name = statefulset["metadata"]["name"]
        expected = [f"http://{name}-{i}.{name}.{NAMESPACE}.svc.cluster.local:8000" for i in range(count)]
        if role == "decode" and release.values["router"]["mode"] == "sidecar":
            expected = ["http://127.0.0.1:8000"]
        where = settings["models"][model] if several else settings
        assert where[f"{role}_urls"] == expected
    assert settings["model"] == release.values["model"]["name"]
    assert settings["host"] == "0.0.0.0"


def test_router_deployment_probes_spreads_and_survives_disruption() -> None:
    release = render_example(None)
    deployment = release.component("Deployment", "router")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    port = release.router_settings()["port"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert container["ports"][0]["containerPort"] == port
    assert deployment["spec"]["replicas"] == 2
    assert container["resources"]["requests"]["cpu"] == "2"
    assert release.router_settings()["workers"] == 2, "one router process a requested core"
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    budget = release.component("PodDisruptionBudget", "router")
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert budget["spec"]["minAvailable"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_router_reads_its_settings_from_the_configmap() -> None:
    release = render_example(None)
    pod = release.component("Deployment", "router")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    config_path = Path(env["DPD_CONFIG"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = release.get("ConfigMap", volume["configMap"]["name"])
    assert config_path.name in config_map["data"]


def test_router_reads_the_tokenizer_from_the_model_volume() -> None:
    release = render_example(EXAMPLES / "chat-1to1.yaml")
    assert release.router_settings()["tokenizer"] == "/models/Llama-3.1-8B-Instruct"
    pod = release.component("Deployment", "router")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["models"]["mountPath"] == "/models" and mounts["models"]["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"]["claimName"] == "llama-3-1-8b-instruct"


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=VALUES_IDS)
def test_engine_pools_serve_the_model_with_the_kv_connector(values_file: Path | None) -> None:
    release = render_example(values_file)
    role_label = release.values["discovery"]["roleLabel"]
    for role in ("prefill", "decode"):
        statefulset = release.component("StatefulSet", role)
        pod = statefulset["spec"]["template"]
        assert pod["metadata"]["labels"][role_label] == role, "the role label discovery uses"
        vllm = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")
        assert vllm["command"] == ["vllm", "serve"]
        flags = dict(arg.split("=", 1) for arg in vllm["args"] if arg.startswith("--") and "=" in arg)
        assert flags["--served-model-name"] == release.values["model"]["name"]
        assert flags["--port"] == "8000"
        kv_config = json.loads(flags["--kv-transfer-config"])
        connectors = kv_config.get("kv_connector_extra_config", {}).get("connectors", [kv_config])
        assert connectors[0] == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        env = {item["name"]: item for item in vllm["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        gpus = release.values[role]["tensorParallelSize"]
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert flags["--tensor-parallel-size"] == str(gpus)
        shm = next(m for m in vllm["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == shm["name"])
        assert volume["emptyDir"]["medium"] == "Memory"
        assert vllm["startupProbe"]["httpGet"]["path"] == "/health"
        assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
        if not release.values[role]["autoscaling"]["enabled"]:
            assert statefulset["spec"]["replicas"] == release.values[role]["replicas"]


def test_pools_scale_independently() -> None:
    release = render_example(EXAMPLES / "rag-2to1.yaml")
    assert release.values["prefill"]["autoscaling"]["minReplicas"] == 2
    assert release.values["decode"]["autoscaling"]["minReplicas"] == 1
    release = render(yaml.safe_load("prefill: {replicas: 3}\ndecode: {replicas: 1}"))
    assert release.component("StatefulSet", "prefill")["spec"]["replicas"] == 3
    assert release.component("StatefulSet", "decode")["spec"]["replicas"] == 1
    assert len(release.router_settings()["prefill_urls"]) == 3


def test_lmcache_variant_adds_lmcache_beside_nixl() -> None:
    release = render_example(EXAMPLES / "rag-3to1.yaml")
    pod = release.component("StatefulSet", "prefill")["spec"]["template"]["spec"]
    vllm = pod["containers"][0]
    flag = next(a for a in vllm["args"] if a.startswith("--kv-transfer-config="))
    config = json.loads(flag.split("=", 1)[1])
    assert config["kv_connector"] == "MultiConnector"
    assert [c["kv_connector"] for c in config["kv_connector_extra_config"]["connectors"]] == [
        "NixlConnector",
        "LMCacheConnectorV1",
    ]
    env = {item["name"]: item.get("value") for item in vllm["env"]}
    mount = next(m for m in vllm["volumeMounts"] if env["LMCACHE_CONFIG_FILE"].startswith(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    lmcache = yaml.safe_load(release.get("ConfigMap", volume["configMap"]["name"])["data"]["lmcache.yaml"])
    assert lmcache == release.values["engines"]["lmcache"]["config"]


def test_each_pool_autoscales_on_its_own_custom_metrics() -> None:
    release = render_example(EXAMPLES / "chat-1to1.yaml")
    signals = {}
    for role in ("prefill", "decode"):
        hpa = release.component("HorizontalPodAutoscaler", role)
        target = release.component("StatefulSet", role)
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": target["metadata"]["name"],
        }
        assert "replicas" not in target["spec"], "the HPA owns the replica count"
        signals[role] = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert signals["prefill"] == {"vllm_num_requests_waiting", "vllm_time_to_first_token_seconds_p95"}
    assert signals["decode"] == {"vllm_generation_tokens_per_second", "vllm_inter_token_latency_seconds_p95"}
    served = {rule["name"]["as"] for rule in adapter_rules()}
    assert signals["prefill"] | signals["decode"] <= served, "prometheus-adapter serves every HPA metric"


def adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    return values["rules"]["custom"]


def test_sidecar_mode_runs_a_router_in_every_decode_pod() -> None:
    release = render_example(EXAMPLES / "chat-sidecar.yaml")
    assert not release.of_kind("Deployment"), "no separate router tier"
    pod = release.component("StatefulSet", "decode")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"vllm", "router"}
    router_port = release.router_settings()["port"]
    assert router_port != 8000, "the decoder has 8000"
    assert containers["router"]["ports"] == [{"name": "router", "containerPort": router_port, "protocol": "TCP"}]
    assert containers["router"]["readinessProbe"]["httpGet"] == {"path": "/ready", "port": router_port}
    prefill_pod = release.component("StatefulSet", "prefill")["spec"]["template"]["spec"]
    assert [c["name"] for c in prefill_pod["containers"]] == ["vllm"]
    service = release.get("Service", release.fullname)
    assert (
        service["spec"]["selector"].items()
        <= release.component("StatefulSet", "decode")["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["spec"]["ports"][0]["targetPort"] == "router"


def test_discovery_rbac_lets_the_router_watch_pods() -> None:
    release = render_example(EXAMPLES / "multi-tenant" / "tenant-acme.yaml")
    role = release.component("Role", "router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = release.component("RoleBinding", "router")
    account = release.component("ServiceAccount", "router")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod = release.component("Deployment", "router")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True
    assert not render_example(None).of_kind("Role"), "off by default"


def test_tenants_get_isolated_pools() -> None:
    tenants = [render_example(path) for path in sorted((EXAMPLES / "multi-tenant").glob("*.yaml"))]
    names = [{obj["metadata"]["name"] for obj in tenant.objects} for tenant in tenants]
    assert not set.intersection(*names), "no object is shared between tenants"
    for tenant in tenants:
        node_pool = {"dpd-router.io/tenant": tenant.name}
        for role in ("prefill", "decode"):
            pod = tenant.component("StatefulSet", role)["spec"]["template"]
            assert pod["spec"]["nodeSelector"] == node_pool
            assert pod["metadata"]["labels"]["dpd-router.io/tenant"] == tenant.name
        policy = tenant.get("NetworkPolicy", f"{tenant.fullname}-engines")
        same_release = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        assert same_release["app.kubernetes.io/instance"] == tenant.name
        router_policy = tenant.get("NetworkPolicy", f"{tenant.fullname}-router")
        assert router_policy["spec"]["ingress"][0]["from"] == tenant.values["networkPolicy"]["clients"]


def test_monitors_scrape_the_router_and_the_engines() -> None:
    for values_file in (EXAMPLES / "chat-1to1.yaml", EXAMPLES / "chat-sidecar.yaml"):
        release = render_example(values_file)
        monitor = release.of_kind("ServiceMonitor")[0]
        service = release.get("Service", release.fullname)
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
        assert _relabel_targets(monitor["spec"]["endpoints"][0]) == {"dpd_release": release.name}

        pod_monitor = release.of_kind("PodMonitor")[0]
        for role in ("prefill", "decode"):
            labels = release.component("StatefulSet", role)["spec"]["template"]["metadata"]["labels"]
            assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
            (expression,) = pod_monitor["spec"]["selector"]["matchExpressions"]
            assert labels[expression["key"]] in expression["values"]
        endpoint = pod_monitor["spec"]["podMetricsEndpoints"][0]
        assert endpoint["port"] == "http"
        pool_label = next(r for r in endpoint["relabelings"] if r["targetLabel"] == "dpd_pool")
        assert pool_label["sourceLabels"] == ["__meta_kubernetes_pod_label_dpd_router_io_role"]


def _relabel_targets(endpoint: dict[str, Any]) -> dict[str, str]:
    return {r["targetLabel"]: r["replacement"] for r in endpoint["relabelings"] if "replacement" in r}


def test_dashboard_configmap_carries_the_dashboard_file() -> None:
    release = render_example(EXAMPLES / "chat-1to1.yaml")
    config_map = release.get("ConfigMap", f"{release.fullname}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    assert json.loads(config_map["data"]["dpd-router.json"]) == shipped


def test_schema_rejects_a_misspelt_value() -> None:
    with pytest.raises(helm.HelmValuesError, match="replica"):
        render({"router": {"replicaz": 3}})


@pytest.mark.parametrize(("cpu", "workers"), [("500m", 1), ("2500m", 2), ("4", 4), (3, 3), ("1.5", 1)])
def test_router_runs_a_worker_a_requested_core(cpu: str | int, workers: int) -> None:
    release = render({"router": {"resources": {"requests": {"cpu": cpu}}}})
    assert release.router_settings()["workers"] == workers


def test_router_workers_setting_wins_over_the_cpu_request() -> None:
    release = render({"router": {"settings": {"workers": 1}}})
    assert release.router_settings()["workers"] == 1


def test_router_replicas_may_scale_on_cpu_and_keep_a_disruption_budget() -> None:
    assert render_example(None).values["router"]["replicas"] >= 2, "one replica left serving through a rollout"
    release = render({"router": {"autoscaling": {"enabled": True, "maxReplicas": 8}}})
    deployment = release.component("Deployment", "router")
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    hpa = release.component("HorizontalPodAutoscaler", "router")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    (target,) = hpa["spec"]["metrics"]
    assert target["resource"]["name"] == "cpu" and target["resource"]["target"]["averageUtilization"] == 70
    assert release.component("PodDisruptionBudget", "router")["spec"]["selector"] == deployment["spec"]["selector"]
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(hpa, version, strict=True)
    assert not [
        hpa
        for hpa in render_example(None).of_kind("HorizontalPodAutoscaler")
        if hpa["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    ], "off by default: the replicas are fixed"


@pytest.mark.parametrize("target", [16, 2.5])
def test_router_replicas_may_also_scale_on_requests_in_flight_served_by_prometheus_adapter(target: float) -> None:
    autoscaling = {"enabled": True, "inFlightTarget": target}
    hpa = render({"router": {"autoscaling": autoscaling}}).component("HorizontalPodAutoscaler", "router")
    cpu, in_flight = hpa["spec"]["metrics"]
    assert cpu["resource"]["name"] == "cpu", "CPU stays: the HPA takes the larger of the two counts"
    assert in_flight == {
        "type": "Pods",
        "pods": {
            "metric": {"name": "dpd_router_in_flight_requests"},
            "target": {"type": "AverageValue", "averageValue": str(target)},
        },
    }
    rule = next(rule for rule in adapter_rules() if rule["name"]["as"] == "dpd_router_in_flight_requests")
    assert rule["seriesQuery"].startswith("dpd_router_in_flight_requests{"), "the router's own gauge, by pod"
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(hpa, version, strict=True)
    with pytest.raises(helm.HelmValuesError, match="inFlightTarget"):
        render({"router": {"autoscaling": {"enabled": True, "inFlightTarget": -1}}})


def test_limits_store_is_set_from_a_url_or_a_secret() -> None:
    assert "limits_store" not in render_example(None).router_settings()
    url = "redis://redis-master.cache:6379/0"
    assert render({"router": {"limitsStore": {"url": url}}}).router_settings()["limits_store"] == url
    Settings.model_validate({"limits_store": url, "decode_urls": ["http://decode:8000"]})
    release = render({"router": {"limitsStore": {"secretKeyRef": {"name": "router-redis", "key": "url"}}}})
    (container,) = release.component("Deployment", "router")["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env["DPD_LIMITS_STORE"]["valueFrom"] == {"secretKeyRef": {"name": "router-redis", "key": "url"}}
    with pytest.raises(helm.HelmValuesError, match="limitsStore"):
        render({"router": {"limitsStore": {"url": "http://redis:6379"}}})


def test_a_limits_store_secret_needs_its_name_and_key() -> None:
    with pytest.raises(helm.HelmValuesError, match="secretKeyRef"):
        render({"router": {"limitsStore": {"secretKeyRef": {"name": "router-redis"}}}})


def test_the_responses_store_is_a_file_on_the_state_volume_or_a_redis_url() -> None:
    release = render_example(None)
    assert release.router_settings()["responses_store"] == "/var/lib/dpd-router/responses.sqlite3"
    spec = release.component("Deployment", "router")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert {"name": "router-state", "mountPath": "/var/lib/dpd-router"} in container["volumeMounts"]
    assert {"name": "router-state", "emptyDir": {"sizeLimit": "2Gi"}} in spec["volumes"]
    url = "redis://redis-master.cache:6379/1"
    assert render({"router": {"responsesStore": {"url": url}}}).router_settings()["responses_store"] == url
    claimed = render({"router": {"responsesStore": {"volume": {"persistentVolumeClaim": {"claimName": "state"}}}}})
    volumes = claimed.component("Deployment", "router")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "router-state", "persistentVolumeClaim": {"claimName": "state"}} in volumes
    with pytest.raises(helm.HelmValuesError, match="responsesStore"):
        render({"router": {"responsesStore": {"url": "http://redis:6379"}}})


def test_each_extra_model_gets_pools_autoscalers_and_settings_of_its_own() -> None:
    release = render(
        yaml.safe_load(
            """
            model: {key: small}
            extraModels:
              - key: big
                name: org/big-model
                maxModelLen: 8192
                prefill: {replicas: 2, tensorParallelSize: 4}
                decode: {autoscaling: {enabled: true, maxReplicas: 3}}
                settings: {routing_threshold: 8192}
            """
        )
    )
    values = release.values
    settings = Settings.model_validate(release.router_settings())
    each = settings.each_model()
    assert list(each) == [values["model"]["name"], "org/big-model"]
    assert each["org/big-model"].routing_threshold == 8192
    assert each[values["model"]["name"]].routing_threshold == values["router"]["settings"]["routing_threshold"]
    model_label = values["discovery"]["modelLabel"]
    for component, served, key in (
        ("prefill", values["model"]["name"], "small"),
        ("big-prefill", "org/big-model", "big"),
        ("big-decode", "org/big-model", "big"),
    ):
        pod = release.component("StatefulSet", component)["spec"]["template"]
        assert pod["metadata"]["labels"][model_label] == key
        vllm = pod["spec"]["containers"][0]
        flags = dict(arg.split("=", 1) for arg in vllm["args"] if arg.startswith("--") and "=" in arg)
        assert flags["--served-model-name"] == served
        if served == "org/big-model":
            assert flags["--max-model-len"] == "8192"
    big_prefill = release.component("StatefulSet", "big-prefill")
    assert big_prefill["spec"]["replicas"] == 2
    assert big_prefill["spec"]["template"]["spec"]["containers"][0]["args"].count("--tensor-parallel-size=4") == 1
    assert release.component("StatefulSet", "prefill")["spec"]["replicas"] == values["prefill"]["replicas"]
    hpa = release.component("HorizontalPodAutoscaler", "big-decode")
    assert hpa["spec"]["scaleTargetRef"]["name"] == release.component("StatefulSet", "big-decode")["metadata"]["name"]
    assert hpa["spec"]["maxReplicas"] == 3
    assert len(each["org/big-model"].decode_urls) == 3, "told every pod its autoscaler may start"
    assert not release.of_kind("HorizontalPodAutoscaler")[1:], "only the pool that asked for one"
    assert release.component("PodDisruptionBudget", "big-decode")


@pytest.mark.parametrize(
    ("values", "name", "words"),
    [
        ({"router": {"mode": "sidecar"}, "extraModels": [{"key": "b", "name": "b"}]}, "chat", "sidecar"),
        ({"extraModels": [{"key": "main", "name": "b"}]}, "chat", "a key of its own"),
        ({"extraModels": [{"key": "b", "name": "b"}, {"key": "b", "name": "c"}]}, "chat", '"b" is taken'),
        ({"extraModels": [{"key": "eighteen-char-key1", "name": "b"}]}, "a-release-with-a-long-name", "52 characters"),
    ],
)
def test_extra_models_that_cannot_be_deployed_are_refused(values: dict[str, Any], name: str, words: str) -> None:
    with pytest.raises(helm.HelmError, match=words):
        render(values, name=name)
