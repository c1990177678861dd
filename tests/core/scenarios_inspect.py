"""Scenarios for ``dmuon.inspect`` on every rank of a gloo pool.

Each prepares the tiny decoder of ``tests/distributed/models.py`` on a real mesh and returns
what the views say as plain values (views hold the mesh, whose process groups do not pickle).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.inspect import OwnerCoord, what_if_grid
from tests.distributed.models import TinyDecoder, proj_predicate

# Every projection and bias: matrices on the Muon route, the o_proj biases on AdamW.
PROJ_AND_BIAS = "proj"


def _meshes(replicas: int):
    world = dist.get_world_size()
    if replicas == 1:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)), None
    mesh = init_device_mesh(
        "cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
    )
    return mesh["shard"], mesh["replicate"]


def views_before_and_after_adoption(replicas: int) -> dict:
    """A meta-device model's view before adoption and after ``dmuon.Muon`` adopted it."""
    with torch.device("meta"):
        model = TinyDecoder()
    shard_mesh, replicate_mesh = _meshes(replicas)
    dmuon.dedicate_params(
        model,
        shard_mesh,
        lambda name, param: PROJ_AND_BIAS in name,
        replicate_mesh=replicate_mesh,
        param_policy={"defaults": {"param_dtype": torch.bfloat16}},
    )
    before = dmuon.inspect.view(model)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    _ddp = torch.nn.parallel.DistributedDataParallel(model)  # replicated, so Muon takes it
    optimizer = dmuon.Muon(model)
    after = dmuon.inspect.view(model)
    grid = after.grid
    return {
        "rank": dist.get_rank(),
        "adopted": (before.is_adopted, after.is_adopted),
        "boundaries_before": before.boundaries,
        "boundaries_after": after.boundaries,
        "coord": grid.coord,
        "rank_grid": grid.rank_grid,
        "what_if_ranks_agree": all(
            grid.owner_rank(OwnerCoord(shard, replicate))
            == what_if_grid(grid.num_shards, grid.num_replicas).owner_rank(
                OwnerCoord(shard, replicate)
            )
            for shard in range(grid.num_shards)
            for replicate in range(grid.num_replicas)
        ),
        "params": {
            name: {
                "owner": p.owner,
                "owner_rank": p.owner_rank,
                "is_owner": p.is_owner,
                "route": p.route,
                "master_dtype": p.master_dtype,
                "group": _route_of_group_holding(p.master, optimizer),
            }
            for name, p in after.params.items()
        },
    }


def _route_of_group_holding(tensor: torch.Tensor | None, optimizer) -> str | None:
    if tensor is None:
        return None
    routes = [g["route"] for g in optimizer.param_groups if any(t is tensor for t in g["params"])]
    return routes[0] if len(routes) == 1 else f"in {len(routes)} groups"


def view_of_a_one_dimensional_mesh() -> dict:
    """The grid of a plain data-parallel mesh: one replica, every rank a shard index."""
    model = TinyDecoder()
    shard_mesh, _ = _meshes(1)
    dmuon.dedicate_params(model, shard_mesh, proj_predicate)
    grid = dmuon.inspect.view(model).grid
    return {
        "rank": dist.get_rank(),
        "grid": (grid.num_shards, grid.num_replicas, grid.coord, grid.rank_grid),
    }
