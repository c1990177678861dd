"""The packages depend on each other only downward: hf, tools, titan -> core -> kernels -> torch.

Above core, only its public surface: dmuon-tools, dmuon-hf and the benchmarks use ``dmuon``'s
public modules and the names in their ``__all__``, never an internal module (``dmuon.hooks``,
``dmuon.group``, ...). Benchmarks never import the test suite. ``dmuon.testing`` (the oracle the
tests and benchmarks share) stays apart from what it checks: no module of dmuon imports it, and
it reaches dmuon only through the public surface.
"""

import ast
from pathlib import Path

import pytest

from tests.import_graph import every_imported_module

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGES = REPOSITORY / "packages"
CORE = PACKAGES / "dmuon-core/src/dmuon"

# package source folder -> imports it must never make
FORBIDDEN = {
    "dmuon-kernels/src/dmuon_kernels": {"dmuon", "dmuon_hf", "dmuon_tools", "dmuon_titan"},
    "dmuon-core/src/dmuon": {"dmuon_hf", "dmuon_tools", "dmuon_titan"},
    "dmuon-tools/src/dmuon_tools": {"dmuon_hf", "dmuon_titan"},
    "dmuon-hf/src/dmuon_hf": {"dmuon_tools", "dmuon_titan"},
    "dmuon-titan/src/dmuon_titan": {"dmuon_hf", "dmuon_tools"},
}

# dmuon's public modules (their public names are their ``__all__``); every other module is
# internal: FSDP2 keeps its ``_`` modules behind a short ``__init__`` the same way.
PUBLIC_MODULES = {
    "dmuon": CORE / "__init__.py",
    "dmuon.inspect": CORE / "inspect.py",
    "dmuon.checkpoint": CORE / "checkpoint/__init__.py",
    # The reference optimizer and tiny decoder that tests and benchmarks share.
    "dmuon.testing": CORE / "testing.py",
}

# Folders that may use only dmuon's public surface.
PUBLIC_USERS = (
    PACKAGES / "dmuon-tools/src/dmuon_tools",
    PACKAGES / "dmuon-hf/src/dmuon_hf",
    PACKAGES / "dmuon-titan/src/dmuon_titan",
    REPOSITORY / "benchmarks",
)


def _imported_top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("source", sorted(FORBIDDEN))
def test_package_never_imports_a_package_above_it(source):
    files = sorted((PACKAGES / source).rglob("*.py"))
    assert files, f"no sources found under {source}"
    offenders = {
        str(path.relative_to(PACKAGES)): sorted(_imported_top_level_names(path) & FORBIDDEN[source])
        for path in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


# ---- dmuon's public surface ---------------------------------------------------------------------


def _all_of(path: Path) -> set[str]:
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__ = [...]: a public module lists its names")


PUBLIC_NAMES = {module: _all_of(path) for module, path in PUBLIC_MODULES.items()}


def _is_public(module: str, name: str) -> bool:
    return name in PUBLIC_NAMES[module] or f"{module}.{name}" in PUBLIC_MODULES


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_dmuon_uses(source: str) -> list[str]:
    """Every use of a dmuon module or name outside the public surface, as ``line: what``."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the public dmuon module it stands for
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "dmuon":
                    continue
                if alias.name not in PUBLIC_MODULES:
                    found.add((node.lineno, f"import {alias.name}"))
                elif alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound["dmuon"] = "dmuon"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "dmuon":
                continue
            if node.module not in PUBLIC_MODULES:
                found.add((node.lineno, f"from {node.module} import ..."))
                continue
            for alias in node.names:
                if not _is_public(node.module, alias.name):
                    found.add((node.lineno, f"from {node.module} import {alias.name}"))
                elif f"{node.module}.{alias.name}" in PUBLIC_MODULES:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        chain = _dotted(node) if isinstance(node, ast.Attribute) else None
        if not chain or chain[0] not in bound:
            continue
        module = root = bound[chain[0]]
        for depth, name in enumerate(chain[1:], start=1):
            if not _is_public(module, name):
                found.add((node.lineno, ".".join([root, *chain[1 : depth + 1]])))
                break
            module = f"{module}.{name}"
            if module not in PUBLIC_MODULES:
                break  # a public name: what it holds is its own business
    return [f"{line}: {what}" for line, what in sorted(found)]


@pytest.mark.parametrize(
    "folder", PUBLIC_USERS, ids=[str(f.relative_to(REPOSITORY)) for f in PUBLIC_USERS]
)
def test_tools_hf_and_benchmarks_use_only_dmuon_public_modules_and_names(folder):
    files = sorted(folder.rglob("*.py"))
    assert files, f"no sources found under {folder}"
    offenders = {
        str(path.relative_to(REPOSITORY)): private_dmuon_uses(path.read_text()) for path in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from dmuon.hooks import get_dedicated_state", ["1: from dmuon.hooks import ..."]),
        ("import dmuon.group", ["1: import dmuon.group"]),
        ("import dmuon.partition as p", ["1: import dmuon.partition"]),
        ("from dmuon import api", ["1: from dmuon import api"]),
        ("from dmuon.inspect import BoundaryGroup", ["1: from dmuon.inspect import BoundaryGroup"]),
        ("import dmuon\ndmuon.hooks.get_dedicated_state(m)", ["2: dmuon.hooks"]),
        (
            "import dmuon.inspect\ndmuon.inspect._segment_view(s)",
            ["2: dmuon.inspect._segment_view"],
        ),
        ("from dmuon import inspect as di\ndi.DedicatedParam", ["2: dmuon.inspect.DedicatedParam"]),
        ("import dmuon.checkpoint as dckpt\ndckpt._storage.save", ["2: dmuon.checkpoint._storage"]),
        ("import dmuon\nimport dmuon.inspect\nimport dmuon.checkpoint as dckpt", []),
        ("from dmuon import Muon, inspect\ninspect.view(m).grid.owner_rank(c)", []),
        ("import dmuon\ndmuon.inspect.view(m).params\ndmuon.Muon(m).step()", []),
        ("from dmuon.inspect import OwnerCoord, plan_ownership", []),
    ],
)
def test_the_public_surface_check_finds_every_way_of_reaching_an_internal(source, expected):
    assert private_dmuon_uses(source) == expected


def test_benchmarks_never_import_the_test_suite():
    files = sorted((REPOSITORY / "benchmarks").rglob("*.py"))
    assert files
    offenders = {
        str(path.relative_to(REPOSITORY)): "imports tests"
        for path in files
        if "tests" in _imported_top_level_names(path)
    }
    assert offenders == {}


def test_no_dmuon_module_imports_the_testing_oracle():
    testing = CORE / "testing.py"
    offenders = [
        str(path.relative_to(CORE))
        for path in sorted(CORE.rglob("*.py"))
        if path != testing and "dmuon.testing" in every_imported_module(path)
    ]
    assert offenders == []


def test_the_testing_oracle_uses_only_dmuon_public_surface():
    assert private_dmuon_uses((CORE / "testing.py").read_text()) == []
