"""``summarize_comm_plan``: the collectives dmuon issues per training step, estimated from its plan.

Owns the estimate of dmuon's own communication (never FSDP2's all-gathers and reduce-scatters of
the other parameters) from the boundaries' segment layout and the owner grid. Rank-local and
without collectives: every rank knows the whole plan, so it can also total what all ranks issue.
It must not measure anything; ``tests/tools`` checks these numbers against the c10d ops counted
in a real step.

What one step issues (one forward, one backward, one ``optimizer.step()``, no ``no_sync``
micro-batches), per hook boundary and per segment ``s`` (the parameters owned by shard index s):

=====================  ========================  ===============================================
kind                   group                     per step
=====================  ========================  ===============================================
shard_broadcast        the G ranks of a replica  1 (Z2) or 2 (Z3: again in backward), root (s, r)
shard_reduce           the G ranks of a replica  1 gradient message, to (s, r)
replicate_reduce       the R ranks of shard s    1 per owner slice of segment s, to its owner
replicate_publish      the R ranks of shard s    1 per owner slice, from its owner, after step()
=====================  ========================  ===============================================

A gradient message is the values plus one flag element per parameter, in the reduce dtype
(``param_policy`` reduce dtype, else the compute dtype; the widest when a segment mixes them).
Byte counts are logical payloads, not wire traffic: ``payload_bytes`` sums the tensor of every op
a rank takes part in; ``sent_bytes`` is what leaves a rank (a broadcast root's tensor once per
op; a non-root's reduce contribution); ``received_bytes`` what arrives (a non-root's broadcast
tensor; ``group - 1`` contributions at a reduce root).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dmuon.api import get_dedicated_state
from dmuon.group import BoundaryGroup, Segment
from dmuon.hooks import DedicatedState
from dmuon.mesh import OwnershipMesh
from dmuon.param import DedicatedParam
from dmuon.partition import OwnerCoord
from dmuon_tools._state import dtype_name, itemsize, owner_dict, this_rank, widest
from dmuon_tools.owner_load import summarize_owner_loads

COLLECTIVE_KINDS = ("shard_broadcast", "shard_reduce", "replicate_reduce", "replicate_publish")

ESTIMATE_NOTE = (
    "Estimated from the ownership plan, not measured: dmuon's collectives for one forward, one "
    "backward and one optimizer step without gradient accumulation (each no_sync micro-batch adds "
    "its own broadcasts). Logical payload bytes, not wire traffic. FSDP2's all-gathers and "
    "reduce-scatters of the non-dedicated parameters are not included."
)


@dataclass(frozen=True, slots=True)
class OwnerSlice:
    """The part of a segment owned by one replica's slot ``(shard, replicate)``."""

    replicate: int
    params: tuple[str, ...]
    value_bytes: int  # published across replicas after the step
    message_bytes: int  # reduced across replicas to the owner (stage 2)


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """One coalesced broadcast / reduce of a boundary: the parameters of one shard index."""

    shard: int
    dtype: torch.dtype  # compute dtype of the broadcast buffer
    reduce_dtype: torch.dtype  # dtype of the gradient message
    params: tuple[str, ...]
    numel: int
    slices: tuple[OwnerSlice, ...]

    @property
    def value_bytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def message_bytes(self) -> int:
        return (self.numel + len(self.params)) * itemsize(self.reduce_dtype)


def segment_layouts(boundary: BoundaryGroup) -> list[SegmentLayout]:
    """The boundary's segments: read from the built buffers once the weights are adopted,
    otherwise laid out from the parameters the same way (meta-device models before
    ``to_empty()``)."""
    if boundary.segments:
        return [_layout_of_segment(segment) for segment in boundary.segments]
    return planned_segment_layouts(boundary.params)


def planned_segment_layouts(params: list[DedicatedParam]) -> list[SegmentLayout]:
    """Segments as ``BoundaryGroup.build_segments`` lays them out: one per (owner shard index,
    compute dtype), members sorted by owner replica."""

    def key(p: DedicatedParam) -> tuple[int, str]:
        return p.owner.shard, str(p.param_dtype)

    layouts = []
    ordered = sorted(params, key=lambda p: (*key(p), p.owner.replicate))
    for (shard, _), members in itertools.groupby(ordered, key=key):
        members = list(members)
        dtype = members[0].param_dtype
        reduce_dtype = _reduce_dtype(members)
        slices = []
        for replicate, owned in itertools.groupby(members, key=lambda p: p.owner.replicate):
            owned = list(owned)
            slices.append(
                OwnerSlice(
                    replicate=replicate,
                    params=tuple(p.fqn for p in owned),
                    value_bytes=sum(p.numel for p in owned) * itemsize(dtype),
                    message_bytes=sum(p.numel + 1 for p in owned) * itemsize(reduce_dtype),
                )
            )
        layouts.append(
            SegmentLayout(
                shard=shard,
                dtype=dtype,
                reduce_dtype=reduce_dtype,
                params=tuple(p.fqn for p in members),
                numel=sum(p.numel for p in members),
                slices=tuple(slices),
            )
        )
    return layouts


