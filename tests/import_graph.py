"""The import graph of one package, read from its sources: what the import-graph tests of
dmuon-kernels (tests/kernels) and dmuon-core (tests/core) check.

Every import counts, wherever it is written: at the top, inside a function, or under
``TYPE_CHECKING`` (a cycle of types is a cycle of concepts: two modules that each need the
other's class are one concept in two files). ``from a import b`` counts as importing ``a.b``
when that is a module of the package, else ``a``.
"""

from __future__ import annotations

import ast
from pathlib import Path


def package_modules(source: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package whose folder is ``source``."""

    def module_name(path: Path) -> str:
        parts = path.relative_to(source.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    return {module_name(path): path for path in sorted(source.rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports anywhere."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def every_imported_module(path: Path) -> set[str]:
    """Every module ``path`` imports, of any package, with ``from a import b`` read as both ``a``
    and ``a.b``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph(source: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself left out)."""
    modules = package_modules(source)
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]`` (the first in name order), or None."""
    state: dict[str, str] = {}  # "visiting" or "done"

    def visit(name: str, trail: list[str]) -> list[str] | None:
        if state.get(name) == "done":
            return None
        if state.get(name) == "visiting":
            return [*trail[trail.index(name) :], name]
        state[name] = "visiting"
        for imported in sorted(graph[name]):
            cycle = visit(imported, [*trail, name])
            if cycle is not None:
                return cycle
        state[name] = "done"
        return None

    for name in sorted(graph):
        cycle = visit(name, [])
        if cycle is not None:
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    pending = [start]
    while pending:
        for imported in graph[pending.pop()]:
            if imported not in seen:
                seen.add(imported)
                pending.append(imported)
    return seen
