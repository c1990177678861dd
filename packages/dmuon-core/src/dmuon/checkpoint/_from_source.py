"""Loading a full model state dict that one rank holds (``broadcast_from_rank0=True``).

Owns how each value of that dict reaches the ranks that keep it: the plan the source rank sends
first (every key's shape and dtype, the errors it found, the small objects), then the values one
at a time, in the model's order on every rank. It must not read the dict through the model's
hooks nor check it (``_model`` does both and hands over the checked entries), and must not know
optimizer state.

[Note: each owner receives only its matrices]
The source is the rank that ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``
gives the full dict to: the lowest rank of the ownership grid (of its TP peers' grids too), rank
0 for a mesh over every rank. It alone holds the full dict; every other rank passes ``{}``.

- A dedicated matrix goes from the source to its owner, point to point, and into the owner's
  fp32 master; no other rank holds it, even for a moment. An expert piece goes to the owner the
  piece names (``ExpertStack.every_piece``: every EP slot's pieces, each with its owner's
  rank), its experts ``[start, stop)`` only. Under HSDP the owner is one slot of the grid; the
  replicas get the weight when the masters are published at the end (the copy they serve
  forward, which they hold anyway). Under tensor parallelism the owner in the
  source's grid receives the full matrix, keeps its chunk, and sends chunk t to the owner's TP
  rank t (the owner of the same slot in TP rank t's grid).
- Every other value (FSDP2's parameters, buffers, parameters nobody dedicated) goes the way
  torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends it: the full tensor to
  every rank of the grid (then from the source's grid to its TP peers), each rank keeping its
  shard (``distribute_tensor`` without communication) and dropping the rest.

Only one value is in flight at a time, and every value a rank receives lands in one scratch
buffer the size of the largest of them (it is reused, not reallocated: a backend may keep the
previous tensor a moment after its work completes). So a rank other than the source holds,
beyond the model's own storage (its masters, segments and FSDP2 shards), one value of the dict:
the largest it receives. ``recording_received`` counts that for tests: the bytes received and
the receive buffers allocated, while they are alive.

[Note: materialising for a load]
``model.to_empty(device=...)`` on a meta-device model allocates every dedicated weight in full on
every rank (dmuon adopts the weights, and frees them, only at the first load, forward or
``dmuon.Muon``): the whole model on every rank for a moment. A load that writes every weight
next does not need them: ``to_empty_for_load`` gives each plain dedicated weight a one-element
stand-in expanded to its shape instead (adoption then builds the rank's own segments and masters
from it, and the load overwrites them), and runs ``to_empty`` for everything else (FSDP2's local
shards, buffers, a TP or EP DTensor's local chunk). A random initialisation in place after it
fails on the stand-ins (torch refuses to write into an expanded tensor); use ``to_empty`` then.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon.checkpoint._context import CheckpointContext
from dmuon.experts import ExpertStack
from dmuon.hooks import get_dedicated_state
from dmuon.param import DedicatedParam, mark_dedicated


def to_empty_for_load(model: nn.Module, *, device: torch.device | str) -> None:
    """``model.to_empty(device=device)`` for a meta-device dmuon model that a full load fills
    next, without allocating its dedicated weights (see [Note: materialising for a load])."""
    state = get_dedicated_state(model)
    slots: dict[tuple[nn.Module, str], nn.Parameter] = {}
    if not state.is_adopted:
        for p in state.params.values():
            param = p.module._parameters.get(p.attr)
            if param is not None and param.is_meta and not isinstance(param, DTensor):
                slots[(p.module, p.attr)] = param
    for module, attr in slots:
        module._parameters[attr] = None  # to_empty leaves it alone
    stand_ins: dict[int, nn.Parameter] = {}
    try:
        model.to_empty(device=device)
    finally:
        for (module, attr), param in slots.items():
            if id(param) not in stand_ins:  # a weight tied to two modules stays one
                one = torch.empty((), dtype=param.dtype, device=device)
                stand_ins[id(param)] = nn.Parameter(
                    one.expand(param.shape), requires_grad=param.requires_grad
                )
                mark_dedicated(stand_ins[id(param)])
            module._parameters[attr] = stand_ins[id(param)]


@dataclass(frozen=True, slots=True)
class ValueInfo:
    """What the other ranks learn of a value before it travels: enough to receive it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class Plan:
    """What the source sends first: one ``ValueInfo`` (None: absent) per entry of the model, in
    its order, the ``_extra_state`` objects, and the outcome of the checks (made there only)."""

    values: list[ValueInfo | None]
    extra_states: list[object | None]
    errors: list[str]
    missing: list[str]
    unexpected: list[str]


