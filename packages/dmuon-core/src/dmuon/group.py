"""A hook boundary's dedicated parameters, packed into per-owner segments, and their collectives.

Owns the memory layout of one boundary, the four data movements of the protocol on it: unshard
(broadcast from owners), reshard (free), reduce (gradients to owners) and publish (the new
weights across the replicate axis), and the boundary's own place in a forward and backward pass,
which it advances itself as FSDP2's ``FSDPParamGroup`` does: ``pre_forward``, ``post_forward``,
``pre_backward``, ``post_backward``, ``finish_backward``, ``finalize_backward``. It must not
decide when a pass begins or ends (the hooks and the model's state do: ``hooks``) nor do any
optimizer math.

[Note: backward passes of one forward]
A boundary's post-backward fires once per use in forward, so it reduces when it has seen
``forward_count`` of them; the end of backward finishes the boundaries it did not reach. A graph
kept with ``retain_graph=True`` can be backpropagated again: each pass through it must reduce its
own gradients, so the forward counts (and the model's list of forwarded boundaries) outlive a
backward and are reset only when the next grad-enabled forward begins (``forget_forward_pass``).

[Note: segments]
A boundary's parameters are grouped by the shard index of their owner: segment ``s`` holds, in a
fixed order, every parameter owned by a slot ``(s, r)`` for any replica ``r``, sorted by ``r``.
The rank with shard index ``s`` is the *root* of segment ``s`` in its replica: it keeps that
segment resident (its "local segment") and broadcasts it in one collective — the coalesced
broadcast per owner. Other segments are received into buffers that exist only while the boundary
is unsharded (their storage is resized to 0 in between, so the unsharded parameters built over
them survive as autograd leaves, as in FSDP2).

In HSDP, every replica's rank ``(s, r)`` holds segment ``s``. Its true owner ``(s, r0)`` publishes
its slice after each step over the replicate group; the other replicas receive it into the same
slice. Gradients take the reverse path: reduce over the shard group to ``(s, r)``, then each
owner's slice over the replicate group to ``(s, r0)``. Each gradient travels with one extra
element, 1 where the rank produced a gradient and 0 where it did not, so the owner knows whether
any rank produced one (a parameter unused everywhere keeps ``grad=None``, like in one process).

[Note: expert segments]
Under expert parallelism the expert pieces of a boundary travel on their stack's expert mesh
([Note: expert meshes] in ``dmuon.mesh``): they form segments of their own, after the
boundary's other segments, whose shard index and replicas are the expert grid's coordinates of
their owners, and whose broadcasts, reduces and publishes run on the expert mesh's groups. Each
segment carries the mesh it travels on; nothing else differs.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from dmuon import _profiler_labels as labels
from dmuon import collectives
from dmuon._torch_internals import foreach_add_, foreach_div_, profiler_range
from dmuon.collectives import Handle
from dmuon.experts import stacks_of
from dmuon.mesh import OwnershipMesh
from dmuon.param import (
    DedicatedParam,
    ParameterSlot,
    follow_requires_grad,
    register_placeholder,
    register_unsharded,
)
from dmuon.partition import OwnerCoord
from dmuon.storage import allocate_storage, free_storage

# [Note: aligned gradients in a message]
# A segment's gradient message holds, per parameter in buffer order, an entry: the flattened
# gradient, one flag element (1 where this rank produced it; reduced, whether any rank did), and
# zeros up to the next multiple of MESSAGE_ALIGNMENT elements. The owners' averaged gradients
# are views of their messages made fp32 (``assign_to_masters``), so each starts 32-byte aligned
# and the step's element-wise kernels read it with full-width vector loads. With the flag alone
# between gradients, every gradient after the first sat at a 4-byte offset and took scalar
# loads. The padding costs at most 8 elements a parameter.
MESSAGE_ALIGNMENT = 8  # elements: 16 bytes in a bf16 message, 32 in fp32


def message_entry_numel(numel: int) -> int:
    """Elements a gradient of ``numel`` elements takes in a message: itself, its flag, and the
    zeros that align the next one."""
    return -(-(numel + 1) // MESSAGE_ALIGNMENT) * MESSAGE_ALIGNMENT


@dataclass(eq=False, slots=True, kw_only=True)
class Segment:
    mesh: OwnershipMesh  # the grid its collectives run on: the boundary's, or an expert mesh
    shard: int  # shard index of the root on ``mesh``
    dtype: torch.dtype  # compute dtype: the broadcast buffer's
    # The gradient message's: the widest of its parameters' reduce dtypes, fixed at layout.
    reduce_dtype: torch.dtype
    params: list[DedicatedParam]  # sorted by owner replica
    is_local: bool  # this rank is the segment's root in its replica
    buffer: torch.Tensor  # (numel,) in the compute dtype
    # Per owner replica: its slice of the values [start, end) and of the gradient message.
    value_ranges: dict[int, tuple[int, int]] = field(default_factory=dict)
    message_ranges: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.buffer.numel()


@dataclass(eq=False, slots=True)
class GradientMessage:
    """One segment's gradients on their way to its owners (see ``assign_to_masters``)."""

    segment: Segment
    message: torch.Tensor  # packed gradients and their flags, in the reduce dtype
    handle: Handle
    # Whether this rank produced each gradient, known on the host: the reduced flags when the
    # reduce moves nothing (one owner slot), so reading them needs no device synchronisation.
    produced: list[bool] | None = None