def _layout_of_segment(segment: Segment) -> SegmentLayout:
    reduce_dtype = _reduce_dtype(segment.params)
    slices = []
    for replicate, (start, end) in segment.value_ranges.items():
        message_start, message_end = segment.message_ranges[replicate]
        slices.append(
            OwnerSlice(
                replicate=replicate,
                params=tuple(p.fqn for p in segment.params if p.owner.replicate == replicate),
                value_bytes=(end - start) * itemsize(segment.dtype),
                message_bytes=(message_end - message_start) * itemsize(reduce_dtype),
            )
        )
    return SegmentLayout(
        shard=segment.shard,
        dtype=segment.dtype,
        reduce_dtype=reduce_dtype,
        params=tuple(p.fqn for p in segment.params),
        numel=segment.numel,
        slices=tuple(slices),
    )


def _reduce_dtype(params: list[DedicatedParam]) -> torch.dtype:
    # A gradient has its parameter's compute dtype unless the policy names a reduce dtype.
    return widest([p.reduce_dtype or p.param_dtype for p in params])


# ---- traffic per step ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Traffic:
    collectives: int = 0
    payload_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0

    def add(self, *, collectives: int, payload: int, sent: int, received: int) -> None:
        self.collectives += collectives
        self.payload_bytes += payload
        self.sent_bytes += sent
        self.received_bytes += received

    def as_dict(self) -> dict[str, int]:
        return {
            "collectives": self.collectives,
            "payload_bytes": self.payload_bytes,
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
        }


def _broadcasts_per_step(boundary: BoundaryGroup) -> int:
    return 2 if boundary.reshard_after_forward else 1


def _traffic_of_rank(
    boundaries: list[tuple[BoundaryGroup, list[SegmentLayout]]],
    mesh: OwnershipMesh,
    coord: OwnerCoord,
) -> dict[str, _Traffic]:
    """What the rank at ``coord`` issues in one step, per collective kind."""
    traffic = {kind: _Traffic() for kind in COLLECTIVE_KINDS}
    shards, replicas = mesh.num_shards, mesh.num_replicas
    for boundary, layouts in boundaries:
        passes = _broadcasts_per_step(boundary)
        for layout in layouts:
            is_root = layout.shard == coord.shard
            if shards > 1:
                value, message = layout.value_bytes, layout.message_bytes
                traffic["shard_broadcast"].add(
                    collectives=passes,
                    payload=passes * value,
                    sent=passes * value if is_root else 0,
                    received=0 if is_root else passes * value,
                )
                traffic["shard_reduce"].add(
                    collectives=1,
                    payload=message,
                    sent=0 if is_root else message,
                    received=(shards - 1) * message if is_root else 0,
                )
            if replicas > 1 and is_root:  # only the ranks holding segment s talk about it
                for owned in layout.slices:
                    is_owner = owned.replicate == coord.replicate
                    traffic["replicate_reduce"].add(
                        collectives=1,
                        payload=owned.message_bytes,
                        sent=0 if is_owner else owned.message_bytes,
                        received=(replicas - 1) * owned.message_bytes if is_owner else 0,
                    )
                    traffic["replicate_publish"].add(
                        collectives=1,
                        payload=owned.value_bytes,
                        sent=owned.value_bytes if is_owner else 0,
                        received=0 if is_owner else owned.value_bytes,
                    )
    return traffic


def _traffic_of_all_ranks(
    boundaries: list[tuple[BoundaryGroup, list[SegmentLayout]]], mesh: OwnershipMesh
) -> dict[str, _Traffic]:
    """The sum of :func:`_traffic_of_rank` over every rank of the grid, in closed form."""
    traffic = {kind: _Traffic() for kind in COLLECTIVE_KINDS}
    shards, replicas = mesh.num_shards, mesh.num_replicas
    for boundary, layouts in boundaries:
        passes = _broadcasts_per_step(boundary)
        for layout in layouts:
            if shards > 1:
                value, message = layout.value_bytes, layout.message_bytes
                # Every replica runs the same segment collectives on its own G ranks.
                traffic["shard_broadcast"].add(
                    collectives=replicas * shards * passes,
                    payload=replicas * shards * passes * value,
                    sent=replicas * passes * value,
                    received=replicas * (shards - 1) * passes * value,
                )
                traffic["shard_reduce"].add(
                    collectives=replicas * shards,
                    payload=replicas * shards * message,
                    sent=replicas * (shards - 1) * message,
                    received=replicas * (shards - 1) * message,
                )
            if replicas > 1:
                for owned in layout.slices:
                    traffic["replicate_reduce"].add(
                        collectives=replicas,
                        payload=replicas * owned.message_bytes,
                        sent=(replicas - 1) * owned.message_bytes,
                        received=(replicas - 1) * owned.message_bytes,
                    )
                    traffic["replicate_publish"].add(
                        collectives=replicas,
                        payload=replicas * owned.value_bytes,
                        sent=owned.value_bytes,
                        received=(replicas - 1) * owned.value_bytes,
                    )
    return traffic


