"""dmuon-core's modules import each other without cycles and in one direction, as FSDP2's
``_fully_shard`` does: leaf helpers import nothing of the package; the protocol (a dedicated
parameter, its boundary, the hooks and the state they advance) never reaches what is built on it
(the setup, the integrations, the optimizer, checkpoints); the optimizer asks the state and never
the setup. Imports under ``TYPE_CHECKING`` and inside functions count (``tests/import_graph``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dmuon
from tests.import_graph import every_imported_module, first_cycle, import_graph, reachable

SOURCE = Path(dmuon.__file__).resolve().parent
GRAPH = import_graph(SOURCE)

# Imported from everywhere, so they may import nothing of the package.
LEAVES = (
    "dmuon._log",
    "dmuon._profiler_labels",
    "dmuon._text",
    "dmuon._torch_internals",
    "dmuon.collectives",
    "dmuon.consistency",
    "dmuon.fqn",
    "dmuon.muon_update",
    "dmuon.partition",
    "dmuon.policy",
    "dmuon.profile",
    "dmuon.storage",
)
PROTOCOL = ("dmuon.param", "dmuon.experts", "dmuon.group", "dmuon.hooks")
BUILT_ON_THE_PROTOCOL = {
    "dmuon",
    "dmuon.checkpoint",
    "dmuon.clip",
    "dmuon.data_parallel",
    "dmuon.ddp",
    "dmuon.dedicate",
    "dmuon.deferred",
    "dmuon.fsdp2",
    "dmuon.inspect",
    "dmuon.kernel_switch",
    "dmuon.module_state",
    "dmuon.muon_options",
    "dmuon.muon_route",
    "dmuon.optim",
    "dmuon.qk_clip",
    "dmuon.step_group",
}


def test_the_core_modules_import_each_other_without_a_cycle():
    cycle = first_cycle(GRAPH)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_leaf_module_imports_nothing_from_the_package(leaf):
    assert GRAPH[leaf] == set()


@pytest.mark.parametrize("module", PROTOCOL)
def test_the_protocol_never_reaches_what_is_built_on_it(module):
    above = {
        name
        for name in reachable(GRAPH, module)
        if name in BUILT_ON_THE_PROTOCOL or name.startswith("dmuon.checkpoint")
    }
    assert above == set()


def test_the_optimizer_asks_the_state_and_never_the_setup():
    assert "dmuon.dedicate" not in reachable(GRAPH, "dmuon.optim")


def test_the_muon_state_sits_below_the_step_machinery_that_takes_its_batch_type():
    # overlap and offload name one Newton-Schulz call by muon_state's Batch and its keys by
    # MOMENTUM_BUFFER, so muon_state must never reach them (nor the route and optimizer).
    above = {"dmuon.overlap", "dmuon.offload", "dmuon.muon_route", "dmuon.optim"}
    assert reachable(GRAPH, "dmuon.muon_state") & above == set()
    assert {"dmuon.muon_state"} <= GRAPH["dmuon.overlap"] & GRAPH["dmuon.offload"]


def test_the_muon_route_reaches_the_kernels_only_through_muon_update():
    # One road: momentum, normalisation, Newton-Schulz, the lr scale and the update are
    # muon_update's; the optimizer hands it the tensors and its NewtonSchulz.
    through_fused = {
        path.name
        for path in SOURCE.rglob("*.py")
        if "dmuon_kernels.fused" in every_imported_module(path)
    }
    assert through_fused == {"muon_update.py"}
    runs_the_iteration = [
        f"{name} line {node.lineno}: .{node.attr}"
        for name in ("optim.py", "muon_route.py", "muon_state.py")
        for node in ast.walk(ast.parse((SOURCE / name).read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in ("iterate_normalized", "normalized_buffer", "prepare")
    ]
    assert runs_the_iteration == []


def test_the_cycle_finder_finds_a_cycle_of_types():
    assert first_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert first_cycle({"a": {"b"}, "b": set()}) is None
