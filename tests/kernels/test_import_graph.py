"""dmuon_kernels' own modules import each other without cycles, and the leaf modules import
nothing from the package (FSDP2's one-way chain: leaves -> registry -> dispatch -> operations ->
Newton-Schulz -> reports)."""

from __future__ import annotations

from pathlib import Path

import pytest

import dmuon_kernels
from tests.import_graph import first_cycle, import_graph

SOURCE = Path(dmuon_kernels.__file__).resolve().parent
PACKAGE = "dmuon_kernels"
# Leaf helpers: imported from everywhere, so they may import nothing of the package.
LEAVES = (
    "dmuon_kernels._env",
    "dmuon_kernels._log",
    "dmuon_kernels.syrk._cute_tiles",
    "dmuon_kernels.syrk.cache",
)


def test_the_package_modules_import_each_other_without_a_cycle():
    cycle = first_cycle(import_graph(SOURCE))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_leaf_module_imports_nothing_from_the_package(leaf):
    assert import_graph(SOURCE)[leaf] == set()


def test_newton_schulz_is_imported_only_by_the_package_the_reports_and_the_compile_job():
    graph = import_graph(SOURCE)
    importers = {name for name, imported in graph.items() if f"{PACKAGE}.newton_schulz" in imported}
    # The background compile runs Newton-Schulz (its job) and reads a NewtonSchulz's settings.
    above = {f"{PACKAGE}.status", f"{PACKAGE}.compile_job", f"{PACKAGE}.background_compile"}
    assert importers == {PACKAGE} | above