class BoundaryGroup:
    """The dedicated parameters moved by one hook-boundary module."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[DedicatedParam],
        mesh: OwnershipMesh,
        reshard_after_forward: bool,
    ) -> None:
        self.name = name  # the module's FQN ("" for the root)
        self.module = module
        self.params = params
        # Expert stacks among them: see [Note: expert stacks are pieces] in ``dmuon.experts``.
        self.stacks = list(stacks_of(params).values())
        # The module parameters the boundary swaps: each plain one, and each stack once.
        self.slots: list[ParameterSlot] = [p for p in params if p.stack is None] + self.stacks
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.segments: list[Segment] = []
        self.is_unsharded = False
        self._pending_unshard: list[Handle] = []
        self._pending_publish: list[Handle] = []
        self._pending_reduce: list[GradientMessage] = []
        # Where the boundary is in the pass (see [Note: backward passes of one forward]), moved
        # only by the pass methods below: grad-enabled forwards in this forward pass,
        # post-backwards seen in this backward, whether its backward began, and whether this
        # backward has finished it (freed, and its gradients on their way to the owners).
        self._forward_count = 0
        self._backward_count = 0
        self._in_backward = False
        self._finished_backward = False

    # ---- layout ----------------------------------------------------------------------------

    def build_segments(self, device: torch.device) -> None:
        """Lay out the segments and bind every unsharded parameter to its slice."""

        coords = {id(p): self.coord_on_mesh(p) for p in self.params}

        def segment_key(p: DedicatedParam) -> tuple[bool, int, str]:
            return self._mesh_of(p) is not self.mesh, coords[id(p)].shard, str(p.param_dtype)

        ordered = sorted(self.params, key=lambda p: (*segment_key(p), coords[id(p)].replicate))
        for (_, shard, _), members in itertools.groupby(ordered, key=segment_key):
            members = list(members)
            mesh = self._mesh_of(members[0])
            segment = self._make_segment(mesh, shard, members, device, coords)
            self.segments.append(segment)

    def _mesh_of(self, p: DedicatedParam) -> OwnershipMesh:
        """The grid ``p`` travels on: its expert mesh (see [Note: expert segments]) or the
        boundary's."""
        mesh = getattr(p.stack, "mesh", None)
        return self.mesh if mesh is None else mesh

    def coord_on_mesh(self, p: DedicatedParam) -> OwnerCoord:
        """``p``'s owner as a coordinate of the grid it travels on."""
        mesh = self._mesh_of(p)
        if mesh is self.mesh:
            return p.owner
        return mesh.coord_of_rank(self.mesh.global_rank(p.owner))

    def _make_segment(
        self,
        mesh: OwnershipMesh,
        shard: int,
        members: list[DedicatedParam],
        device: torch.device,
        coords: dict[int, OwnerCoord],
    ) -> Segment:
        dtype = members[0].param_dtype
        numel = sum(p.numel for p in members)
        is_local = shard == mesh.coord.shard
        segment = Segment(
            mesh=mesh,
            shard=shard,
            dtype=dtype,
            reduce_dtype=max((p.reduce_dtype for p in members), key=lambda d: d.itemsize),
            params=members,
            is_local=is_local,
            buffer=torch.empty(numel, dtype=dtype, device=device),
        )
        value_offset = message_offset = 0
        for replicate, owned in itertools.groupby(members, key=lambda p: coords[id(p)].replicate):
            owned = list(owned)
            value_start, message_start = value_offset, message_offset
            for p in owned:
                p.segment_offset = value_offset
                value_offset += p.numel
                message_offset += message_entry_numel(p.numel)
            segment.value_ranges[replicate] = (value_start, value_offset)
            segment.message_ranges[replicate] = (message_start, message_offset)
        for p in members:
            p.bind_unsharded(segment.buffer)
        if not is_local:
            free_storage(segment.buffer)
        return segment

    def _root_rank(self, segment: Segment) -> int:
        mesh = segment.mesh
        return mesh.global_rank(OwnerCoord(segment.shard, mesh.coord.replicate))

    # ---- adoption: the weights become the owners' ------------------------------------------

    def adopt(self) -> None:
        """Fill the local segment from the module's full weights and create the fp32 masters.

        Every rank of segment ``s`` fills it from its own copy of the weights; in HSDP the owners
        then publish theirs synchronously, so the replicas start from the owner's values.
        """
        with torch.no_grad():
            for segment in self.segments:
                if not segment.is_local:
                    continue
                for p in segment.params:
                    assert p.original is not None
                    view = _slice(segment.buffer, p.segment_offset, p.local_shape)
                    original = p.local_value(p.original.detach())
                    view.copy_(original)
                    if p.is_owner:
                        p.master = _make_master(view, original, p.requires_grad)
        for p in self.params:
            p.original = None
        self.publish()
        self.wait_for_publish()

    def local_values(self) -> Iterator[tuple[DedicatedParam, torch.Tensor]]:
        """Each parameter of the local segments with its value there (``local_shape``, the
        compute dtype): a view of a buffer the local segment keeps for its life (only the other
        segments' storage comes and goes), so a view taken once stays valid."""
        for segment in self.segments:
            if segment.is_local:
                for p in segment.params:
                    yield p, _slice(segment.buffer, p.segment_offset, p.local_shape)

    def refresh_from_masters(self) -> None:
        """Copy updated fp32 masters into the local segment: a no-op where they alias it, where
        the step's update already wrote it (``DedicatedParam.segment_fresh``, which this
        consumes) and where the step already copied an offloaded one (``dmuon.offload``)."""
        with torch.no_grad():
            for p, view in self.local_values():
                if p.master is None:
                    continue
                if p.segment_fresh:
                    p.segment_fresh = False
                    continue
                source = p.master if p.offload is None else p.offload.value_for_segment(p)
                if source is None:
                    continue
                if view.data_ptr() != source.data_ptr():
                    view.copy_(source)

    def refresh_master(self, p: DedicatedParam) -> None:
        """Copy ``p``'s master, as the optimizer holds it now, into its local segment: the
        offloaded step's copy before the master goes home (``dmuon.offload``)."""
        with torch.no_grad():
            for segment in self.segments:
                if segment.is_local and any(q is p for q in segment.params):
                    _slice(segment.buffer, p.segment_offset, p.local_shape).copy_(p.master)

    def load_full_value(self, p: DedicatedParam, value: torch.Tensor) -> None:
        """Write a full value of ``p`` into its master (owner) and its local segment, if any."""
        value = p.local_value(value)
        with torch.no_grad():
            for segment in self.segments:
                if segment.is_local and p in segment.params:
                    _slice(segment.buffer, p.segment_offset, p.local_shape).copy_(value)
            if p.master is not None:
                p.master_value().copy_(value)

    # ---- forward/backward: broadcast from owners, free ---------------------------------------

    def unshard(self) -> None:
        """Issue the broadcasts of every segment from its root (returns without waiting)."""
        if self.is_unsharded or self._pending_unshard:
            return
        # A local segment is the broadcast source: its pending publish must land first.
        self.wait_for_publish()
        with self._phase(labels.BROADCAST):
            for segment in self.segments:
                if not segment.is_local:
                    allocate_storage(segment.buffer)
                self._pending_unshard.append(
                    collectives.broadcast(
                        segment.buffer,
                        self._root_rank(segment),
                        segment.mesh.shard_group,
                        f"the weights of boundary {self.label}",
                    )
                )

    def _phase(self, label: str) -> contextlib.AbstractContextManager:
        """The profiler range of one of this boundary's phases: see [Note: profiler labels]."""
        return profiler_range(lambda: labels.of_boundary(label, self.name))

    @property
    def label(self) -> str:
        """The boundary as messages name it: its module's FQN, quoted, or the root module."""
        return repr(self.name) if self.name else "the root module"

    @property
    def is_unsharding(self) -> bool:
        """Broadcasts issued (e.g. by a prefetch) and not waited for yet."""
        return bool(self._pending_unshard)

    @property
    def device(self) -> torch.device:
        return self.segments[0].buffer.device

    def wait_for_unshard(self) -> None:
        if self.is_unsharded:
            return
        self.unshard()
        with self._phase(labels.BROADCAST_WAIT):
            collectives.wait_all(self._pending_unshard)
            self._pending_unshard.clear()
            for stack in self.stacks:  # the pieces have landed: the module's stacks take them
                stack.fill_from_pieces()
        self.is_unsharded = True

    def reshard(self) -> None:
        if self._pending_unshard:  # a prefetch that was never consumed
            self.wait_for_unshard()
        for segment in self.segments:
            if not segment.is_local:
                free_storage(segment.buffer)
        for stack in self.stacks:
            stack.free()
        self.is_unsharded = False

    def follow_requires_grad(self) -> None:
        for slot in self.slots:
            follow_requires_grad(slot)

    def register_unsharded(self) -> None:
        for slot in self.slots:
            register_unsharded(slot)

    def register_placeholders(self) -> None:
        for slot in self.slots:
            register_placeholder(slot)

    # ---- one forward and backward pass --------------------------------------------------------

    def pre_forward(self, *, backward_follows: bool) -> None:
        """Its forward begins: the weights land and the module holds them. ``backward_follows``
        (grad enabled) counts one more use whose post-backward to expect."""
        with self._phase(labels.PRE_FORWARD):
            self.wait_for_unshard()
            self.follow_requires_grad()
            self.register_unsharded()
        if backward_follows:
            self._forward_count += 1

    def recompute_forward(self) -> None:
        """Its forward re-runs inside backward (activation checkpointing): the weights, already
        unsharded by its pre-backward, are registered again; nothing is counted."""
        self.wait_for_unshard()
        self.register_unsharded()

    def post_forward(self, *, backward_follows: bool) -> None:
        """Its forward ended: placeholders back; the weights freed under Z3, or when no backward
        will come through this use (outputs that need no grad)."""
        self.register_placeholders()
        if self.reshard_after_forward or not backward_follows:
            self.reshard()

    def pre_backward(self) -> bool:
        """A gradient reached its outputs. True the first time in this backward: the weights are
        then unsharded again and registered (the caller prefetches the previous boundary)."""
        if self._in_backward:
            return False
        self._in_backward = True
        with self._phase(labels.PRE_BACKWARD):
            self.wait_for_unshard()
            self.register_unsharded()
        return True

    def post_backward(self) -> bool:
        """One use's backward is done; True when it was the last use of the forward pass and
        the boundary's backward is not finished yet (the caller finishes it)."""
        self._backward_count += 1
        return self._backward_count == self._forward_count and not self._finished_backward

    @property
    def finished_backward(self) -> bool:
        return self._finished_backward

    def finish_backward(self, *, reduce: bool) -> None:
        """Placeholders back, weights freed, and (``reduce``) this rank's gradients on their way
        to the owners; without ``reduce`` (``no_sync``) they stay on the unsharded parameters."""
        self._in_backward = False
        with self._phase(labels.POST_BACKWARD):
            self.register_placeholders()
            self.reshard()
            if reduce:
                self.reduce_gradients()
        self._finished_backward = True

    def finalize_backward(self, *, reduce: bool) -> list[GradientMessage]:
        """At the end of backward: wait for the reduces (``reduce``) and get ready for another
        backward through the same forward; returns the reduced messages of the local segments."""
        received = self.finish_reduce() if reduce else []
        self._in_backward = self._finished_backward = False
        self._backward_count = 0
        return received

    def forget_forward_pass(self) -> None:
        """A new forward pass begins after a backward: no use of the last one is expected."""
        self._forward_count = 0

    # ---- backward: gradients to the owners --------------------------------------------------

    def reduce_gradients(self) -> None:
        """Pack this rank's gradients per segment and start reducing them to the segment roots."""
        with self._phase(labels.REDUCE):
            for stack in self.stacks:  # an expert stack's gradient goes to its pieces' owners
                stack.split_gradient()
            for segment in self.segments:
                alone = segment.mesh.num_slots == 1
                message, produced = _pack_gradients(segment)
                handle = collectives.reduce_sum(
                    message,
                    self._root_rank(segment),
                    segment.mesh.shard_group,
                    f"the gradients of boundary {self.label}",
                )
                self._pending_reduce.append(
                    GradientMessage(segment, message, handle, produced if alone else None)
                )

    def retire_sent_reduces(self) -> None:
        """Wait for the reduces of the segments this rank does not own and drop their messages.

        Nothing reads such a message once it is sent, so its memory returns now instead of at
        the end of backward (on 8 ranks, 7/8 of the model's gradients in fp32 would otherwise
        pile up). No collective is issued: the protocol's order stays as it is."""
        kept = []
        for item in self._pending_reduce:
            if item.segment.is_local:
                kept.append(item)
            else:
                item.handle.wait()
        self._pending_reduce = kept

    def finish_reduce(self) -> list[GradientMessage]:
        """Wait for this boundary's reduces and run the replicate stage; returns the reduced
        messages of the local segments for ``average_messages``."""
        pending, self._pending_reduce = self._pending_reduce, []
        with self._phase(labels.REDUCE_WAIT):
            for item in pending:
                if not item.segment.is_local:
                    item.handle.wait()
            return self._complete_local(pending)

    def land_local_reduces(self) -> list[GradientMessage]:
        """The overlapped step (``dmuon.overlap``), during backward: wait for the reduces of
        the local segments only and run their replicate stage now; returns their messages. The
        sent messages of the other segments stay pending for ``retire_sent_reduces`` (waited
        for on the compute stream: their memory returns to it) and ``finish_reduce``."""
        local = [item for item in self._pending_reduce if item.segment.is_local]
        self._pending_reduce = [item for item in self._pending_reduce if not item.segment.is_local]
        with self._phase(labels.REDUCE_WAIT):
            return self._complete_local(local)

    def _complete_local(self, pending: list[GradientMessage]) -> list[GradientMessage]:
        """Wait for the reduces of the local segments among ``pending`` and run their replicate
        stage; returns their messages."""
        second_stage: list[Handle] = []
        for item in pending:
            if not item.segment.is_local:
                continue
            item.handle.wait()
            for replicate, (start, end) in item.segment.message_ranges.items():
                mesh = item.segment.mesh
                owner = mesh.global_rank(OwnerCoord(item.segment.shard, replicate))
                second_stage.append(
                    collectives.reduce_sum(
                        item.message[start:end],
                        owner,
                        mesh.replicate_group,
                        f"the gradients of boundary {self.label}, across replicas",
                    )
                )
        collectives.wait_all(second_stage)
        return [item for item in pending if item.segment.is_local]

    # ---- after the step: publish across replicas ---------------------------------------------

    def publish(self) -> None:
        """Start broadcasting each owner's slice of the local segments over the replicate axis."""
        self.wait_for_publish()
        for segment in self.segments:
            mesh = segment.mesh
            if not segment.is_local or mesh.replicate_group is None:
                continue
            for replicate, (start, end) in segment.value_ranges.items():
                src = mesh.global_rank(OwnerCoord(segment.shard, replicate))
                self._pending_publish.append(
                    collectives.broadcast(
                        segment.buffer[start:end],
                        src,
                        mesh.replicate_group,
                        f"the new weights of boundary {self.label}, across replicas",
                    )
                )

    def wait_for_publish(self) -> None:
        if not self._pending_publish:
            return
        with self._phase(labels.WAIT_PUBLISH):
            collectives.wait_all(self._pending_publish)
            self._pending_publish.clear()


