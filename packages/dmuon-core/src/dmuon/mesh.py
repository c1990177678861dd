"""Meshes and process groups: which ranks form the shard and replicate axes of ownership.

Owns the validation of the meshes a user passes to ``dedicate_params`` (names, the HSDP 2-D
shape), the (shard, replicate) coordinates of ranks, and the process groups dmuon's collectives
run on, with their timeouts. It must not move tensors or know about parameters.

It works in two phases, so that a setup error on one rank can be raised on every rank before any
group exists (``dedicate_params`` runs the first phase inside ``consistency.ranks_fail_together``):
``resolve_ownership_layout`` validates this rank's meshes and reads the grid of owner slots they
span (local, no collective); ``build_ownership_mesh`` creates the groups (collective over the
default group).

[Note: HSDP by structure]
Under HSDP ``mesh`` is the shard dim and ``replicate_mesh`` the replicate dim: the argument a dim
is passed as gives its role, never its name (torchtitan's ``dp_replicate`` and ``fsdp`` work like
``replicate`` and ``shard``, and so does a dim named "shard" passed as ``replicate_mesh``). They
must be two named 1-D dims, possibly flattened ones (``mesh["dp_shard", "cp"]._flatten("fsdp")``),
of one root mesh, and orthogonal: the (replicate, shard) grid through this rank then holds
``R x G`` distinct ranks. Every mesh derived from a root (sliced, flattened or unflattened)
numbers its ranks by offsets into the root's rank list, and a 1-D dim is a linear map from its
coordinate to an offset: the offset of cell (r, s) is therefore ``offset(replicate[r]) +
offset(shard[s]) - offset(this rank)``, computed here from the two dims' own ranks alone (no
collective, no private layout), whatever the root's shape (torchtitan unflattens a 1-D "world"
mesh). Same or overlapping dims give repeated or missing offsets and are refused; every rank of
the grid computes the same grid, which ``build_ownership_mesh`` checks again.

Passing only the shard dim of a model whose other parameters FSDP2 shards over more ranks (the
replicate dim forgotten, or ``dp_shard`` where FSDP2 shards over the flattened ``dp_shard x cp``)
cannot be seen here: the mesh alone is valid. ``dmuon.data_parallel`` catches it when the
optimizer is built, by comparing the ranks of the other parameters' meshes with this grid
(``data_parallel_ranks``), leaving out the model-parallel dims recorded here
(``model_parallel_dims``: the dims of the meshes the model's parameters were already distributed
over when ``dedicate_params`` ran, tensor parallelism's).

[Note: expert meshes]
Under expert parallelism ``dedicate_params`` also takes ``ep_mesh`` (the ``ep`` dim: each of its
ranks holds other experts) and ``expert_mesh`` (the expert-FSDP dim, torchtitan's ``efsdp``:
the ranks that hold the same experts within a replica). They are two 1-D dims that split this
rank's row of the (shard, replicate) grid: ``ep_size * expert_size == num_shards``, both inside
the row, crossing at this rank alone (``resolve_expert_layout``, local). Their names and roots
do not matter (torchtitan's sparse mesh is another unflattening of the world than its dense
one). ``build_expert_mesh`` gathers every rank's (ep index, expert index) with its place on the
ownership grid, checks that every row of the grid is the full ep x expert product, and builds,
per EP slot, the *expert grid* [replicate][expert index] of the ranks that hold that slot's
experts, and an ``OwnershipMesh`` over it: its shard group is the expert-FSDP ranks, its
replicate group the HSDP replicas, so the expert pieces' broadcasts, reduces and publishes stay
inside the ranks that hold the experts. The partition sees each EP slot's ranks as owner slots
of the full grid (``ExpertLayout.expert_groups``).

[Note: isolated process groups]
With ``process_group_policy="isolated"`` (the default) dmuon clones the mesh's groups. dmuon issues
asynchronous collectives (a prefetched broadcast, a post-step publish) that may still be in flight
when the training loop issues its own collectives (a loss all-reduce for logging, a checkpoint
barrier). On a shared group those would be ordered behind or interleaved with dmuon's; on a
cloned group they are independent streams of work. ``"shared"`` reuses the mesh's groups.

[Note: groups of sub-meshes]
The meshes given to ``dedicate_params`` may be slices of a larger named mesh: ``mesh["dp"]`` of a
("dp", "tp") mesh, or each pipeline stage's ``mesh["dp"]`` of a ("pp", "dp") mesh. A rank then
knows only the ranks of its own slice, but ``dist.new_group`` is collective over the whole default
group: every rank must create every group, in one order, or the ranks block in mismatched calls.
So ``build_ownership_mesh`` first gathers every rank's grid of owner slots (one
``all_gather_object`` on the default group); then every rank creates the groups of every distinct
grid, in sorted order, and keeps its own. Hence every rank of the default group calls
``dedicate_params``, also pipeline stages whose models differ. ``world_group`` spans only this
rank's grid, so one stage's consistency checks and gradient-norm reduce never mix with another's.

[Note: group timeouts]
``dist.new_group(timeout=None)`` does not inherit the default group's timeout: it takes the
backend's default (30 min on gloo, 10 min on NCCL) whatever ``init_process_group(timeout=...)``
said. Every group dmuon creates gets ``dedicate_params(timeout=...)`` or, by default, the default
group's own timeout as its backend reports it (``process_group_timeout``), so a stalled peer fails
dmuon's collectives as soon as it would fail the trainer's.

[Note: groups end before the interpreter does]
A dedicated model's state and its hooks reference each other, so a model dropped by the
program (a training function that returned) is freed by the cyclic garbage collector, whenever
it next runs; if that is during the interpreter's teardown, the groups it holds are destroyed
after the C++ state their threads need, and the process aborts at exit ("terminate called
without an active exception": on gloo, several runs in ten). One collection at exit, while
everything is intact, frees them first.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon._torch_internals import (
    default_group,
    nccl_high_priority_options,
    process_group_timeout,
    root_mesh,
)
from dmuon.partition import OwnerCoord

atexit.register(gc.collect)  # see [Note: groups end before the interpreter does]

PROCESS_GROUP_POLICIES = ("isolated", "shared")

HSDP_MESH_FIX = (
    "Build a mesh with named dims and pass two of its dims (any names: mesh= is the shard dim, "
    "replicate_mesh= the replicate dim):\n"
    "    hsdp = init_device_mesh(device_type, (replicate_size, shard_size), "
    'mesh_dim_names=("replicate", "shard"))\n'
    '    dmuon.dedicate_params(model, hsdp["shard"], predicate, replicate_mesh=hsdp["replicate"])'
)

SAME_MESH_FIX = (
    "Build the DeviceMesh the same way on every rank (init_device_mesh with the same shape and "
    "mesh_dim_names) and pass the same dims of it to dedicate_params on every rank."
)

# Global rank of every owner slot, indexed [replicate][shard].
RankGrid = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnershipLayout:
    """This rank's validated meshes and the grid of owner slots they span; no group exists yet."""

    rank_grid: RankGrid
    process_group_policy: str
    # None: torch.distributed is not in use (or has one rank) and everything is owned locally.
    mesh: DeviceMesh | None
    replicate_mesh: DeviceMesh | None
    # The TP mesh of the dedicated tensor-parallel parameters (see ``dmuon.tp``), if any.
    tp_mesh: DeviceMesh | None = None
    # See [Note: HSDP by structure].
    model_parallel_dims: frozenset[str] = frozenset()

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        return tuple(self.tp_mesh.mesh.tolist()) if self.tp_mesh is not None else ()


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnershipMesh:
    """The (shard, replicate) grid of owner slots as seen from this rank.

    ``shard_group`` holds the G ranks of this rank's replica (forward broadcasts and the first
    gradient reduce run on it); ``replicate_group`` holds the R ranks that share this rank's shard
    index (the second gradient reduce and the post-step publish run on it). Either is None when
    its axis has size 1, so single-process use issues no collective at all. Under tensor
    parallelism ``tp_group`` holds this rank's TP ranks (global ranks ``tp_ranks``, by TP
    coordinate): the owner step's gather and scatter of TP-sharded matrices run on it.
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
    tp_ranks: tuple[int, ...] = ()
    tp_group: dist.ProcessGroup | None = None
    # The dim names of the meshes given to dedicate_params (for messages), and the dims that
    # are not data-parallel (see [Note: HSDP by structure]).
    shard_dim_names: tuple[str, ...] | None = None
    replicate_dim_names: tuple[str, ...] | None = None
    model_parallel_dims: frozenset[str] = frozenset()

    @property
    def num_slots(self) -> int:
        return self.num_shards * self.num_replicas

    def global_rank(self, coord: OwnerCoord) -> int:
        return self.rank_grid[coord.replicate][coord.shard]

    @property
    def tp_size(self) -> int:
        return max(len(self.tp_ranks), 1)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the grid, sorted."""
        return _ranks_of(self.rank_grid)

    def describe(self) -> str:
        """The meshes given to dedicate_params and the ranks of the grid, for messages."""
        shard = _dims_label(self.shard_dim_names)
        if self.num_replicas == 1 and self.replicate_dim_names is None:
            given = f"mesh {shard} and no replicate_mesh"
        else:
            given = f"mesh {shard} and replicate_mesh {_dims_label(self.replicate_dim_names)}"
        return f"{given}: its ownership grid spans ranks {list(self.ranks)}"

    def coord_of_rank(self, rank: int) -> OwnerCoord:
        """The (shard, replicate) coordinate of a global rank of the grid."""
        for replicate, row in enumerate(self.rank_grid):
            if rank in row:
                return OwnerCoord(row.index(rank), replicate)
        raise ValueError(f"rank {rank} is not in the ownership grid {self.rank_grid}")

    def slot_of_rank(self, rank: int) -> int:
        """The owner slot of a global rank (see [Note: slot order] in ``dmuon.partition``)."""
        coord = self.coord_of_rank(rank)
        return coord.replicate * self.num_shards + coord.shard

    def is_me(self, coord: OwnerCoord) -> bool:
        """This rank holds the owner's master (of its own TP chunk under TP), any ``coord.tp``."""
        return (coord.shard, coord.replicate) == (self.coord.shard, self.coord.replicate)

    @classmethod
    def on_grid(
        cls,
        rank_grid: RankGrid,
        groups: tuple[dist.ProcessGroup | None, ...],
        **dims: Any,
    ) -> OwnershipMesh:
        """This rank's mesh on ``rank_grid`` (it must hold this rank) with its ``(shard,
        replicate, world)`` groups, an axis of size 1 carrying none; ``dims``: the other
        fields."""
        rank = dist.get_rank()
        replicate, shard = next(
            (r, row.index(rank)) for r, row in enumerate(rank_grid) if rank in row
        )
        num_replicas, num_shards = len(rank_grid), len(rank_grid[0])
        shard_group, replicate_group, world_group = groups
        return cls(
            num_shards=num_shards,
            num_replicas=num_replicas,
            coord=OwnerCoord(shard, replicate),
            rank_grid=rank_grid,
            shard_group=shard_group if num_shards > 1 else None,
            replicate_group=replicate_group if num_replicas > 1 else None,
            world_group=world_group if num_shards * num_replicas > 1 else None,
            **dims,
        )

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