@dataclass(frozen=True, slots=True)
class Entry:
    """One parameter or persistent buffer of the model: where its value goes on this rank."""

    key: str
    target: torch.Tensor  # the module's parameter or buffer (a placeholder if dedicated)
    dedicated: DedicatedParam | ExpertStack | None
    value: torch.Tensor | None  # on the source only


class Transfer:
    """The routes of one load on this rank: the source, and this rank's TP peer in the source's
    grid (this rank itself there), which forwards to the TP ranks of the other grids."""

    def __init__(self, ctx: CheckpointContext) -> None:
        self.ctx = ctx
        self.tp_group = ctx.state.mesh.tp_group
        self.tp_ranks = ctx.state.mesh.tp_ranks
        self.source_peer = ctx.receiver
        # Every value this rank receives lands here, one at a time (see _receive_buffer).
        self._scratch: torch.Tensor | None = None
        self._scratch_bytes = 0
        if self.tp_group is not None:
            # The source's grid has one TP coordinate for every rank: the one that holds it.
            coordinate = torch.tensor(
                [self.tp_ranks.index(ctx.rank) if ctx.receiver_in_grid else len(self.tp_ranks)],
                device=ctx.device,
            )
            dist.all_reduce(coordinate, op=dist.ReduceOp.MIN, group=self.tp_group)
            self.source_peer = self.tp_ranks[int(coordinate.item())]

    def share_plan(self, plan: Plan | None) -> Plan:
        """``plan`` (given on the source, None elsewhere) on every rank of the grid and of its
        TP peers' grids. Collective."""
        holder = [plan]
        if self.ctx.group is not None and self.ctx.receiver_in_grid:
            dist.broadcast_object_list(holder, src=self.ctx.receiver, group=self.ctx.group)
        if self.tp_group is not None:
            dist.broadcast_object_list(holder, src=self.source_peer, group=self.tp_group)
        return holder[0]

    def load(self, entries: list[Entry], plan: Plan) -> None:
        """Move every value of ``plan`` from the source to the ranks that keep it and copy it
        in (see [Note: each owner receives only its matrices]). Collective, in ``entries``'
        order."""
        self._scratch_bytes = max(
            (self._largest_received(entry, info) for entry, info in zip(entries, plan.values)),
            default=0,
        )
        try:
            with torch.no_grad():
                for entry, info in zip(entries, plan.values, strict=True):
                    if info is not None:
                        self._load_entry(entry, info)
        finally:
            self._scratch = None

    def _largest_received(self, entry: Entry, info: ValueInfo | None) -> int:
        """Bytes of the largest tensor this rank receives of ``entry`` (0: none)."""
        if info is None or self.ctx.rank == self.ctx.receiver:
            return 0
        if isinstance(entry.dedicated, ExpertStack):
            owned = entry.dedicated.owned_pieces()
            numel = max((math.prod(piece.shape) for piece in owned), default=0)
        elif isinstance(entry.dedicated, DedicatedParam):
            numel = math.prod(info.shape) if entry.dedicated.master is not None else 0
        else:
            numel = math.prod(info.shape)
        return numel * info.dtype.itemsize

    def _load_entry(self, entry: Entry, info: ValueInfo) -> None:
        """One value, received and copied in; what was received dies with this call."""
        if isinstance(entry.dedicated, ExpertStack):
            # Every piece, of every EP slot, to the owner the piece names (``every_piece``).
            stack = entry.dedicated
            local = {piece.fqn: piece for piece in stack.pieces}
            for piece in stack.every_piece:
                value = None if entry.value is None else entry.value[piece.start : piece.stop]
                shape = (piece.stop - piece.start, *info.shape[1:])
                here = local.get(piece.fqn)
                self._to_owners(piece.owner_rank, here, value, ValueInfo(shape, info.dtype))
        elif isinstance(entry.dedicated, DedicatedParam):
            p = entry.dedicated
            self._to_owners(self.ctx.owner_rank(p), p, entry.value, info)
        else:
            full = self._to_every_rank(entry.value, info)
            entry.target.copy_(_shard_of(entry.target, full))

    def _to_owners(
        self,
        owner: int,
        p: DedicatedParam | None,
        value: torch.Tensor | None,
        info: ValueInfo,
    ) -> None:
        """The source's ``value`` into the master of global rank ``owner`` (``p`` there: the
        parameter or piece, None where this rank does not know it) and, under tensor
        parallelism, of the owner of the same slot on each TP rank (its chunk of a TP-sharded
        matrix)."""
        ctx = self.ctx
        master = p.master_value() if p is not None else None
        received = None
        if ctx.receiver_in_grid:
            received = self._to_owner(owner, value, info)
        if self.tp_group is None:
            if master is not None:
                master.copy_(received)
            return
        if master is None:  # not the owner; nor are its TP peers
            return
        if ctx.rank == self.source_peer:  # a part to each TP peer, its own kept
            for tp_rank, peer in enumerate(self.tp_ranks):
                part = _tp_part(p, received, tp_rank)
                if peer == ctx.rank:
                    master.copy_(part)
                else:
                    dist.send(part.contiguous(), dst=peer, group=self.tp_group)
        else:
            part = self._receive_buffer(p.local_shape, info.dtype)
            dist.recv(part, src=self.source_peer, group=self.tp_group)
            master.copy_(part)

    def _to_owner(
        self, owner: int, value: torch.Tensor | None, info: ValueInfo
    ) -> torch.Tensor | None:
        """``value`` (given on the source) on global rank ``owner`` of the source's grid; None
        on every other rank."""
        ctx = self.ctx
        if ctx.rank == ctx.receiver:
            if owner == ctx.receiver:
                return value
            dist.send(value.to(ctx.device).contiguous(), dst=owner, group=ctx.group)
            return None
        if ctx.rank != owner:
            return None
        received = self._receive_buffer(info.shape, info.dtype)
        dist.recv(received, src=ctx.receiver, group=ctx.group)
        return received

    def _to_every_rank(self, value: torch.Tensor | None, info: ValueInfo) -> torch.Tensor:
        """The full ``value`` (given on the source) on every rank of the grid and of its TP
        peers' grids: a broadcast in the source's grid, then one from there to the TP peers."""
        ctx = self.ctx
        if ctx.rank == ctx.receiver:
            full = value.to(ctx.device).contiguous()
        else:
            full = self._receive_buffer(info.shape, info.dtype)
        if ctx.group is not None and ctx.receiver_in_grid:
            dist.broadcast(full, src=ctx.receiver, group=ctx.group)
        if self.tp_group is not None:
            dist.broadcast(full, src=self.source_peer, group=self.tp_group)
        return full

    def _receive_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor to receive one value into: a view of one scratch buffer of the load's largest
        value, so that what a rank holds beyond the model never exceeds it, whenever the
        backend lets go of the previous value (gloo's work keeps its tensors a moment after
        it completes). Safe to reuse: every receive has completed before the next begins."""
        if self._scratch is None:
            self._scratch = torch.empty(
                self._scratch_bytes, dtype=torch.uint8, device=self.ctx.device
            )
            for record in _recording:
                record.allocated(self._scratch)
        nbytes = math.prod(shape) * dtype.itemsize
        for record in _recording:
            record.received += nbytes
        return self._scratch[:nbytes].view(dtype).view(shape)


def _tp_part(p: DedicatedParam, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """What TP rank ``tp_rank`` keeps of ``p``'s full value: its chunk, or all of it."""
    if not p.is_tp_sharded:
        return full
    start, stop = p.tp.bounds(tp_rank)
    return full.narrow(p.tp.shard_dim, start, stop - start)


def _shard_of(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` for ``target``: its shard of a DTensor (sliced here, no
    communication), else the whole value."""
    if isinstance(target, DTensor):
        return distribute_tensor(
            full.to(target.device), target.device_mesh, target.placements, src_data_rank=None
        )
    return full


# ---- what a rank receives ----------------------------------------------------------------------


@dataclass(slots=True)
class ReceivedBytes:
    """What one broadcast-from-rank0 load received on this rank: the bytes of every value, and
    the tensors allocated to receive them into, counted while they are alive."""

    received: int = 0  # bytes of every value received
    live: int = 0  # bytes of the receive tensors still alive
    peak: int = 0  # the most bytes of them alive at once

    def allocated(self, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, size)

    def _release(self, size: int) -> None:
        self.live -= size


_recording: list[ReceivedBytes] = []


@contextlib.contextmanager
def recording_received() -> Iterator[ReceivedBytes]:
    """Inside, count every tensor this rank allocates to receive a value into (for tests: the
    memory a load needs beyond the model's own storage)."""
    record = ReceivedBytes()
    _recording.append(record)
    try:
        yield record
    finally:
        _recording.remove(record)
