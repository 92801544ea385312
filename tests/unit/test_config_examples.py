from __future__ import annotations

from pathlib import Path

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
    values.pop("tokenizer", None)  # a path on the example's target machine
    Settings.model_validate(values)
