"""The package's import graph has no cycle: a module can be read, and tested, without the ones that use it.

Every `import` statement of every module of `dpd_router` counts, at any depth, including those under
`if TYPE_CHECKING:` and inside functions: a cycle hidden behind TYPE_CHECKING is still two modules that
each need the other to be understood, and a function-level import is a cycle deferred, not removed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import dpd_router

PACKAGE = Path(dpd_router.__file__).parent
# Cycles left on purpose, each with the reason (none today).
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The package's modules that the module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports the module; `from module import name`, the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: set(imported(name, path, modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_from_every_module() -> None:
    graph = import_graph()
    assert "dpd_router.config" in graph["dpd_router.live"]
    assert "dpd_router.api.auth" in graph["dpd_router.api.admin"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle() -> None:
    unexpected = [cycle for cycle in cycles(import_graph()) if frozenset(cycle) not in KNOWN_CYCLES]
    assert unexpected == [], f"modules that import each other: {unexpected}"