def resolve_ownership_layout(
    mesh: DeviceMesh | None,
    replicate_mesh: DeviceMesh | None,
    process_group_policy: str,
    tp_mesh: DeviceMesh | None = None,
    model_parallel_dims: frozenset[str] = frozenset(),
) -> OwnershipLayout:
    """Validate the user's meshes and read this rank's grid of owner slots; no collective.

    ``model_parallel_dims``: the dim names of the meshes the model's parameters are distributed
    over already (tensor parallelism), kept for ``dmuon.data_parallel``'s check."""
    if process_group_policy not in PROCESS_GROUP_POLICIES:
        raise ValueError(
            f"process_group_policy={process_group_policy!r} is not one of "
            f"{PROCESS_GROUP_POLICIES}. Use 'isolated' (default: dmuon clones the mesh's process "
            "groups) or 'shared' (dmuon reuses them)."
        )
    if mesh is None:
        if replicate_mesh is not None:
            raise ValueError(
                "replicate_mesh was given but mesh is None. Pass the shard dim of your HSDP "
                "mesh as mesh.\n" + HSDP_MESH_FIX
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"mesh=None but torch.distributed is initialised with world size "
                f"{dist.get_world_size()}. Pass the data-parallel DeviceMesh, e.g. "
                'init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",)).'
            )
        return OwnershipLayout(
            rank_grid=OwnershipMesh.local().rank_grid,
            process_group_policy=process_group_policy,
            mesh=None,
            replicate_mesh=None,
            tp_mesh=_multi_rank(tp_mesh),
            model_parallel_dims=model_parallel_dims,
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}."
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be the 1-D data-parallel (shard) mesh, got a {mesh.ndim}-D mesh with "
            f"dims {mesh.mesh_dim_names}. For HSDP pass the shard dim as mesh and the "
            "replicate dim as replicate_mesh.\n" + HSDP_MESH_FIX
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not in the mesh given to dedicate_params (ranks "
            f'{mesh.mesh.tolist()}). Pass the slice that holds this rank, e.g. mesh["dp"] of a '
            "mesh built with init_device_mesh on every rank."
        )
    if replicate_mesh is None:
        rank_grid: RankGrid = (tuple(mesh.mesh.tolist()),)
    else:
        rank_grid = _hsdp_rank_grid(mesh, replicate_mesh)
    return OwnershipLayout(
        rank_grid=rank_grid,
        process_group_policy=process_group_policy,
        mesh=mesh,
        replicate_mesh=replicate_mesh,
        tp_mesh=_multi_rank(tp_mesh),
        model_parallel_dims=model_parallel_dims,
    )


