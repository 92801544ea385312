"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpd_router.sim.tokenizer_kit import ensure_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small tokenizer trained for the test session; the router and the engines both load it."""
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))
