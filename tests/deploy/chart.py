"""The Helm chart as the tests see it: rendered offline by Helm's own engine, as Kubernetes objects.

Helm comes from the `helm-python-sdk` wheel, which bundles Helm v4's Go SDK as a shared library
(`libhelm_c`), so rendering needs neither a `helm` binary nor a cluster nor a download.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "dpd-router"
EXAMPLES = DEPLOY / "examples"
NAMESPACE = "llm"


def example_files() -> list[Path]:
    return sorted(EXAMPLES.rglob("*.yaml"))


def example_id(path: Path) -> str:
    return str(path.relative_to(EXAMPLES))


@dataclass(frozen=True)
class Release:
    """One rendering of the chart: its values and the objects Helm produced from them."""

    name: str
    values: dict[str, Any]
    objects: list[dict[str, Any]] = field(repr=False)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [obj for obj in self.of_kind(kind) if obj["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} named {name}, found {[o['metadata']['name'] for o in found]}"
        return found[0]

    def component(self, kind: str, component: str) -> dict[str, Any]:
        found = [
            obj
            for obj in self.of_kind(kind)
            if obj["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
        return found[0]

    def router_settings(self) -> dict[str, Any]:
        config_map = self.get("ConfigMap", f"{self.fullname}-router")
        return yaml.safe_load(config_map["data"]["router.yaml"])

    @property
    def fullname(self) -> str:
        return self.name if "dpd-router" in self.name else f"{self.name}-dpd-router"


def release_name_for(values_file: Path | None) -> str:
    """Tenants install one release each, named after the tenant; other examples install `demo`."""
    if values_file is not None and values_file.stem.startswith("tenant-"):
        return values_file.stem.removeprefix("tenant-")
    return "demo"


def load_values(values_file: Path | None) -> dict[str, Any]:
    return {} if values_file is None else yaml.safe_load(values_file.read_text()) or {}


def render(values: dict[str, Any], *, name: str = "demo", namespace: str = NAMESPACE) -> Release:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name=name, namespace=namespace)
        merged = chart.merge_values(values)
    objects: list[dict[str, Any]] = []
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            continue
        for document in yaml.safe_load_all(text):
            if document:
                assert isinstance(document, dict) and "kind" in document, f"{template}: not an object: {document!r}"
                objects.append(document)
    return Release(name=name, values=merged, objects=objects)


@cache
def render_example(values_file: Path | None) -> Release:
    """The chart rendered with an example values file (None: the chart's defaults), once per session."""
    return render(load_values(values_file), name=release_name_for(values_file))


def monitoring_on(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with every monitoring object switched on."""
    monitoring = {
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    }
    return {**values, "monitoring": _deep_merge(values.get("monitoring", {}), monitoring)}


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
