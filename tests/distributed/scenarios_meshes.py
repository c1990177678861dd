"""Scenarios of dmuon on slices of larger meshes.

Each runs on every rank of a gloo pool. The training scenarios give dmuon one dim of a 2-D named
mesh (the other dim being tensor or pipeline parallelism that dmuon does not touch) and compare
with the single-process reference of ``scenarios_protocol``, the data split over the data-parallel
dim only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_protocol import (
    TrainConfig,
    build_reference,
    current_weights,
    make_model,
    reference_step,
    relative_errors,
)


def train_on_the_dp_dim_of_a_2d_mesh(
    *,
    dims: tuple[str, str],
    process_group_policy: str,
    layers_per_stage: tuple[int, int] = (3, 3),
    clip_max_norm: float | None = None,
    steps: int = 4,
) -> dict:
    """A 2x2 mesh named ``dims`` whose second dim is "dp": dmuon and FSDP2 get ``mesh["dp"]``.

    The first dim's index picks the model (``layers_per_stage``): pipeline stages may differ,
    tensor-parallel peers hold the same plain model and run the same data-parallel training.
    """
    outer, _ = dims
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    dp_mesh = mesh["dp"]
    stage = mesh[outer].get_local_rank()
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    config = TrainConfig(
        model={"num_layers": layers_per_stage[stage]}, steps=steps, clip_max_norm=clip_max_norm
    )

    model = make_model(config)
    dmuon.dedicate_params(model, dp_mesh, proj_predicate, process_group_policy=process_group_policy)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=config.weight_decay,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )
    reference, reference_optimizer = build_reference(config)

    max_errors = []
    for batch in batches(config.steps, dp_size):
        loss = loss_fn(model, rank_rows(batch, dp_rank, dp_size))
        loss.backward()
        if clip_max_norm is not None:
            dmuon.clip_grad_norm_(model, optimizer, clip_max_norm)
        optimizer.step()
        optimizer.zero_grad()
        reference_step(reference, reference_optimizer, batch, config)
        max_errors.append(max(relative_errors(current_weights(model), reference).values()))

    ownership = get_dedicated_state(model).mesh
    return {
        "stage": stage,
        "max_errors": max_errors,
        "rank_grid": [list(row) for row in ownership.rank_grid],
        "world_group_ranks": dist.get_process_group_ranks(ownership.world_group),
    }
