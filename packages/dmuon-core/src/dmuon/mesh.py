"""Meshes and process groups: which ranks form the shard and replicate axes of ownership.

Owns the validation of the meshes a user passes to ``dedicate_params`` (names, the HSDP 2-D
shape), the (shard, replicate) coordinates of ranks, and the process groups dmuon's collectives
run on. It must not move tensors or know about parameters.

[Note: isolated process groups]
With ``process_group_policy="isolated"`` (the default) dmuon clones the mesh's groups. dmuon issues
asynchronous collectives (a prefetched broadcast, a post-step publish) that may still be in flight
when the training loop issues its own collectives (a loss all-reduce for logging, a checkpoint
barrier). On a shared group those would be ordered behind or interleaved with dmuon's; on a
cloned group they are independent streams of work. ``"shared"`` reuses the mesh's groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon.partition import OwnerCoord

PROCESS_GROUP_POLICIES = ("isolated", "shared")

HSDP_MESH_FIX = (
    "Build a 2-D mesh with named dims and pass its two dims:\n"
    "    hsdp = init_device_mesh(device_type, (replicate_size, shard_size), "
    'mesh_dim_names=("replicate", "shard"))\n'
    '    dmuon.dedicate_params(model, hsdp["shard"], predicate, replicate_mesh=hsdp["replicate"])'
)


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnershipMesh:
    """The (shard, replicate) grid of owner slots as seen from this rank.

    ``shard_group`` holds the G ranks of this rank's replica (forward broadcasts and the first
    gradient reduce run on it); ``replicate_group`` holds the R ranks that share this rank's shard
    index (the second gradient reduce and the post-step publish run on it). Either is None when
    its axis has size 1, so single-process use issues no collective at all.
    """

    num_shards: int
    num_replicas: int
    coord: OwnerCoord
    # global rank of every slot: rank_grid[replicate][shard]
    rank_grid: tuple[tuple[int, ...], ...]
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    # every rank of the grid; used for the one-time consistency checks
    world_group: dist.ProcessGroup | None

    @property
    def num_slots(self) -> int:
        return self.num_shards * self.num_replicas

    def global_rank(self, coord: OwnerCoord) -> int:
        return self.rank_grid[coord.replicate][coord.shard]

    def is_me(self, coord: OwnerCoord) -> bool:
        return coord == self.coord

    @classmethod
    def local(cls) -> OwnershipMesh:
        """One process, everything owned locally (``mesh=None`` without torch.distributed)."""
        return cls(
            num_shards=1,
            num_replicas=1,
            coord=OwnerCoord(0, 0),
            rank_grid=((dist.get_rank() if dist.is_initialized() else 0,),),
            shard_group=None,
            replicate_group=None,
            world_group=None,
        )


def build_ownership_mesh(
    mesh: DeviceMesh | None,
    replicate_mesh: DeviceMesh | None,
    process_group_policy: str,
    timeout: timedelta | None = None,
) -> OwnershipMesh:
    """Validate the user's meshes and build the groups dmuon communicates on."""
    if process_group_policy not in PROCESS_GROUP_POLICIES:
        raise ValueError(
            f"process_group_policy={process_group_policy!r} is not one of "
            f"{PROCESS_GROUP_POLICIES}. Use 'isolated' (default: dmuon clones the mesh's process "
            "groups) or 'shared' (dmuon reuses them)."
        )
    if mesh is None:
        if replicate_mesh is not None:
            raise ValueError(
                "replicate_mesh was given but mesh is None. Pass the 'shard' dim of your HSDP "
                "mesh as mesh.\n" + HSDP_MESH_FIX
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"mesh=None but torch.distributed is initialised with world size "
                f"{dist.get_world_size()}. Pass the data-parallel DeviceMesh, e.g. "
                'init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",)).'
            )
        return OwnershipMesh.local()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}."
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be the 1-D data-parallel (shard) mesh, got a {mesh.ndim}-D mesh with "
            f"dims {mesh.mesh_dim_names}. For HSDP pass the 'shard' dim as mesh and the "
            "'replicate' dim as replicate_mesh.\n" + HSDP_MESH_FIX
        )
    if replicate_mesh is None:
        ranks = tuple(mesh.mesh.tolist())
        return _build(mesh, None, (ranks,), process_group_policy, timeout)
    rank_grid = _validate_hsdp(mesh, replicate_mesh)
    return _build(mesh, replicate_mesh, rank_grid, process_group_policy, timeout)


