"""Reliability scenarios run on every rank of a gloo pool; each returns what the test checks."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh

import dmuon
import dmuon.checkpoint
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_protocol import dedicate_and_shard

_FULL = StateDictOptions(full_state_dict=True)


def muon_with_a_different_value_on_rank_1(name: str, value, default) -> str:
    """``dmuon.Muon(model, **{name: value})`` on rank 1, ``default`` elsewhere: the message."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)  # replicated, so Muon takes it
    try:
        dmuon.Muon(model, **{name: value if dist.get_rank() == 1 else default})
    except ValueError as error:
        return str(error)
    finally:
        del ddp_model
    return "no error"


def nan_gradient_on_rank_1_only(nonfinite: str, clip: bool = False) -> dict:
    """Two steps on a 1-D mesh; rank 1's second loss is NaN. Returns what each rank saw."""
    torch.manual_seed(0)
    model = TinyDecoder()
    dedicate_and_shard(model, "cpu", replicas=1, reshard_after_forward=True)
    optimizer = dmuon.Muon(model, nonfinite=nonfinite)
    rank, world = dist.get_rank(), dist.get_world_size()
    first, second = batches(2, world)
    loss_fn(model, rank_rows(first, rank, world)).backward()
    optimizer.step()
    optimizer.zero_grad()
    before = dmuon.checkpoint.get_model_state_dict(model, options=_FULL)
    loss = loss_fn(model, rank_rows(second, rank, world))
    (loss * math.nan if rank == 1 else loss).backward()
    outcome = "stepped"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if clip:
                dmuon.clip_grad_norm_(model, optimizer, 1.0, error_if_nonfinite=True)
            optimizer.step()
        except RuntimeError as error:
            outcome = f"raised: {error}"
    after = dmuon.checkpoint.get_model_state_dict(model, options=_FULL)
    return {
        "outcome": outcome,
        "warnings": [str(w.message) for w in caught if "dmuon.Muon" in str(w.message)],
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
    }


def tp_parameter_on_an_unnamed_mesh() -> str:
    """A DTensor parameter on a mesh without names (one rank is enough): the seed's TP error."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    model = TinyDecoder()
    weight = model.layers[0].q_proj.weight
    unnamed = DeviceMesh("cpu", list(range(world)))
    model.layers[0].q_proj.weight = torch.nn.Parameter(
        distribute_tensor(weight, unnamed, [Shard(0)])
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    try:
        dmuon.dedicate_params(model, mesh, proj_predicate)
    except ValueError as error:
        return str(error)
    return "no error"


def fsdp2_mixed_precision_without_a_param_policy() -> dict:
    """``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16)`` and ``dedicate_params``
    without a ``param_policy`` (the dedicated weights compute in fp32): the first forward's
    warnings from dmuon and its error."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loss_fn(model, rank_rows(batches(1, world)[0], dist.get_rank(), world))
        except RuntimeError as raised:
            error = str(raised)
    return {
        "warnings": [str(w.message) for w in caught if str(w.message).startswith("dmuon:")],
        "error": error,
    }
