"""Scenarios of ``dmuon.dedicate_before_fully_shard``: dedicating a model inside a parallelize
function the caller does not own (an engine's), on every rank of a gloo pool.

Each parallelizes the tiny decoder the way an engine does (every layer, then the root, in one
function), trains it next to the single-process reference and reports what the test asserts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import dmuon
from dmuon.hooks import find_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import batches, proj_predicate
from tests.distributed.reference_errors import relative_errors_to
from tests.distributed.scenarios_protocol import (
    TrainConfig,
    build_reference,
    make_model,
    reference_step,
    train_step,
)
from tests.distributed.shared_reference import step_on_first_rank


def engine_parallelize(model, mesh, *, shard: bool, calls: list[str]):
    """What an engine's parallelize function does, with a record of what it saw."""
    calls.append(f"dedicated before parallelize: {find_dedicated_state(model) is not None}")
    if shard:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def train_dedicated_inside_an_engines_parallelize(shard: bool, steps: int = 3) -> dict:
    config = TrainConfig(steps=steps)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = make_model(config)
    calls: list[str] = []
    with dmuon.dedicate_before_fully_shard(model, mesh, proj_predicate):
        model = engine_parallelize(model, mesh, shard=shard, calls=calls)
    state = find_dedicated_state(model)
    # FSDP2 must have skipped every dedicated parameter: none of them is a DTensor.
    sharded = {name for name, p in model.named_parameters() if hasattr(p, "device_mesh")}
    result = {
        "calls": calls,
        "dedicated": sorted(state.params),
        "sharded_dedicated": sorted(sharded & set(state.params)),
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "layers": len(model.layers),
    }
    if not shard:
        return result
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=config.weight_decay,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )
    reference, reference_optimizer = build_reference(config)
    result["max_errors"] = []
    for batch in batches(config.steps, dist.get_world_size()):
        train_step(model, optimizer, batch, config)
        step_on_first_rank(reference, reference_step, reference, reference_optimizer, batch, config)
        result["max_errors"].append(max(relative_errors_to(model, reference).values()))
    return result


def a_failing_dedication_raises_from_fully_shard() -> str:
    model = make_model(TrainConfig())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    try:
        with dmuon.dedicate_before_fully_shard(model, mesh, proj_predicate, timeout=5):
            fully_shard(model.layers[0], mesh=mesh)
    except TypeError as error:
        return str(error)
    return "no error"
