"""Outside programs the tests drive (Debian's packages, which .ci/run installs)."""

from __future__ import annotations

import os
import shutil

import pytest


def required_tool(*commands: str, package: str, purpose: str) -> str:
    """The first of `commands` on PATH. Missing, a CI run fails (.ci/run installs `package`, so a CI run that
    skipped the test would hide a broken install step) and a local run skips, saying what to install."""
    for command in commands:
        found = shutil.which(command)
        if found is not None:
            return found
    if os.environ.get("CI"):
        pytest.fail(f"CI must run {purpose}: install Debian's {package} (.ci/run does)")
    pytest.skip(f"no {commands[0]} on this machine (apt-get install {package})")
