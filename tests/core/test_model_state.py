"""The model state (``dmuon.hooks.DedicatedState``) answers for itself: the modules around it
change it through its methods (``attach_overlap``, ``attach_offload``, ``without_gradient_sync``,
``reading_checkpoint``, ...), never by writing its fields, as FSDP2's hooks call its parameter
group's methods and never write its fields.

The check reads the source: an assignment (``=``, ``+=``, ``del``) to a field the state's
``__init__`` sets, on an object whose name says it is the state (``state``, ``ctx.state``,
``self._dedicated``, ...), anywhere in dmuon-core but ``hooks.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import dmuon
from dmuon.hooks import OVERLAP_ALREADY_ATTACHED, get_dedicated_state
from tests.distributed.models import TinyDecoder, proj_predicate

SOURCE = Path(dmuon.__file__).resolve().parent
HOOKS = SOURCE / "hooks.py"


def _state_fields() -> set[str]:
    """The fields ``DedicatedState.__init__`` sets on ``self``, private ones included, and its
    properties."""
    tree = ast.parse(HOOKS.read_text())
    body = next(
        cls.body
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "DedicatedState"
    )
    init = next(
        node for node in body if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    properties = {
        node.name
        for node in body
        if isinstance(node, ast.FunctionDef)
        and any(getattr(d, "id", None) == "property" for d in node.decorator_list)
    }
    return properties | {
        target.attr
        for node in ast.walk(init)
        for target in (
            node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        )
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }


def _names_the_state(node: ast.expr) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return "state" in name.lower() or "dedicated" in name.lower()


def writes_into_the_state(source: str, fields: set[str]) -> list[str]:
    """Every write into a field of ``fields`` on an object named as the state, as ``line:
    receiver.field``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        else:
            continue
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr in fields
                and _names_the_state(target.value)
            ):
                found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_core_module_but_hooks_writes_a_field_of_the_model_state():
    fields = _state_fields()
    assert {"gradient_listener", "requires_gradient_sync", "_checkpoint_loading"} <= fields
    offenders = {}
    for path in sorted(SOURCE.rglob("*.py")):
        writes = writes_into_the_state(path.read_text(), fields) if path != HOOKS else []
        if writes:
            offenders[str(path.relative_to(SOURCE))] = writes
    assert offenders == {}, "call a method of DedicatedState instead (or give it one)"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("state.fsdp_reducers = found", ["1: state.fsdp_reducers"]),
        ("ctx.state.masters_loaded = True", ["1: ctx.state.masters_loaded"]),
        ("self._dedicated.gradient_listener = overlap", ["1: self._dedicated.gradient_listener"]),
        ("state.gradient_generation += 1", ["1: state.gradient_generation"]),
        ("del state.profile", ["1: state.profile"]),
        ("stack.mesh = experts.mesh\nstate.other = 1\nx = state.mesh", []),
    ],
)
def test_the_state_write_check_finds_each_kind_of_write(source, expected):
    fields = {"fsdp_reducers", "masters_loaded", "gradient_listener", "gradient_generation"}
    assert writes_into_the_state(source, fields | {"profile", "mesh"}) == expected


def test_the_fields_that_others_change_through_methods_cannot_be_written_from_outside():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    state = get_dedicated_state(model)
    for field in (
        "gradient_listener",
        "requires_gradient_sync",
        "checkpoint_loading",
        "checkpoint_reading",
        "fsdp_reducers",
    ):
        with pytest.raises(AttributeError):
            setattr(state, field, None)
    with state.without_gradient_sync():
        assert state.requires_gradient_sync is False
    assert state.requires_gradient_sync is True


def test_a_second_overlapped_optimizer_on_one_model_is_refused_by_the_state():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    dmuon.Muon(model, lr=0.01, overlap_step=True)
    with pytest.raises(ValueError) as caught:
        dmuon.Muon(model, lr=0.01, overlap_step=True)
    assert str(caught.value) == OVERLAP_ALREADY_ATTACHED


def test_offloaded_masters_are_registered_on_their_parameters_by_the_state():
    model = TinyDecoder()
    dmuon.dedicate_params(
        model, None, proj_predicate, param_policy={"defaults": {"param_dtype": torch.bfloat16}}
    )
    state = get_dedicated_state(model)
    state.ensure_adopted()
    masters = [p.master for p in state.iter_owned_masters() if p.fqn.endswith("q_proj.weight")]
    offload = state.attach_offload(masters)
    offloaded = {p.fqn for p in state.params.values() if p.offload is offload}
    assert offloaded == {f"layers.{i}.q_proj.weight" for i in range(3)}
    assert all(isinstance(p.master, nn.Parameter) for p in offload.params)
