"""Scenarios of dmuon on slices of larger meshes, and of the process groups it creates.

Each runs on every rank of a gloo pool. The training scenarios give dmuon one dim of a 2-D named
mesh (the other dim being tensor or pipeline parallelism that dmuon does not touch) and compare
with the single-process reference of ``scenarios_protocol``, the data split over the data-parallel
dim only.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
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


def timeout_seen_by_torch(group: dist.ProcessGroup) -> float:
    """The timeout gloo applies to ``group``'s collectives, read from torch, in seconds."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def group_timeouts(
    *,
    timeout_s: float | None = None,
    dims: tuple[str, ...] = ("replicate", "shard"),
    shape: tuple[int, ...] = (2, 2),
) -> dict:
    """Timeouts of the groups dmuon creates under HSDP ("isolated" policy), and the default's.

    ``dims`` may hold more than "replicate" and "shard" (e.g. a "tp" dim): dmuon then owns
    over the ("replicate", "shard") slice of the mesh that holds this rank.
    """
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    model = TinyDecoder()
    dmuon.dedicate_params(
        model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"], timeout=timeout
    )
    ownership = get_dedicated_state(model).mesh
    groups = {
        "shard": ownership.shard_group,
        "replicate": ownership.replicate_group,
        "world": ownership.world_group,
    }
    return {
        "rank_grid": [list(row) for row in ownership.rank_grid],
        "default": timeout_seen_by_torch(dist.group.WORLD),
        **{name: timeout_seen_by_torch(group) for name, group in groups.items()},
        "world_group_ranks": dist.get_process_group_ranks(ownership.world_group),
    }


def stalled_peer_fails_the_forward_broadcast(*, stalled_rank: int) -> dict:
    """``stalled_rank`` never joins the forward's broadcasts; the others time out in them.

    No ``fully_shard``: the forward's only collectives are dmuon's broadcasts from the owners
    (every layer has owners on every rank), so nothing else can be what times out.
    """
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    if dist.get_rank() == stalled_rank:
        return {"stalled": True}
    started = time.monotonic()
    try:
        loss_fn(model, batches(1, world)[0])
    except Exception as error:
        return {"seconds": time.monotonic() - started, "error": f"{type(error).__name__}: {error}"}
    return {"seconds": time.monotonic() - started, "error": None}
