"""dmuon_kernels' own modules import each other without cycles, and the leaf modules import
nothing from the package (FSDP2's one-way chain: leaves -> registry -> dispatch -> operations ->
Newton-Schulz -> reports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dmuon_kernels

SOURCE = Path(dmuon_kernels.__file__).resolve().parent
PACKAGE = "dmuon_kernels"
# Leaf helpers: imported from everywhere, so they may import nothing of the package.
LEAVES = (
    "dmuon_kernels._env",
    "dmuon_kernels._log",
    "dmuon_kernels.syrk._cute_tiles",
    "dmuon_kernels.syrk.cache",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports anywhere (functions included): ``from a
    import b`` counts as importing a.b when that is a module, else a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def test_the_package_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    state: dict[str, str] = {}  # "visiting" or "done"

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycle = [*trail[trail.index(name) :], name]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        state[name] = "visiting"
        for imported in sorted(graph[name]):
            visit(imported, [*trail, name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_leaf_module_imports_nothing_from_the_package(leaf):
    assert import_graph()[leaf] == set()


def test_newton_schulz_is_imported_only_by_the_package_and_the_reports():
    graph = import_graph()
    importers = {name for name, imported in graph.items() if f"{PACKAGE}.newton_schulz" in imported}
    assert importers == {PACKAGE, f"{PACKAGE}.status"}