def _validate_hsdp(mesh: DeviceMesh, replicate_mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    if not isinstance(replicate_mesh, DeviceMesh):
        raise TypeError(
            f"replicate_mesh must be a DeviceMesh, got {type(replicate_mesh).__name__}.\n"
            + HSDP_MESH_FIX
        )
    root = replicate_mesh._get_root_mesh()
    problem = None
    if replicate_mesh.mesh_dim_names is None:
        problem = "replicate_mesh has no mesh_dim_names"
    elif replicate_mesh.ndim != 1:
        problem = (
            f"replicate_mesh is {replicate_mesh.ndim}-D (dims {replicate_mesh.mesh_dim_names})"
        )
    elif root is replicate_mesh or root.ndim != 2:
        problem = f"replicate_mesh is not a dim of a 2-D mesh (its root is {root.ndim}-D)"
    elif root.mesh_dim_names != ("replicate", "shard"):
        problem = f"the 2-D mesh is named {root.mesh_dim_names}"
    elif replicate_mesh.mesh_dim_names != ("replicate",):
        problem = f"replicate_mesh is the {replicate_mesh.mesh_dim_names} dim"
    elif mesh._get_root_mesh() is not root or mesh.mesh_dim_names != ("shard",):
        problem = (
            f"mesh (dims {mesh.mesh_dim_names}) is not the 'shard' dim of the same 2-D mesh "
            "as replicate_mesh"
        )
    if problem is not None:
        raise ValueError(
            f"HSDP needs replicate_mesh to be the 'replicate' dim of a 2-D DeviceMesh built "
            f'with mesh_dim_names=("replicate", "shard"), but {problem}.\n' + HSDP_MESH_FIX
        )
    return tuple(tuple(row) for row in root.mesh.tolist())


def _build(
    mesh: DeviceMesh,
    replicate_mesh: DeviceMesh | None,
    rank_grid: tuple[tuple[int, ...], ...],
    process_group_policy: str,
    timeout: timedelta | None,
) -> OwnershipMesh:
    rank = dist.get_rank()
    replicate, shard = next((r, row.index(rank)) for r, row in enumerate(rank_grid) if rank in row)
    num_replicas, num_shards = len(rank_grid), len(rank_grid[0])
    columns = [tuple(row[s] for row in rank_grid) for s in range(num_shards)]
    if process_group_policy == "isolated":
        # new_group is collective over the whole world: every rank creates every group, in the
        # same order, and keeps the one it belongs to.
        # Forward broadcasts and first-stage reduces sit on the critical path: on NCCL their
        # group gets a high-priority stream; the replicate axis (publish, second-stage reduce)
        # keeps the default priority, as FSDP2 splits intra- and inter-node traffic.
        shard_group = _new_groups(
            list(rank_grid), rank_grid[replicate], timeout, _high_priority_options()
        )
        replicate_group = _new_groups(columns, columns[shard], timeout, None)
        world_group = dist.new_group(timeout=timeout)
    else:
        shard_group = mesh.get_group()
        replicate_group = replicate_mesh.get_group() if replicate_mesh is not None else None
        world_group = dist.group.WORLD
    return OwnershipMesh(
        num_shards=num_shards,
        num_replicas=num_replicas,
        coord=OwnerCoord(shard, replicate),
        rank_grid=rank_grid,
        shard_group=shard_group if num_shards > 1 else None,
        replicate_group=replicate_group if num_replicas > 1 else None,
        world_group=world_group if num_shards * num_replicas > 1 else None,
    )


def _new_groups(
    all_ranks: list[tuple[int, ...]],
    mine: tuple[int, ...],
    timeout: timedelta | None,
    pg_options: object | None,
) -> dist.ProcessGroup | None:
    if len(mine) == 1:
        return None
    mine_group = None
    for ranks in all_ranks:
        group = dist.new_group(list(ranks), timeout=timeout, pg_options=pg_options)
        if ranks == mine:
            mine_group = group
    return mine_group


def _high_priority_options() -> object | None:
    if dist.get_backend() != "nccl" or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options