def _traffic_dict(traffic: dict[str, _Traffic]) -> dict[str, Any]:
    total = _Traffic()
    for item in traffic.values():
        total.add(
            collectives=item.collectives,
            payload=item.payload_bytes,
            sent=item.sent_bytes,
            received=item.received_bytes,
        )
    return {
        "per_kind": {kind: item.as_dict() for kind, item in traffic.items()},
        "total": total.as_dict(),
    }


# ---- the summary --------------------------------------------------------------------------------


def summarize_comm_plan(model: nn.Module) -> dict[str, Any]:
    """Estimated per-step communication of dmuon's collectives, per boundary and in total.

    Rank-local, no collectives; plain JSON. The numbers are estimates from the plan (see
    ``note`` in the result and this module's docstring), not measurements.

    Returns a dict with:
        ``estimate`` (True), ``note``, ``rank``, ``coord`` (this rank's owner coordinate),
        ``num_shards``, ``num_replicas``, ``adopted``;
        ``boundaries``: per hook boundary, in order: ``name``, ``reshard_after_forward``,
        ``broadcasts_per_step``, ``num_params``, ``unshard_bytes`` (one broadcast pass, all
        segments), ``reduce_message_bytes`` and ``segments`` (per owner shard index: ``shard``,
        ``root_rank`` in this rank's replica, ``is_local``, ``num_params``, ``numel``,
        ``dtype``, ``bytes``, ``reduce_dtype``, ``message_bytes``, ``owners`` — per owner replica
        its ``rank``, ``value_bytes`` (publish) and ``message_bytes`` (second-stage reduce) —
        and ``params``);
        ``this_rank`` and ``all_ranks``: per collective kind (``shard_broadcast``,
        ``shard_reduce``, ``replicate_reduce``, ``replicate_publish``) and in total:
        ``collectives``, ``payload_bytes``, ``sent_bytes``, ``received_bytes`` per step;
        ``load``: the partition's per-owner load and imbalance.
    """
    state: DedicatedState = get_dedicated_state(model)
    mesh = state.mesh
    boundaries = [(boundary, segment_layouts(boundary)) for boundary in state.boundaries]
    return {
        "estimate": True,
        "note": ESTIMATE_NOTE,
        "rank": this_rank(),
        "coord": owner_dict(mesh.coord),
        "num_shards": mesh.num_shards,
        "num_replicas": mesh.num_replicas,
        "adopted": state.is_adopted,
        "boundaries": [
            _boundary_entry(boundary, layouts, mesh) for boundary, layouts in boundaries
        ],
        "this_rank": _traffic_dict(_traffic_of_rank(boundaries, mesh, mesh.coord)),
        "all_ranks": _traffic_dict(_traffic_of_all_ranks(boundaries, mesh)),
        "load": summarize_owner_loads(state.plan, global_rank=mesh.global_rank),
    }


def _boundary_entry(
    boundary: BoundaryGroup, layouts: list[SegmentLayout], mesh: OwnershipMesh
) -> dict[str, Any]:
    return {
        "name": boundary.name,
        "reshard_after_forward": boundary.reshard_after_forward,
        "broadcasts_per_step": _broadcasts_per_step(boundary),
        "num_params": len(boundary.params),
        "unshard_bytes": sum(layout.value_bytes for layout in layouts),
        "reduce_message_bytes": sum(layout.message_bytes for layout in layouts),
        "segments": [_segment_entry(layout, mesh) for layout in layouts],
    }


def _segment_entry(layout: SegmentLayout, mesh: OwnershipMesh) -> dict[str, Any]:
    return {
        "shard": layout.shard,
        "root_rank": mesh.global_rank(OwnerCoord(layout.shard, mesh.coord.replicate)),
        "is_local": layout.shard == mesh.coord.shard,
        "num_params": len(layout.params),
        "numel": layout.numel,
        "dtype": dtype_name(layout.dtype),
        "bytes": layout.value_bytes,
        "reduce_dtype": dtype_name(layout.reduce_dtype),
        "message_bytes": layout.message_bytes,
        "owners": [
            {
                "replicate": owned.replicate,
                "rank": mesh.global_rank(OwnerCoord(layout.shard, owned.replicate)),
                "num_params": len(owned.params),
                "value_bytes": owned.value_bytes,
                "message_bytes": owned.message_bytes,
            }
            for owned in layout.slices
        ],
        "params": list(layout.params),
    }
