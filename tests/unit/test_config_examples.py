from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dpd_router.config import Settings

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_use_only_real_settings(path: Path) -> None:
    values = yaml.safe_load(path.read_text())
    assert isinstance(values, dict) and values
    unknown = set(values) - set(Settings.model_fields)
    assert not unknown, f"{path.name} names settings the router does not have: {sorted(unknown)}"
    Settings.model_validate(without_tokenizers(values))


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_commented_out_settings_are_real_too(path: Path) -> None:
    """`# key: value` lines are settings to uncomment: with them uncommented the file is still valid."""
    text = path.read_text()
    uncommented = re.sub(r"^# ([a-z_]+: )", r"\1", text, flags=re.MULTILINE)
    values = yaml.safe_load(uncommented)
    unknown = set(values) - set(Settings.model_fields)
    assert not unknown, f"{path.name} suggests settings the router does not have: {sorted(unknown)}"
    Settings.model_validate(without_tokenizers(values))


def without_tokenizers(values: dict[str, Any]) -> dict[str, Any]:
    """The settings without their tokenizer directories: paths on the example's target machine."""
    models = {
        name: {k: v for k, v in entry.items() if k != "tokenizer"} for name, entry in values.get("models", {}).items()
    }
    return {**{k: v for k, v in values.items() if k != "tokenizer"}, **({"models": models} if models else {})}