def _pack_gradients(segment: Segment) -> tuple[torch.Tensor, list[bool]]:
    """The segment's gradient message in its reduce dtype (see [Note: aligned gradients in a
    message]), and which gradients this rank produced; clears the grads."""
    dtype = segment.reduce_dtype
    pieces, produced = [], []
    for p in segment.params:
        grad = p.local_grad()
        device = p.unsharded.device
        produced.append(grad is not None)
        entry = message_entry_numel(p.numel)
        if grad is None:  # zeros, and a zero flag
            pieces.append(torch.zeros(entry, dtype=dtype, device=device))
        else:
            pieces += [grad.reshape(-1).to(dtype), _flag_tail(entry - p.numel, dtype, device)]
            p.unsharded.grad = None
    return torch.cat(pieces), produced


@dataclass(eq=False, slots=True)
class AveragedGradients:
    """Reduced messages made fp32 and divided, before their gradients reach the masters.

    ``average_messages`` makes one (no host synchronisation), ``assign_to_masters`` consumes a
    list of them; the overlapped step (``dmuon.overlap``) averages each boundary's messages as
    they land during backward and reads the gradients from ``averaged`` before the masters get
    them: ``averaged[index][start : start + p.numel]`` for each ``(p, index, start)`` of
    ``owned``."""

    owned: list[tuple[DedicatedParam, int, int]]  # (p, index of its message, offset)
    averaged: list[torch.Tensor]  # fp32 messages, divided (a message itself when it was fp32)
    # Whether any rank produced each owned gradient: known on the host (one owner slot) or
    # the reduced flags on the device, copied before the division changed them.
    host_flags: list[bool] | None
    device_flags: torch.Tensor | None