EXPERT_MESH_FIX = (
    "Pass the ep dim and the expert-FSDP dim of the mesh your experts are sharded on, which "
    "split the shard dim given as mesh (torchtitan: mesh=parallel_dims.get_mesh('fsdp'), "
    "ep_mesh=parallel_dims.get_mesh('ep'), expert_mesh=parallel_dims.get_mesh('efsdp')), e.g.\n"
    '    sparse = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))\n'
    '    dmuon.dedicate_params(model, dense["fsdp"], predicate, ep_mesh=sparse["ep"], '
    'expert_mesh=sparse["efsdp"])'
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertLayout:
    """This rank's validated expert-parallel meshes (see [Note: expert meshes]); no group yet."""

    ep_mesh: DeviceMesh
    expert_mesh: DeviceMesh

    @property
    def num_ep(self) -> int:
        return self.ep_mesh.size()

    @property
    def ep_index(self) -> int:
        return self.ep_mesh.get_local_rank()

    @property
    def expert_index(self) -> int:
        return self.expert_mesh.get_local_rank()


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertMeshes:
    """Every EP slot's owner slots on the full grid, and this rank's expert ownership mesh."""

    ep_index: int
    num_ep: int
    # expert_groups[e]: the full grid's owner slots of EP slot e, by its expert grid's slots.
    expert_groups: tuple[tuple[int, ...], ...]
    mesh: OwnershipMesh  # this rank's EP slot: its expert grid and its groups


def resolve_expert_layout(
    layout: OwnershipLayout, ep_mesh: DeviceMesh | None, expert_mesh: DeviceMesh | None
) -> ExpertLayout | None:
    """Validate the expert-parallel dims against this rank's ownership grid; no collective."""
    if ep_mesh is None and expert_mesh is None:
        return None
    problem = None
    if ep_mesh is None or expert_mesh is None:
        given, missing = (
            ("ep_mesh", "expert_mesh") if expert_mesh is None else ("expert_mesh", "ep_mesh")
        )
        problem = f"{given} was given without {missing}; expert parallelism needs both"
    elif not isinstance(ep_mesh, DeviceMesh) or not isinstance(expert_mesh, DeviceMesh):
        problem = (
            f"ep_mesh and expert_mesh must be DeviceMeshes, got {type(ep_mesh).__name__} and "
            f"{type(expert_mesh).__name__}"
        )
    elif layout.mesh is None:
        problem = "mesh is None (no data-parallel mesh to split)"
    elif ep_mesh.ndim != 1 or expert_mesh.ndim != 1:
        problem = (
            f"ep_mesh (dims {ep_mesh.mesh_dim_names}) and expert_mesh (dims "
            f"{expert_mesh.mesh_dim_names}) must be 1-D"
        )
    elif ep_mesh.get_coordinate() is None or expert_mesh.get_coordinate() is None:
        problem = f"this rank ({dist.get_rank()}) is not in ep_mesh or expert_mesh"
    elif layout.tp_mesh is not None:
        problem = "tensor parallelism with expert parallelism is not supported yet"
    else:
        row = next(row for row in layout.rank_grid if dist.get_rank() in row)
        ep_ranks, expert_ranks = ep_mesh.mesh.tolist(), expert_mesh.mesh.tolist()
        if len(ep_ranks) * len(expert_ranks) != len(row):
            problem = (
                f"ep_mesh has {len(ep_ranks)} ranks and expert_mesh {len(expert_ranks)}, whose "
                f"product is not the {len(row)} ranks of the shard dim {list(row)}"
            )
        elif not set(ep_ranks) | set(expert_ranks) <= set(row):
            problem = (
                f"ep_mesh (ranks {ep_ranks}) and expert_mesh (ranks {expert_ranks}) are not "
                f"inside this rank's shard dim (ranks {list(row)})"
            )
        elif set(ep_ranks) & set(expert_ranks) != {dist.get_rank()}:
            problem = (
                f"ep_mesh (ranks {ep_ranks}) and expert_mesh (ranks {expert_ranks}) are the same "
                "dim or overlapping dims"
            )
    if problem is not None:
        raise ValueError(f"dedicate_params: expert parallelism: {problem}.\n{EXPERT_MESH_FIX}")
    return ExpertLayout(ep_mesh=ep_mesh, expert_mesh=expert_mesh)


def build_expert_mesh(
    expert_layout: ExpertLayout,
    layout: OwnershipLayout,
    mesh: OwnershipMesh,
    timeout: timedelta | None = None,
) -> ExpertMeshes:
    """Every EP slot's expert grid and this rank's expert ``OwnershipMesh``; collective over the
    default group (see [Note: expert meshes])."""
    world_size = dist.get_world_size()
    mine = (expert_layout.ep_index, expert_layout.expert_index, mesh.rank_grid)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    width = mesh.num_shards // expert_layout.num_ep
    cells: dict[tuple[int, int, int], int] = {}  # (ep, replicate, expert index) -> rank
    for member in mesh.ranks:
        ep, index, _ = everyone[member]
        if 0 <= ep < expert_layout.num_ep and 0 <= index < width:
            cells.setdefault((ep, mesh.coord_of_rank(member).replicate, index), member)
    if len(cells) != len(mesh.ranks):
        seen = {member: tuple(everyone[member][:2]) for member in mesh.ranks}
        raise ValueError(
            "dedicate_params: expert parallelism: the (ep, expert) indices of the ranks of the "
            f"ownership grid {_as_lists(mesh.rank_grid)} are not, in every replica, each pair of "
            f"the {expert_layout.num_ep} x {width} ep x expert product once: rank -> (ep index, "
            f"expert index) {seen}.\n" + EXPERT_MESH_FIX
        )
    # Per EP slot, its expert grid [replicate][expert index].
    groups_of_grid = [
        tuple(
            tuple(cells[(ep, replicate, index)] for index in range(width))
            for replicate in range(mesh.num_replicas)
        )
        for ep in range(expert_layout.num_ep)
    ]
    expert_groups = tuple(
        tuple(mesh.slot_of_rank(member) for row in grid for member in row)
        for grid in groups_of_grid
    )
    own_grid = groups_of_grid[expert_layout.ep_index]
    # Every rank creates every grid's groups, in one order: gather them all.
    all_grids: list = [None] * world_size
    dist.all_gather_object(all_grids, own_grid)
    groups = _create_groups(
        layout.process_group_policy,
        all_grids,
        own_grid,
        timeout,
        shared=lambda timeout: (
            expert_layout.expert_mesh.get_group(),
            mesh.replicate_group,
            _create_grid_groups(all_grids, own_grid, timeout),
        ),
    )
    expert_mesh = OwnershipMesh.on_grid(
        own_grid,
        groups,
        shard_dim_names=expert_layout.expert_mesh.mesh_dim_names,
        replicate_dim_names=mesh.replicate_dim_names,
        model_parallel_dims=mesh.model_parallel_dims,
    )
    return ExpertMeshes(
        ep_index=expert_layout.ep_index,
        num_ep=expert_layout.num_ep,
        expert_groups=expert_groups,
        mesh=expert_mesh,
    )


def _multi_rank(mesh: DeviceMesh | None) -> DeviceMesh | None:
    return mesh if mesh is not None and mesh.size() > 1 else None


def _hsdp_rank_grid(mesh: DeviceMesh, replicate_mesh: DeviceMesh) -> RankGrid:
    """The (replicate, shard) grid of ranks through this rank: [Note: HSDP by structure]."""
    if not isinstance(replicate_mesh, DeviceMesh):
        raise TypeError(
            f"replicate_mesh must be a DeviceMesh, got {type(replicate_mesh).__name__}.\n"
            + HSDP_MESH_FIX
        )
    root = root_mesh(replicate_mesh)
    problem = None
    if replicate_mesh.mesh_dim_names is None:
        problem = "replicate_mesh has no mesh_dim_names"
    elif replicate_mesh.ndim != 1:
        problem = (
            f"replicate_mesh is {replicate_mesh.ndim}-D (dims {replicate_mesh.mesh_dim_names})"
        )
    elif replicate_mesh.get_coordinate() is None:
        problem = (
            f"this rank ({dist.get_rank()}) is not in replicate_mesh (ranks "
            f"{replicate_mesh.mesh.tolist()})"
        )
    elif mesh.mesh_dim_names is None:
        problem = "mesh has no mesh_dim_names"
    elif root is replicate_mesh:
        problem = (
            f"replicate_mesh (dims {replicate_mesh.mesh_dim_names}) is a whole 1-D mesh, not a "
            "dim of a larger mesh"
        )
    elif root_mesh(mesh) is not root:
        problem = (
            f"mesh (dims {mesh.mesh_dim_names}) and replicate_mesh (dims "
            f"{replicate_mesh.mesh_dim_names}) are not dims of the same DeviceMesh"
        )
    else:
        grid = _grid_through_this_rank(root, mesh, replicate_mesh)
        if grid is not None:
            return grid
        problem = (
            f"mesh (dims {mesh.mesh_dim_names}, ranks {mesh.mesh.tolist()}) and replicate_mesh "
            f"(dims {replicate_mesh.mesh_dim_names}, ranks {replicate_mesh.mesh.tolist()}) are "
            "the same dim or overlapping dims"
        )
    raise ValueError(
        "HSDP needs mesh (the shard dim) and replicate_mesh (the replicate dim) to be two "
        "distinct named 1-D dims, possibly flattened ones, of one DeviceMesh (any names, e.g. "
        f'("replicate", "shard") or ("dp_replicate", "dp_shard", "tp")), but {problem}.\n'
        + HSDP_MESH_FIX
    )


def _grid_through_this_rank(
    root: DeviceMesh, shard_mesh: DeviceMesh, replicate_mesh: DeviceMesh
) -> RankGrid | None:
    """The [replicate][shard] ranks of two dims of ``root`` through this rank; None when the
    dims are not orthogonal. See [Note: HSDP by structure]."""
    root_ranks = root.mesh.flatten().tolist()  # by offset
    offset_of = {rank: offset for offset, rank in enumerate(root_ranks)}
    mine = offset_of[dist.get_rank()]
    shard_offsets = [offset_of[rank] for rank in shard_mesh.mesh.tolist()]
    cells = [
        [offset_of[rank] + shard - mine for shard in shard_offsets]
        for rank in replicate_mesh.mesh.tolist()
    ]
    flat = [offset for row in cells for offset in row]
    if len(set(flat)) != len(flat) or not all(0 <= offset < len(root_ranks) for offset in flat):
        return None
    return tuple(tuple(root_ranks[offset] for offset in row) for row in cells)


def data_parallel_ranks(
    device_mesh: DeviceMesh, model_parallel_dims: frozenset[str]
) -> tuple[tuple[str, ...] | None, tuple[int, ...]]:
    """The data-parallel dims of a parameter's mesh (its dims outside ``model_parallel_dims``;
    all of them when it has no names) and the ranks they span through this rank, sorted."""
    coordinate = device_mesh.get_coordinate()
    if coordinate is None:
        return device_mesh.mesh_dim_names, ()
    names = device_mesh.mesh_dim_names
    kept = [names is None or name not in model_parallel_dims for name in (names or coordinate)]
    index = tuple(slice(None) if keep else at for keep, at in zip(kept, coordinate))
    dims = None if names is None else tuple(name for name, keep in zip(names, kept) if keep)
    return dims, tuple(sorted(device_mesh.mesh[index].flatten().tolist()))


def build_ownership_mesh(
    layout: OwnershipLayout, timeout: timedelta | None = None
) -> OwnershipMesh:
    """Create the process groups of ``layout``; collective over the default group.

    Every rank of the default group must call it, each with its own layout (see [Note: groups of
    sub-meshes]). ``timeout`` is the timeout of the groups created; None takes the default
    group's (see [Note: group timeouts]).
    """
    if layout.mesh is None:
        return OwnershipMesh.local()
    rank_grid = layout.rank_grid
    grids, tp_meshes = _gather_rank_grids(layout)
    if timeout is None:
        timeout = process_group_timeout(default_group())

    def shared(timeout: timedelta) -> tuple[dist.ProcessGroup | None, ...]:
        shard_group = layout.mesh.get_group()
        replicate_group = (
            layout.replicate_mesh.get_group() if layout.replicate_mesh is not None else None
        )
        world_group = (
            shard_group if len(rank_grid) == 1 else _create_grid_groups(grids, rank_grid, timeout)
        )
        return shard_group, replicate_group, world_group

    groups = _create_groups(layout.process_group_policy, grids, rank_grid, timeout, shared=shared)
    if layout.process_group_policy == "isolated":
        tp_group = _create_tp_groups(tp_meshes, layout.tp_ranks, timeout)
    else:
        tp_group = layout.tp_mesh.get_group() if layout.tp_mesh is not None else None
    return OwnershipMesh.on_grid(
        rank_grid,
        groups,
        tp_ranks=layout.tp_ranks,
        tp_group=tp_group,
        shard_dim_names=layout.mesh.mesh_dim_names,
        replicate_dim_names=(
            layout.replicate_mesh.mesh_dim_names if layout.replicate_mesh is not None else None
        ),
        model_parallel_dims=layout.model_parallel_dims,
    )


def _gather_rank_grids(layout: OwnershipLayout) -> tuple[list[RankGrid], list[tuple[int, ...]]]:
    """Every rank's grid and TP ranks, indexed by global rank; raise on every rank if the meshes
    disagree."""
    world_size = dist.get_world_size()
    if world_size == 1:
        return [layout.rank_grid], [layout.tp_ranks]
    everyone: list[tuple[RankGrid, str, tuple[int, ...]] | None] = [None] * world_size
    dist.all_gather_object(
        everyone, (layout.rank_grid, layout.process_group_policy, layout.tp_ranks)
    )
    policies: dict[str, list[int]] = {}
    for rank, (_, policy, _) in enumerate(everyone):
        policies.setdefault(policy, []).append(rank)
    if len(policies) > 1:
        seen = "; ".join(f"{policy!r} on ranks {ranks}" for policy, ranks in policies.items())
        raise ValueError(
            f"dedicate_params got different process_group_policy values across ranks: {seen}. "
            "Pass the same process_group_policy on every rank: the groups it creates are "
            "created by all ranks together."
        )
    grids = [grid for grid, _, _ in everyone]
    tp_meshes = [tp_ranks for _, _, tp_ranks in everyone]
    for rank, tp_ranks in enumerate(tp_meshes):
        for member in tp_ranks:
            if member >= world_size or tp_meshes[member] != tp_ranks:
                raise ValueError(
                    f"dedicate_params got tensor-parallel meshes that disagree across ranks: rank "
                    f"{rank}'s TP parameters live on ranks {list(tp_ranks)}, but rank {member}'s "
                    f"on {list(tp_meshes[member]) if member < world_size else 'none'}. "
                    + SAME_MESH_FIX
                )
    for rank, grid in enumerate(grids):
        for member in _ranks_of(grid):
            if member >= world_size or grids[member] != grid:
                theirs = grids[member] if member < world_size else "no grid (no such rank)"
                raise ValueError(
                    f"dedicate_params got meshes that disagree across ranks: rank {rank}'s mesh "
                    f"spans the owner grid {_as_lists(grid)} (ranks by [replicate][shard]), "
                    f"which holds rank {member}, but rank {member}'s spans "
                    f"{_as_lists(theirs)}. {SAME_MESH_FIX}"
                )
    return grids, tp_meshes


def _create_groups(
    policy: str,
    grids: list[RankGrid],
    mine: RankGrid,
    timeout: timedelta | None,
    *,
    shared: Callable[[timedelta | None], tuple[dist.ProcessGroup | None, ...]],
) -> tuple[dist.ProcessGroup | None, ...]:
    """This rank's ``(shard, replicate, world)`` groups on ``mine`` (collective over the default
    group): cloned from every grid of ``grids`` under the "isolated" policy, else ``shared``'s
    (the given meshes' own groups). ``timeout`` None takes the default group's."""
    if timeout is None:
        timeout = process_group_timeout(default_group())
    if policy == "isolated":
        return _create_isolated_groups(grids, mine, timeout)
    return shared(timeout)


def _create_isolated_groups(
    grids: list[RankGrid], mine: RankGrid, timeout: timedelta | None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Clone the shard, replicate and whole-grid groups of every grid; return this rank's."""
    rank = dist.get_rank()
    shard_group = replicate_group = world_group = None
    for grid in sorted(set(grids)):
        columns = [tuple(row[s] for row in grid) for s in range(len(grid[0]))]
        # Forward broadcasts and first-stage reduces sit on the critical path: on NCCL their
        # group gets a high-priority stream; the replicate axis (publish, second-stage reduce)
        # keeps the default priority, as FSDP2 splits intra- and inter-node traffic.
        for row in grid:
            group = _new_group(row, timeout, "dmuon_shard", nccl_high_priority_options(timeout))
            if grid == mine and rank in row:
                shard_group = group
        for column in columns:
            group = _new_group(column, timeout, "dmuon_replicate")
            if grid == mine and rank in column:
                replicate_group = group
        group = _new_group(_ranks_of(grid), timeout, "dmuon_world")
        if grid == mine:
            world_group = group
    return shard_group, replicate_group, world_group


def _create_tp_groups(
    tp_meshes: list[tuple[int, ...]], mine: tuple[int, ...], timeout: timedelta | None
) -> dist.ProcessGroup | None:
    """The group of this rank's TP ranks, after creating every rank's (collective, sorted)."""
    tp_group = None
    for ranks in sorted({tuple(sorted(r)) for r in tp_meshes if len(r) > 1}):
        group = _new_group(ranks, timeout, "dmuon_tp")
        if ranks == tuple(sorted(mine)):
            tp_group = group
    return tp_group


def _create_grid_groups(
    grids: list[RankGrid], mine: RankGrid, timeout: timedelta | None
) -> dist.ProcessGroup | None:
    """The group of every rank of this rank's grid ("shared" policy, HSDP)."""
    distinct = sorted(set(grids))
    if len(distinct) == 1:
        return dist.group.WORLD  # one grid spans the whole default group
    world_group = None
    for grid in distinct:
        group = _new_group(_ranks_of(grid), timeout, "dmuon_world")
        if grid == mine:
            world_group = group
    return world_group


def _new_group(
    ranks: tuple[int, ...],
    timeout: timedelta | None,
    description: str,
    pg_options: object | None = None,
) -> dist.ProcessGroup | None:
    # A group of one rank carries no collective; every rank skips it alike.
    if len(ranks) == 1:
        return None
    return dist.new_group(
        list(ranks), timeout=timeout, pg_options=pg_options, group_desc=description
    )


def _ranks_of(grid: RankGrid) -> tuple[int, ...]:
    return tuple(sorted(rank for row in grid for rank in row))


def _dims_label(names: tuple[str, ...] | None) -> str:
    return "(unnamed)" if names is None else repr(names)


def _as_lists(grid: RankGrid | str) -> object:
    return grid if isinstance(grid, str) else [list(row) for row in grid]
