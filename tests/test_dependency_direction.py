"""The packages depend on each other only downward: hf, tools -> core -> kernels -> torch."""

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"

# package source folder -> imports it must never make
FORBIDDEN = {
    "dmuon-kernels/src/dmuon_kernels": {"dmuon", "dmuon_hf", "dmuon_tools"},
    "dmuon-core/src/dmuon": {"dmuon_hf", "dmuon_tools"},
    "dmuon-tools/src/dmuon_tools": {"dmuon_hf"},
    "dmuon-hf/src/dmuon_hf": {"dmuon_tools"},
}


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
