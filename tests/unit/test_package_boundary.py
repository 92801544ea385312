"""The router and the simulator stay apart: the router never imports dpd_sim, except its command line
(which starts simulated engines for `dpd-router demo` and `dpd-router sim`), and dpd_sim imports nothing
of the router it stands in front of.

Read from the source (AST), so an import inside a function, or behind TYPE_CHECKING, counts too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROUTER = SRC / "dpd_router"
SIM = SRC / "dpd_sim"
# Relative to ROUTER: the modules allowed to import dpd_sim.
ROUTER_MAY_IMPORT_SIM = {Path("cli.py")}


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, wherever it is in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            yield node.lineno, node.module
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def imports_of(files: Iterable[Path], top: str) -> list[str]:
    """'file:line: module' for each import of `top` (or a submodule of it) in `files`."""
    found = []
    for path in sorted(files):
        for line, module in imported_modules(path):
            if module == top or module.startswith(f"{top}."):
                found.append(f"{path.relative_to(SRC)}:{line}: {module}")
    return found


def modules(package: Path) -> list[Path]:
    return sorted(package.rglob("*.py"))


def test_the_packages_are_where_the_test_looks() -> None:
    assert (ROUTER / "__init__.py").is_file()
    assert (SIM / "__init__.py").is_file()
    assert not (ROUTER / "sim").exists(), "the simulator lives in src/dpd_sim, not inside the router"


def test_only_the_router_cli_imports_the_simulator() -> None:
    others = [path for path in modules(ROUTER) if path.relative_to(ROUTER) not in ROUTER_MAY_IMPORT_SIM]
    assert len(others) > 10, "the walk found the router's modules"
    assert imports_of(others, "dpd_sim") == []


def test_the_exception_is_still_needed() -> None:
    # If the CLI stops starting simulated engines, its exception above should go too.
    for allowed in ROUTER_MAY_IMPORT_SIM:
        assert imports_of([ROUTER / allowed], "dpd_sim"), f"{allowed} no longer imports dpd_sim"


def test_the_simulator_imports_nothing_of_the_router() -> None:
    assert imports_of(modules(SIM), "dpd_router") == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import dpd_sim", ["dpd_sim"]),
        ("from dpd_sim.cluster import SimCluster", ["dpd_sim.cluster"]),
        ("def f():\n    import dpd_sim.engine as e", ["dpd_sim.engine"]),
        ("import importlib\nimportlib.import_module('dpd_sim.demo')", ["dpd_sim.demo"]),
        ("from . import sim", []),
        ("import dpd_simulator", ["dpd_simulator"]),
    ],
)
def test_imported_modules_sees_every_form(tmp_path: Path, source: str, found: list[str]) -> None:
    path = tmp_path / "module.py"
    path.write_text(source + "\n")
    assert [module for _, module in imported_modules(path) if module != "importlib"] == found
