"""Structural schemas for the Prometheus Operator's custom resources the chart renders.

kubernetes-validate knows only the built-in kinds, so these are checked against the subset of the
monitoring.coreos.com/v1 CRDs' OpenAPI schemas that the chart may use: the real field names (an
unknown or misspelt field fails), their types, the required fields, and the duration and label-name
formats the operator enforces.
"""

from __future__ import annotations

from typing import Any

import jsonschema

DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


RELABEL = _object(
    {
        "action": {
            "enum": [
                "replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
                "lowercase", "uppercase", "keepequal", "dropequal",
                "Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep",
                "Lowercase", "Uppercase", "KeepEqual", "DropEqual",
            ]
        },
        "sourceLabels": {"type": "array", "items": LABEL_NAME},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
    }
)  # fmt: skip
LABEL_SELECTOR = _object(
    {
        "matchLabels": STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": _object(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                required=("key", "operator"),
            ),
        },
    }
)
NAMESPACE_SELECTOR = _object({"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}})
ENDPOINT_FIELDS = {
    "port": {"type": "string"},
    "path": {"type": "string"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": {"type": "boolean"},
    "relabelings": {"type": "array", "items": RELABEL},
    "metricRelabelings": {"type": "array", "items": RELABEL},
}
METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}


def _resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _object(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        required=("apiVersion", "kind", "metadata", "spec"),
    )


SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _resource(
        "ServiceMonitor",
        _object(
            {
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": LABEL_SELECTOR,
                "namespaceSelector": NAMESPACE_SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": _object(ENDPOINT_FIELDS)},
                "sampleLimit": {"type": "integer"},
            },
            required=("selector", "endpoints"),
        ),
    ),
    "PodMonitor": _resource(
        "PodMonitor",
        _object(
            {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": LABEL_SELECTOR,
                "namespaceSelector": NAMESPACE_SELECTOR,
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _object(ENDPOINT_FIELDS)},
                "sampleLimit": {"type": "integer"},
            },
            required=("selector", "podMetricsEndpoints"),
        ),
    ),
    "PrometheusRule": _resource(
        "PrometheusRule",
        _object(
            {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": _object(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    **_object(
                                        {
                                            "alert": {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"},
                                            "record": LABEL_NAME,
                                            "expr": {"type": "string", "minLength": 1},
                                            "for": DURATION,
                                            "keep_firing_for": DURATION,
                                            "labels": STRING_MAP,
                                            "annotations": STRING_MAP,
                                        },
                                        required=("expr",),
                                    ),
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                },
                            },
                        },
                        required=("name", "rules"),
                    ),
                }
            },
            required=("groups",),
        ),
    ),
}


def validate_custom_resource(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when `obj` does not fit its CRD's schema."""
    jsonschema.Draft202012Validator(SCHEMAS[obj["kind"]]).validate(obj)
