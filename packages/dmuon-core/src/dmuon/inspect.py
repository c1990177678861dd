"""Read-only views of what ``dedicate_params`` decided for a model: owners, boundaries, segments.

The public inspection surface of dmuon-core. dmuon-tools, dmuon-hf and users read the partition
plan, the owner grid, each dedicated parameter's owner and dtypes, and each hook boundary's
segments here, never in dmuon's internal modules::

    view = dmuon.inspect.view(model)          # ValueError if dedicate_params was never called
    param = view.params["layers.0.q_proj.weight"]
    param.owner, param.owner_rank, param.is_owner, param.route, param.param_dtype
    for boundary in view.boundaries:          # in module registration order
        for segment in boundary.segments:     # one coalesced broadcast and gradient reduce each
            segment.shard, segment.root_rank, segment.value_bytes, segment.slices
    stack = view.expert_stacks["layers.0.moe.w1"]   # an (E, m, n) stack dedicated as E matrices
    [view.params[piece].owner_rank for piece in stack.pieces]   # its expert ranges' owners

Owns: building the views, each a frozen dataclass made on request from the live state (a
snapshot: it does not follow later changes). Every fact in a view is read from the code that acts
on it — the owner's global rank from ``OwnershipMesh.global_rank``, the segment layout from
``BoundaryGroup.build_segments`` — and is never derived a second time here.

Must not: change what it reads, issue collectives (``owners_newton_schulz_counts`` and
``newton_schulz_table`` excepted: they gather the counts, and say so), or hand out tensors other than
``ParamView.master`` (the identity of what the optimizer updates) and the CUDA events of
``ForwardWaitsView``.

Every name in a view is a canonical FQN (``canonical_fqn``, re-exported here): a name of
``model.named_parameters()`` less the segments activation-checkpoint and ``torch.compile``
wrappers insert; look a parameter's view up with ``view.params[canonical_fqn(name)]``.

What-ifs without a model use the partition itself, re-exported here: ``plan_ownership``,
``make_param_specs``, ``ns_cost``, ... are the very functions ``dedicate_params`` runs (pure: no
tensors, no process group; fast for 10,000 owner slots), and ``what_if_grid(G, R)`` gives the
owner ranks of a mesh built as ``init_device_mesh(device, (R, G), ("replicate", "shard"))``.
The overlapped step's cut of an owner's boundaries into chunks (``speculation_chunks``,
``SPECULATION_CHUNKS``) is re-exported the same way.

What the sibling packages would otherwise read from torch's private names:
``is_expert_stack_by_default(module, param)``, the rule ``dedicate_params`` applies to a 3-D
parameter without ``expert_stacks=`` (torch's convolutions excluded), and
``fsdp2_compute_dtypes(model)``, the dtype FSDP2's mixed precision computes each of its
parameters in.

Of an optimizer: ``newton_schulz_counts(optimizer)``, the Newton-Schulz outputs each Muon matrix
this rank owns has received (counted by ``dmuon.ns_counts`` where the update is applied), and
``model_of(optimizer)``. The counts differ by rank, so ``optimizer.routing()`` (the same rows on
every rank, no collective) does not show them; ``owners_newton_schulz_counts(optimizer)`` gathers
each matrix's count from its owner, and ``newton_schulz_table(optimizer)`` is the routing
table's Muon rows with that count, to print beside it.

[Note: the partition through inspect]
The partition's pure functions are public through this module rather than ``dmuon/__init__``:
the top-level names are the training API (``dedicate_params``, ``Muon``, ...), while a plan is
something one inspects — of a live model (``view(model).plan``) or of a model that does not
exist yet (the ``dmuon-tools plan`` what-ifs). Re-exporting the objects themselves, not
wrappers, keeps a what-if equal to the real decision by construction; ``dmuon.partition`` stays
an internal module, free to reorganise behind these names.

[Note: layout before adoption]
A meta-device model's weights are moved into their boundaries' segments only at adoption (the
first forward, or ``dmuon.Muon``), so until then no segment exists. Its views still show the
segments as they will be: ``BoundaryGroup.build_segments`` — the one code that lays segments
out — runs on copies of the boundary's parameters over meta-device buffers, which allocate
nothing and leave the model untouched.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch import nn

from dmuon._torch_internals import fsdp_param_dtypes
from dmuon.experts import is_expert_stack_by_default
from dmuon.fqn import canonical_fqn
from dmuon.group import BoundaryGroup, Segment
from dmuon.hooks import get_dedicated_state
from dmuon.mesh import OwnershipMesh
from dmuon.optim import Muon
from dmuon.overlap import SPECULATION_CHUNKS, speculation_chunks
from dmuon.param import ADAMW_ROUTE, MUON_ROUTE, DedicatedParam
from dmuon.partition import (
    DEFAULT_SMALL_PARAM_NUMEL,
    OwnerCoord,
    OwnershipPlan,
    OwnershipUnit,
    ParamSpec,
    layer_id_of,
    make_param_specs,
    ns_cost,
    param_cost,
    plan_ownership,
)
from dmuon.profile import FORWARD_PROFILE_ENV, BoundaryWaits

WHAT_IF_RANK_FORMULA = (
    'rank = replicate * G + shard (init_device_mesh((R, G), ("replicate", "shard")))'
)
"""How ``what_if_grid`` numbers the owners, as one line for reports."""

# The owners' fp32 master copies (``group._make_master``): known before adoption too.
_MASTER_DTYPE = torch.float32


# ---- the owner grid -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerGrid:
    """The (shard, replicate) grid of owner slots and the global rank of each.

    ``num_shards`` (G) ranks hold one replica of the dedicated weights; ``num_replicas`` (R)
    replicas make the HSDP grid (R = 1 without HSDP). ``owner_rank`` is the one formula of an
    owner's rank, the one dmuon's collectives use.
    """

    num_shards: int
    num_replicas: int
    coord: OwnerCoord | None  # this rank's slot; None on a what-if grid
    rank_grid: tuple[tuple[int, ...], ...]  # global rank of every slot, [replicate][shard]
    _mesh: OwnershipMesh = field(repr=False, compare=False)

    @property
    def num_slots(self) -> int:
        return self.num_shards * self.num_replicas

    def owner_rank(self, owner: OwnerCoord) -> int:
        """The global rank of the owner slot ``owner``."""
        if not (0 <= owner.shard < self.num_shards and 0 <= owner.replicate < self.num_replicas):
            raise ValueError(
                f"{owner} is outside the owner grid of {self.num_shards} shards x "
                f"{self.num_replicas} replicas; shard must be in [0, {self.num_shards}) and "
                f"replicate in [0, {self.num_replicas})."
            )
        return self._mesh.global_rank(owner)


def what_if_grid(num_shards: int, num_replicas: int = 1) -> OwnerGrid:
    """The owner grid of a mesh built as ``init_device_mesh(device, (R, G),
    mesh_dim_names=("replicate", "shard"))``: ``rank = replicate * G + shard``
    (``WHAT_IF_RANK_FORMULA``), which is also the plan's slot index ([Note: slot order] in the
    partition)."""
    for name, value in (("num_shards", num_shards), ("num_replicas", num_replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"what_if_grid: {name} must be an int >= 1, got {value!r}; pass the size of the "
                f"{'shard' if name == 'num_shards' else 'replicate'} mesh dim"
            )
    rank_grid = tuple(
        tuple(range(replicate * num_shards, (replicate + 1) * num_shards))
        for replicate in range(num_replicas)
    )
    mesh = OwnershipMesh(
        num_shards=num_shards,
        num_replicas=num_replicas,
        coord=OwnerCoord(0, 0),
        rank_grid=rank_grid,
        shard_group=None,
        replicate_group=None,
        world_group=None,
    )
    return OwnerGrid(
        num_shards=num_shards,
        num_replicas=num_replicas,
        coord=None,
        rank_grid=rank_grid,
        _mesh=mesh,
    )


# ---- the views ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamView:
    """One dedicated parameter: its owner, route and dtypes, as seen from this rank."""

    name: str  # canonical FQN: as in model.named_parameters(), less wrapper segments (fqn)
    shape: tuple[int, ...]  # the full shape
    route: str  # MUON_ROUTE (>= 2-D: orthogonalised) or ADAMW_ROUTE, on its owner
    requires_grad: bool
    owner: OwnerCoord
    owner_rank: int
    is_owner: bool  # this rank holds the fp32 master and runs the update
    boundary: str  # FQN of the hook-boundary module that moves it ("" for the root)
    param_dtype: torch.dtype  # forward compute dtype (the segment buffer's)
    reduce_dtype: torch.dtype  # the gradient's dtype in the reduce to the owner
    master_dtype: torch.dtype | None  # what the optimizer updates here; None off the owner
    # The owner's fp32 master, the tensor that sits in ``optimizer.param_groups`` (to find the
    # group holding it); None off the owner and before adoption. Read it, do not modify it.
    master: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # The region of the full value this rank's copy covers: the whole parameter, or its
    # tensor-parallel chunk (``full[master_region]`` is what ``master`` holds).
    master_region: tuple[slice, ...] = (slice(None),)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerSliceView:
    """The part of a segment owned by one slot ``(shard, replicate)``: under HSDP, what that
    owner publishes after the step and receives in the second-stage gradient reduce."""

    owner: OwnerCoord
    owner_rank: int
    params: tuple[str, ...]
    numel: int
    value_bytes: int  # published across replicas after the step
    message_bytes: int  # gradients and their flags, reduced across replicas to the owner


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentView:
    """The parameters of one boundary owned by one shard index (and one compute dtype): one
    coalesced broadcast from its root in forward, one gradient message reduced to it.

    A gradient message holds each gradient followed by one flag element (whether this rank
    produced it) and zeros up to a multiple of 8 elements, in ``reduce_dtype`` (see [Note:
    aligned gradients in a message] in ``dmuon.group``).
    """

    shard: int  # shard index of the owners, and of the root in every replica
    root_rank: int  # the rank that broadcasts it in this rank's replica
    # The global ranks its broadcasts and first gradient reduce run on (this rank's replica of
    # the grid it travels on: the boundary's, or for expert pieces their EP slot's, see [Note:
    # expert segments] in ``dmuon.group``), and those of its HSDP publish and second-stage
    # reduce (shard ``shard`` of every replica of that grid), each in group order.
    shard_ranks: tuple[int, ...]
    replicate_ranks: tuple[int, ...]
    is_local: bool  # this rank is the root: the segment stays resident here
    dtype: torch.dtype  # compute dtype of the broadcast buffer
    reduce_dtype: torch.dtype  # dtype of the gradient message (the widest of its gradients')
    params: tuple[str, ...]  # in buffer order: by owner replica, then registration order
    numel: int
    message_numel: int  # per parameter: numel, a flag, zeros to a multiple of 8
    slices: tuple[OwnerSliceView, ...]  # by owner replica

    @property
    def value_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def message_bytes(self) -> int:
        return self.message_numel * self.reduce_dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryView:
    """The dedicated parameters one hook-boundary module moves, by segment."""

    name: str  # the module's FQN ("" for the root)
    params: tuple[str, ...]
    reshard_after_forward: bool  # True: Z3, False: Z2
    broadcasts_per_step: int  # 2 under Z3 (forward, then again for backward), 1 under Z2
    segments: tuple[SegmentView, ...]  # by shard index

    @property
    def value_bytes(self) -> int:
        """Bytes of one unshard (every segment's broadcast)."""
        return sum(segment.value_bytes for segment in self.segments)

    @property
    def message_bytes(self) -> int:
        """Bytes of the gradient messages of one backward."""
        return sum(segment.message_bytes for segment in self.segments)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelView:
    """What ``dedicate_params`` decided for one model, as seen from this rank."""

    grid: OwnerGrid
    plan: OwnershipPlan  # the partition: owners, units, per-slot loads
    # The weights sit in the owners' segments: False for a meta-device model until its first
    # forward or ``dmuon.Muon`` (its segments show the layout they will have).
    is_adopted: bool
    params: Mapping[str, ParamView]  # read-only; in dedication order
    boundaries: tuple[BoundaryView, ...]  # in module registration order
    # Mixture-of-experts stacks by FQN; ``params`` holds their pieces (``<fqn>[start:stop]``).
    expert_stacks: Mapping[str, ExpertStackView] = field(
        default_factory=lambda: MappingProxyType({})
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertStackView:
    """One (E, m, n) module parameter dedicated as E matrices: its expert pieces, each a
    contiguous range of experts with one owner (a ``ParamView`` in ``ModelView.params``)."""

    name: str  # the module parameter's FQN
    shape: tuple[int, ...]  # (E, m, n)
    pieces: tuple[str, ...]  # the pieces' names in ``ModelView.params``, in expert order
    experts: tuple[tuple[int, int], ...]  # each piece's experts [start, stop)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardWaitsView:
    """How often and how long forward waited for one boundary's broadcasts
    (``DMUON_RECORD_FORWARD_PROFILE=1``); counters accumulate from ``dedicate_params`` on."""

    boundary: str
    waits: int  # forward pre-hooks that needed the boundary's weights
    prefetched: int  # ... whose broadcast a prefetch had already issued
    host_ms: float  # host time in the waits (the transfer on gloo, the enqueueing on NCCL)
    # (start, end) CUDA events around the most recent waits, on the compute stream; empty on CPU.
    cuda_events: tuple[tuple[torch.cuda.Event, torch.cuda.Event], ...] = field(
        default=(), repr=False, compare=False
    )


# ---- reading a model ----------------------------------------------------------------------------


def is_prepared(model: nn.Module) -> bool:
    """True when ``dmuon.dedicate_params`` was called on ``model``."""
    try:
        get_dedicated_state(model)
    except ValueError:
        return False
    return True


def view(model: nn.Module) -> ModelView:
    """The plan, owner grid, dedicated parameters and boundaries of ``model``; rank-local.

    Raises ValueError, saying what to call, when ``dedicate_params`` was never called on it.
    """
    state = get_dedicated_state(model)
    grid = _grid_of(state.mesh)
    boundary_of = {p.fqn: group.name for group in state.boundaries for p in group.params}
    params = {name: _param_view(p, grid, boundary_of[name]) for name, p in state.params.items()}
    return ModelView(
        grid=grid,
        plan=state.plan,
        is_adopted=state.is_adopted,
        params=MappingProxyType(params),
        boundaries=tuple(_boundary_view(group, grid) for group in state.boundaries),
        expert_stacks=MappingProxyType(
            {
                name: ExpertStackView(
                    name=name,
                    shape=tuple(stack.shape),
                    pieces=tuple(piece.fqn for piece in stack.pieces),
                    experts=tuple(piece.experts for piece in stack.pieces),
                )
                for name, stack in state.stacks.items()
            }
        ),
    )


def model_of(optimizer: Muon) -> nn.Module:
    """The model a ``dmuon.Muon`` was built on."""
    if not isinstance(optimizer, Muon):
        raise TypeError(
            f"dmuon.inspect.model_of takes a dmuon.Muon, got {type(optimizer).__name__}; build "
            "the optimizer with dmuon.Muon(model, ...)."
        )
    return optimizer.model_state.model


def newton_schulz_counts(optimizer: Muon) -> dict[str, int | tuple[int, ...]]:
    """Per parameter on the Muon route (``optimizer.routing()``'s FQNs, in its order): how many
    Newton-Schulz outputs this rank has applied to it since ``optimizer`` was built.

    An int per matrix; a tuple per expert for an (E, m, n) expert stack, and per row block for a
    matrix dedicated with ``row_blocks=`` (each its own Newton-Schulz). Counted where an update
    reaches the owner's master (the TP ranks of a tensor-parallel matrix's owner each count their
    chunk), so after k steps every matrix this rank owns shows k, whatever the gradient
    accumulation, ``no_sync``, ``overlap_step`` or pipeline stage, and every other matrix 0. A
    step skipped for non-finite gradients counts nothing, as does a step in which the matrix had
    no gradient. See [Note: one Newton-Schulz per matrix per step] in ``dmuon.ns_counts``.
    Rank-local: no collective (``owners_newton_schulz_counts`` gathers every owner's).
    """
    state = get_dedicated_state(model_of(optimizer))
    counts = optimizer._ns_counts
    result: dict[str, int | tuple[int, ...]] = {}
    for row in optimizer.routing():
        if row.route != MUON_ROUTE:
            continue
        stack = state.stacks.get(row.fqn)
        if stack is not None:
            per_expert = [0] * stack.shape[0]
            for piece in stack.pieces:
                if piece.master is not None:
                    start, stop = piece.experts
                    for expert in range(start, stop):
                        per_expert[expert] = counts.of(piece.master, expert - start)
            result[row.fqn] = tuple(per_expert)
            continue
        p = state.params[row.fqn]
        if p.row_blocks is None:
            result[row.fqn] = 0 if p.master is None else counts.of(p.master)
            continue
        starts = itertools.accumulate(p.row_blocks, initial=0)
        result[row.fqn] = tuple(
            0 if p.master is None else counts.of(p.master, slice(start, start + rows))
            for start, rows in zip(starts, p.row_blocks)
        )
    return result


def owners_newton_schulz_counts(optimizer: Muon) -> dict[str, int | tuple[int, ...]]:
    """``newton_schulz_counts`` as each matrix's owner counted it (each expert's, each row
    block's owner), the same dict on every rank: the counts of every rank of the ownership grid
    summed, where every rank but the owner counts 0 (a count from any other rank would show in
    the sum). Under tensor parallelism each grid gathers its own TP rank's chunks, which count
    alike. Collective over the ownership grid (one ``all_gather_object``): every rank of it
    calls it, in the same order; in one process, ``newton_schulz_counts``.
    """
    local = newton_schulz_counts(optimizer)
    group = get_dedicated_state(model_of(optimizer)).mesh.world_group
    if group is None:
        return local
    everyone: list[dict] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    summed = {}
    for fqn, count in local.items():
        counts = [counts_of_rank[fqn] for counts_of_rank in everyone]
        if isinstance(count, tuple):
            summed[fqn] = tuple(sum(values) for values in zip(*counts, strict=True))
        else:
            summed[fqn] = sum(counts)
    return summed


def newton_schulz_table(optimizer: Muon) -> str:
    """The Muon rows of ``optimizer.routing()`` (its order) with each matrix's owner count from
    ``owners_newton_schulz_counts``, as an aligned text table: parameter, shape, owner, Newton-
    Schulz outputs (for an expert stack or row blocks, ``k each of n`` when all its experts or
    blocks received k, else every count). Collective, as ``owners_newton_schulz_counts``; print
    it on one rank beside the routing table (``dmuon_tools.print_routing``)::

        table = dmuon.inspect.newton_schulz_table(optimizer)  # on every rank
        if dist.get_rank() == 0:
            print(table)
    """
    counts = owners_newton_schulz_counts(optimizer)
    cells = [("parameter", "shape", "owner", "newton-schulz outputs")]
    for row in optimizer.routing():
        if row.fqn not in counts:
            continue
        owner = row.owner_rank
        owner_cell = " ".join(map(str, owner)) if isinstance(owner, tuple) else str(owner)
        cells.append(
            (
                row.fqn,
                "x".join(map(str, row.shape)),
                owner_cell,
                _count_cell(counts[row.fqn]),
            )
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _count_cell(count: int | tuple[int, ...]) -> str:
    if not isinstance(count, tuple):
        return str(count)
    if len(set(count)) == 1:
        return f"{count[0]} each of {len(count)}"
    return " ".join(map(str, count))


def forward_waits(model: nn.Module) -> tuple[ForwardWaitsView, ...] | None:
    """Per boundary, the forward-unshard waits recorded so far; None when they are not recorded
    (``DMUON_RECORD_FORWARD_PROFILE=1`` was not set before ``dedicate_params``).

    Boundaries in the order forward first waited for them, then those that never waited.
    Raises ValueError when ``dedicate_params`` was never called on ``model``.
    """
    state = get_dedicated_state(model)
    if state.profile is None:
        return None
    recorded = dict(state.profile.boundaries)
    names = list(recorded) + [g.name for g in state.boundaries if g.name not in recorded]
    return tuple(_waits_view(name, recorded.get(name, BoundaryWaits())) for name in names)


# ---- building the views -------------------------------------------------------------------------


# ---- what the sibling packages read of torch's modules ------------------------------------------


def fsdp2_compute_dtypes(model: nn.Module) -> dict[int, torch.dtype]:
    """id(sharded parameter) -> the dtype FSDP2 computes it in, for the parameters of ``model``
    whose FSDP2 ``MixedPrecisionPolicy`` casts them (absent: computed in their storage dtype, or
    a torch whose FSDP2 keeps its policy elsewhere). FSDP2 has no public getter for it; this
    reads its per-module state (``dmuon._torch_internals``)."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, torch.dtype] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            found.update(fsdp_param_dtypes(module))
    return found


def _grid_of(mesh: OwnershipMesh) -> OwnerGrid:
    return OwnerGrid(
        num_shards=mesh.num_shards,
        num_replicas=mesh.num_replicas,
        coord=mesh.coord,
        rank_grid=mesh.rank_grid,
        _mesh=mesh,
    )


def _param_view(p: DedicatedParam, grid: OwnerGrid, boundary: str) -> ParamView:
    return ParamView(
        name=p.fqn,
        shape=tuple(p.shape),
        route=p.route,
        requires_grad=p.requires_grad,
        owner=p.owner,
        owner_rank=grid.owner_rank(p.owner),
        is_owner=p.is_owner,
        boundary=boundary,
        param_dtype=p.param_dtype,
        reduce_dtype=p.reduce_dtype,
        master_dtype=_master_dtype(p),
        master=p.master,
        master_region=_tp_region(p),
    )


def _tp_region(p: DedicatedParam) -> tuple[slice, ...]:
    if p.tp is None or p.tp.shard_dim is None:
        return (slice(None),)
    start, stop = p.tp.bounds(p.tp.rank)
    return (slice(None),) * p.tp.shard_dim + (slice(start, stop),)


def _boundary_view(group: BoundaryGroup, grid: OwnerGrid) -> BoundaryView:
    laid_out = group if group.segments else _planned_layout(group)
    return BoundaryView(
        name=group.name,
        params=tuple(p.fqn for p in group.params),
        reshard_after_forward=group.reshard_after_forward,
        broadcasts_per_step=2 if group.reshard_after_forward else 1,
        segments=tuple(_segment_view(segment, laid_out, grid) for segment in laid_out.segments),
    )


def _planned_layout(group: BoundaryGroup) -> BoundaryGroup:
    """``group`` laid out on copies of its parameters over meta buffers ([Note: layout before
    adoption])."""
    copies = [dataclasses.replace(p) for p in group.params]
    planned = BoundaryGroup(
        group.name, group.module, copies, group.mesh, group.reshard_after_forward
    )
    planned.build_segments(torch.device("meta"))
    return planned


def _segment_view(segment: Segment, group: BoundaryGroup, grid: OwnerGrid) -> SegmentView:
    reduce_dtype = segment.reduce_dtype
    slices = []
    for replicate, (start, end) in segment.value_ranges.items():
        message_start, message_end = segment.message_ranges[replicate]
        if segment.mesh is group.mesh:
            owner = OwnerCoord(segment.shard, replicate)
            owner_rank = grid.owner_rank(owner)
        else:  # expert pieces on their expert mesh ([Note: expert segments] in ``dmuon.group``)
            owner_rank = segment.mesh.global_rank(OwnerCoord(segment.shard, replicate))
            owner = group.mesh.coord_of_rank(owner_rank)
        slices.append(
            OwnerSliceView(
                owner=owner,
                owner_rank=owner_rank,
                params=tuple(
                    p.fqn for p in segment.params if group.coord_on_mesh(p).replicate == replicate
                ),
                numel=end - start,
                value_bytes=(end - start) * segment.dtype.itemsize,
                message_bytes=(message_end - message_start) * reduce_dtype.itemsize,
            )
        )
    mesh = segment.mesh
    return SegmentView(
        shard=segment.shard,
        root_rank=group._root_rank(segment),
        shard_ranks=tuple(mesh.rank_grid[mesh.coord.replicate]),
        replicate_ranks=tuple(row[segment.shard] for row in mesh.rank_grid),
        is_local=segment.is_local,
        dtype=segment.dtype,
        reduce_dtype=reduce_dtype,
        params=tuple(p.fqn for p in segment.params),
        numel=segment.numel,
        message_numel=sum(end - start for start, end in segment.message_ranges.values()),
        slices=tuple(slices),
    )


def _master_dtype(p: DedicatedParam) -> torch.dtype | None:
    if p.master is not None:
        return p.master.dtype
    return _MASTER_DTYPE if p.is_owner else None  # not adopted yet: the owner will hold one


def _waits_view(name: str, waits: BoundaryWaits) -> ForwardWaitsView:
    return ForwardWaitsView(
        boundary=name,
        waits=waits.waits,
        prefetched=waits.prefetched,
        host_ms=waits.host_ms,
        cuda_events=tuple(waits.events),
    )


__all__ = [
    "ADAMW_ROUTE",
    "DEFAULT_SMALL_PARAM_NUMEL",
    "FORWARD_PROFILE_ENV",
    "MUON_ROUTE",
    "SPECULATION_CHUNKS",
    "WHAT_IF_RANK_FORMULA",
    "BoundaryView",
    "ExpertStackView",
    "ForwardWaitsView",
    "ModelView",
    "OwnerCoord",
    "OwnerGrid",
    "OwnerSliceView",
    "OwnershipPlan",
    "OwnershipUnit",
    "ParamSpec",
    "ParamView",
    "SegmentView",
    "canonical_fqn",
    "forward_waits",
    "fsdp2_compute_dtypes",
    "is_expert_stack_by_default",
    "is_prepared",
    "layer_id_of",
    "make_param_specs",
    "model_of",
    "newton_schulz_counts",
    "newton_schulz_table",
    "ns_cost",
    "owners_newton_schulz_counts",
    "param_cost",
    "plan_ownership",
    "speculation_chunks",
    "view",
    "what_if_grid",
]
