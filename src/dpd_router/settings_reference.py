"""The configuration reference, generated from the Settings model's own metadata.

The docs site's configuration page is built from this (docs/hooks/settings_reference.py), so the
reference cannot drift from the code: every setting's YAML name, environment variable, command-line
flag, type, default, whether it is live, and its description. `python -m dpd_router.settings_reference`
prints the same Markdown.
"""

from __future__ import annotations

import json
import types
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import NoDecode

from dpd_router.config import SETTING_GROUPS, Settings, is_live, setting_group

# Command-line flags that are not in cli.SERVE_FLAGS' one-to-one table: setting -> flag.
_OTHER_FLAGS = {"config": "--config FILE", "prefill_urls": "--prefill URL", "decode_urls": "--decode URL"}


def cli_flags() -> dict[str, str]:
    """Setting name -> the `dpd-router serve` flag that sets it, for the settings that have one."""
    from dpd_router.cli import SERVE_FLAGS

    flags = {name: flag for flag, (name, _, _) in SERVE_FLAGS.items()}
    return {**flags, **_OTHER_FLAGS}


def env_name(name: str) -> str:
    if name == "config":
        return "DPD_CONFIG"
    prefix = Settings.model_config.get("env_prefix") or ""
    return f"{prefix}{name}".upper()


def describe_type(annotation: Any) -> str:
    """A reader's name for a field's type: `integer`, `one of a, b`, `list of string`, ..."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin in (Union, types.UnionType):
        present = [arg for arg in args if arg is not type(None)]
        text = " or ".join(describe_type(arg) for arg in present)
        return f"{text} (optional)" if len(present) < len(args) else text
    if origin is not None and str(origin).endswith("Annotated"):
        return describe_type(args[0])
    if hasattr(annotation, "__metadata__"):
        return describe_type(annotation.__origin__)
    if origin is list:
        return f"list of {describe_type(args[0])}"
    if origin is dict:
        return f"map of {describe_type(args[0])} to {describe_type(args[1])}"
    names = {int: "integer", float: "number", str: "string", bool: "boolean", Path: "path"}
    if annotation in names:
        return names[annotation]
    if annotation is SecretStr:
        return "secret string"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"object ({', '.join(annotation.model_fields)})"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(f"`{member.value}`" for member in annotation)
    return getattr(annotation, "__name__", str(annotation))


def describe_bounds(field: FieldInfo) -> str:
    """A field's numeric bounds and minimum length, as `≥ 1, ≤ 65535`."""
    words = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            words.append(f"≥ {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            words.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            words.append(f"≤ {item.le}")
        elif isinstance(item, annotated_types.Lt):
            words.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.MinLen) and item.min_length > 0:
            words.append(f"at least {item.min_length} long")
    return ", ".join(words)


def default_of(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return None if field.default is PydanticUndefined else field.default


def describe_default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = default_of(field)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    if isinstance(value, int | float):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def _comma_separated(field: FieldInfo) -> bool:
    """Lists marked NoDecode are read from the environment as comma-separated text, not JSON."""
    return any(item is NoDecode or isinstance(item, NoDecode) for item in field.metadata)


def _is_model(annotation: Any) -> bool:
    """A pydantic model, optional or not: read from the environment as JSON."""
    kinds = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return any(isinstance(kind, type) and issubclass(kind, BaseModel) for kind in kinds)


def setting_entry(name: str, field: FieldInfo, flags: dict[str, str]) -> str:
    kind = describe_type(field.annotation)
    bounds = describe_bounds(field)
    if bounds:
        kind = f"{kind}, {bounds}"
    env = f"`{env_name(name)}`"
    if _comma_separated(field):
        env += " (comma-separated)"
    elif get_origin(field.annotation) is dict or _is_model(field.annotation):
        env += " (JSON)"
    facts = [
        f"**env** {env}",
        f"**flag** `{flags[name]}`" if name in flags else "**flag** none",
        f"**type** {kind}",
        f"**default** {describe_default(field)}",
        "**live**" if is_live(name) else "**restart**",
    ]
    return f"### `{name}`\n\n{' · '.join(facts)}\n\n{field.description}\n"


def render_markdown(heading_level: int = 2) -> str:
    """The reference: one section per group, in SETTING_GROUPS' order, one entry per setting."""
    flags = cli_flags()
    by_group: dict[str, list[str]] = {group: [] for group in SETTING_GROUPS}
    for name in Settings.model_fields:
        by_group[setting_group(name)].append(name)
    hashes = "#" * heading_level
    parts = []
    for group, names in by_group.items():
        title, intro = SETTING_GROUPS[group]
        parts.append(f"{hashes} {title}\n\n{intro}\n")
        for name in names:
            entry = setting_entry(name, Settings.model_fields[name], flags)
            parts.append(entry.replace("### ", "#" * (heading_level + 1) + " ", 1))
    return "\n".join(parts)


def main() -> None:
    print(render_markdown())


if __name__ == "__main__":
    main()
