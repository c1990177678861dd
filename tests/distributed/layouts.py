"""The meshes of the two data-parallel layouts most scenarios run: 1-D, or HSDP as
("replicate", "shard")."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def data_parallel_meshes(replicas: int) -> tuple[DeviceMesh, DeviceMesh | None, DeviceMesh]:
    """``(shard_mesh, replicate_mesh, fsdp_mesh)`` over every rank: the first two for
    ``dmuon.dedicate_params``, the last for ``fully_shard``. ``replicas`` > 1 is HSDP."""
    world = dist.get_world_size()
    if replicas > 1:
        mesh = init_device_mesh(
            "cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
        return mesh["shard"], mesh["replicate"], mesh
    shard_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    return shard_mesh, None, shard_mesh