def average_messages(received: list[GradientMessage], divisor: float) -> AveragedGradients:
    """The owned gradients of ``received`` in fp32, divided by ``divisor``; no host sync."""
    owned, flags, host_flags = [], [], []
    for index, item in enumerate(received):
        start = 0
        for position, p in enumerate(item.segment.params):
            if p.is_owner and p.master is not None:
                owned.append((p, index, start))
                flags.append(item.message[start + p.numel : start + p.numel + 1])
                host_flags.append(item.produced[position] if item.produced is not None else None)
            start += message_entry_numel(p.numel)
    if not owned:
        return AveragedGradients([], [], [], None)
    device_flags = None
    if None in host_flags:  # copied before the division below changes the flags
        host_flags, device_flags = None, torch.cat(flags)
    averaged = [item.message.to(torch.float32) for item in received]  # no copy when fp32
    if divisor != 1:  # a sum over the ranks (divide factor 1.0) is kept as it is
        foreach_div_(averaged, divisor)
    return AveragedGradients(owned, averaged, host_flags, device_flags)


def assign_to_masters(parts: list[AveragedGradients]) -> None:
    """Add the owners' gradients, summed over the grid and divided (``average_messages``: by G x
    R for the mean, or the model's gradient divide factor, see ``dmuon.data_parallel``), to
    their masters' ``.grad``.

    A gradient that no rank produced leaves ``.grad`` untouched (None stays None). Whether one
    was produced is read in one device-to-host copy for the whole backward, every part at once
    (none with one owner slot, where the host knows). A new gradient is a view of its message,
    made fp32 and divided in place: no copy; an existing one takes the sum, in one multi-tensor
    add."""
    parts = [part for part in parts if part.owned]
    if not parts:
        return
    device_flags = [part.device_flags for part in parts if part.device_flags is not None]
    read = iter(torch.cat(device_flags).tolist() if device_flags else [])
    new, existing = [], []
    for part in parts:
        host_flags = part.host_flags
        if host_flags is None:
            host_flags = [next(read) for _ in part.owned]
        for (p, index, start), produced in zip(part.owned, host_flags):
            if produced:
                grad = part.averaged[index][start : start + p.numel].view(p.local_shape)
                (existing if p.master.grad is not None else new).append((p, grad))
    for p, grad in new:
        p.master.grad = grad
    if existing:
        foreach_add_([p.master.grad for p, _ in existing], [g for _, g in existing])


_FLAG_TAILS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _flag_tail(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A produced gradient's flag (one) and the zeros after it; one tensor per kind, reused
    (``torch.cat`` only reads it)."""
    key = (numel, dtype, device)
    if key not in _FLAG_TAILS:
        tail = torch.zeros(numel, dtype=dtype, device=device)
        tail[0] = 1
        _FLAG_TAILS[key] = tail
    return _FLAG_TAILS[key]


def _slice(buffer: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    return buffer[offset : offset + math.prod(shape)].view(shape)


def _make_master(view: torch.Tensor, original: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    if view.dtype == torch.float32:
        # The compute dtype is fp32: the master is the local segment itself, no second copy.
        return nn.Parameter(view, requires_grad=requires_grad)
    return nn.Parameter(original.to(torch.float32).clone(), requires_grad=requires_grad)
