"""Expert stacks (E, m, n) in one process: which parameters are stacks, the routing table, the
state dict, meta-device models, the AdamW route and the error messages.

The distributed protocol of stacks is tested in ``tests/distributed/test_moe.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.routing import ExpertSliceOwner
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.models import batches, loss_fn
from tests.distributed.models_moe import (
    DIM,
    HIDDEN,
    NUM_EXPERTS,
    MoEDecoder,
    expert_stack_names,
    moe_predicate,
)
from tests.reference_optim import ReferenceMuonAdamW

FP32_TOLERANCE = 1e-5
STACK_SHAPE = (NUM_EXPERTS, HIDDEN, DIM)


def fp32_muon(model, **kwargs):
    return dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        **kwargs,
    )


def reference_of(model, is_muon=moe_predicate):
    return ReferenceMuonAdamW(
        model.named_parameters(),
        is_muon,
        lr=0.02,
        weight_decay=0.01,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
        expert_stacks=[n for n in expert_stack_names(model) if is_muon(n, model.get_parameter(n))],
    )


def train_both(model, optimizer, reference, reference_optimizer, steps: int = 3) -> float:
    """Train both on the same batches; the worst relative error of any weight at the end."""
    for batch in batches(steps, 1):
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_fn(reference, batch).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    ours, theirs = model.state_dict(), reference.state_dict()
    return max(((ours[k] - theirs[k]).norm() / theirs[k].norm()).item() for k in theirs)


def test_every_selected_three_dimensional_parameter_is_an_expert_stack_by_default():
    model = MoEDecoder()
    owners = dmuon.dedicate_params(model, None, moe_predicate)
    state = get_dedicated_state(model)
    assert sorted(state.stacks) == sorted(expert_stack_names(MoEDecoder()))
    assert "layers.0.w_in[0:8]" in owners and "layers.0.w_in" not in owners


@pytest.mark.filterwarnings("ignore:dedicate_params. no (layer id|hook boundary)")
def test_a_conv1d_weight_is_one_flattened_matrix_and_expert_stacks_can_say_so_for_any_parameter():
    class WithConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 6, 3)
            self.experts = nn.Parameter(torch.randn(3, 5, 4))

    model = WithConv()
    owners = dmuon.dedicate_params(model, None, lambda name, p: p.ndim == 3)
    assert sorted(owners) == ["conv.weight", "experts[0:3]"]

    model = WithConv()
    owners = dmuon.dedicate_params(
        model, None, lambda name, p: p.ndim == 3, expert_stacks=lambda name, p: False
    )
    assert sorted(owners) == ["conv.weight", "experts"]


def test_an_expert_stacks_function_that_does_not_return_a_bool_is_refused_with_the_fix():
    with pytest.raises(TypeError) as error:
        dmuon.dedicate_params(MoEDecoder(), None, moe_predicate, expert_stacks=lambda n, p: "yes")
    assert str(error.value) == (
        "dedicate_params: expert_stacks('layers.0.w_in', param) returned 'yes'; it must return "
        "True (an (E, m, n) stack of E expert matrices) or False (one matrix, trailing dims "
        "flattened into columns)."
    )


def test_the_routing_table_shows_a_stack_as_one_muon_row_with_the_owners_of_its_slices():
    from dmuon_tools import format_routing_table

    model = MoEDecoder()
    dmuon.dedicate_params(model, None, moe_predicate)
    rows = {row.fqn: row for row in fp32_muon(model).routing()}
    stack = rows["layers.1.w_out"]
    assert stack.shape == (NUM_EXPERTS, DIM, HIDDEN)
    assert (stack.route, stack.why, stack.lr, stack.weight_decay) == (
        "muon",
        "predicate",
        0.02,
        0.01,
    )
    assert stack.owner_rank == (ExpertSliceOwner(0, NUM_EXPERTS, 0),)
    assert rows["layers.1.router.weight"].route == "sharded_adamw"
    text = " ".join(format_routing_table(rows.values()).split())
    assert "layers.1.w_out 8x20x36 muon [0:8]@0 0.02 0.01 predicate" in text


def test_the_routing_table_abbreviates_a_stack_spread_over_many_owners():
    from dmuon_tools import format_routing_table

    owners = tuple(ExpertSliceOwner(e, e + 1, e) for e in range(6))
    row = ("moe.w", (6, 4, 4), "muon", owners, 0.02, 0.0, "predicate")
    line = format_routing_table([row]).splitlines()[2]
    assert " ".join(line.split()) == (
        "moe.w 6x4x4 muon [0:1]@0 [1:2]@1 [2:3]@2 [3:4]@3 +2 slices 0.02 0 predicate"
    )


def test_expert_stacks_in_one_process_train_like_the_per_expert_reference():
    torch.manual_seed(0)
    model = MoEDecoder()
    dmuon.dedicate_params(model, None, moe_predicate)
    torch.manual_seed(0)
    reference = MoEDecoder()
    error = train_both(model, fp32_muon(model), reference, reference_of(reference))
    assert error < FP32_TOLERANCE


def test_a_stack_built_on_the_meta_device_takes_its_initialised_weights():
    torch.manual_seed(0)
    reference = MoEDecoder()
    with torch.device("meta"):
        model = MoEDecoder()
    dmuon.dedicate_params(model, None, moe_predicate)
    model.to_empty(device="cpu")
    with torch.no_grad():  # "initialise": the reference's weights, by name
        for name, param in model.named_parameters():
            if name not in get_dedicated_state(model).stacks and param.numel():
                param.copy_(reference.state_dict()[name])
        for name in get_dedicated_state(model).stacks:
            module_name, _, attr = name.rpartition(".")
            getattr(model.get_submodule(module_name), attr).copy_(reference.state_dict()[name])
    error = train_both(model, fp32_muon(model), reference, reference_of(reference))
    assert error < FP32_TOLERANCE


def test_a_stack_routed_to_adamw_trains_like_adamw_on_the_whole_stack():
    routes = {"layers.0.w_in": "adamw"}
    torch.manual_seed(0)
    model = MoEDecoder()
    dmuon.dedicate_params(model, None, moe_predicate, routes=routes)
    torch.manual_seed(0)
    reference = MoEDecoder()

    def is_muon(name, param):
        return name not in routes and moe_predicate(name, reference.get_parameter(name))

    optimizer = fp32_muon(model)
    assert {row.fqn: row.route for row in optimizer.routing()}["layers.0.w_in"] == "adamw"
    error = train_both(model, optimizer, reference, reference_of(reference, is_muon))
    assert error < FP32_TOLERANCE


def test_state_dict_and_load_state_dict_in_one_process_hold_the_whole_stack():
    model = MoEDecoder()
    dmuon.dedicate_params(model, None, moe_predicate)
    state = model.state_dict()
    assert tuple(state["layers.0.w_in"].shape) == STACK_SHAPE
    new_value = torch.randn(STACK_SHAPE)
    model.load_state_dict({**state, "layers.0.w_in": new_value})
    assert torch.equal(model.state_dict()["layers.0.w_in"], new_value)
    seen = {}
    block = model.layers[0]
    handle = block.register_forward_pre_hook(
        lambda module, args: seen.update(w_in=module.w_in.detach().clone())
    )
    model(batches(1, 1)[0])
    handle.remove()
    assert torch.equal(seen["w_in"], new_value)  # forward sees the loaded stack


def test_a_frozen_stack_stays_frozen_while_the_rest_trains_like_the_reference():
    torch.manual_seed(0)
    model = MoEDecoder()
    model.layers[0].w_in.requires_grad_(False)
    start = model.layers[0].w_in.detach().clone()
    dmuon.dedicate_params(model, None, moe_predicate)
    torch.manual_seed(0)
    reference = MoEDecoder()
    reference.layers[0].w_in.requires_grad_(False)
    optimizer = fp32_muon(model)
    assert "layers.0.w_in" not in {row.fqn for row in optimizer.routing()}
    error = train_both(model, optimizer, reference, reference_of(reference))
    assert error < FP32_TOLERANCE
    assert torch.equal(model.state_dict()["layers.0.w_in"], start)
