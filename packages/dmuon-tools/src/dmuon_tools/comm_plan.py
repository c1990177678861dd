"""``summarize_comm_plan``: the collectives dmuon issues per training step, estimated from its plan.

Owns the estimate of dmuon's own communication (never FSDP2's all-gathers and reduce-scatters of
the other parameters) from the boundaries' segment layout and the owner grid, both read from
``dmuon.inspect``. Rank-local and without collectives: every rank knows the whole plan, so it can
also total what all ranks issue. It must not measure anything; ``tests/tools`` checks these numbers against the c10d ops counted
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

[Note: expert segments in the estimate]
Under expert parallelism the expert pieces travel in segments of their own on their EP slot's
grid ([Note: expert segments] in ``dmuon.group``): G is then the slot's expert-FSDP size, not the
boundary's, ``s`` a shard index of that grid, and only the slot's ranks take part. So every
segment is read on the groups ``dmuon.inspect`` gives it (``SegmentView.shard_ranks`` and
``replicate_ranks``), never on the main grid. A rank sees its own EP slot's expert segments only;
the all-ranks totals count each of them once per EP slot (every slot holds as many experts, cut
alike: the bytes are exact, the count of collectives too unless some slot's owners differ in how
many of them hold pieces of a boundary).

A gradient message is, per parameter, its values, one flag element and zeros up to a multiple of
8 elements, in the reduce dtype (``param_policy`` reduce dtype, else the compute dtype; the widest
when a segment mixes them).
Byte counts are logical payloads, not wire traffic: ``payload_bytes`` sums the tensor of every op
a rank takes part in; ``sent_bytes`` is what leaves a rank (a broadcast root's tensor once per
op; a non-root's reduce contribution); ``received_bytes`` what arrives (a non-root's broadcast
tensor; ``group - 1`` contributions at a reduce root).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

import dmuon.inspect
from dmuon.inspect import BoundaryView, OwnerCoord, OwnerGrid, SegmentView
from dmuon_tools._json import dtype_name, owner_dict, this_rank
from dmuon_tools.owner_load import summarize_owner_loads

COLLECTIVE_KINDS = ("shard_broadcast", "shard_reduce", "replicate_reduce", "replicate_publish")

ESTIMATE_NOTE = (
    "Estimated from the ownership plan, not measured: dmuon's collectives for one forward, one "
    "backward and one optimizer step without gradient accumulation (each no_sync micro-batch adds "
    "its own broadcasts). Logical payload bytes, not wire traffic. FSDP2's all-gathers and "
    "reduce-scatters of the non-dedicated parameters are not included."
)


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


def _traffic_of_rank(
    boundaries: tuple[BoundaryView, ...], coord: OwnerCoord
) -> dict[str, _Traffic]:
    """What this rank (at ``coord``) issues in one step, per collective kind."""
    traffic = {kind: _Traffic() for kind in COLLECTIVE_KINDS}
    for boundary in boundaries:
        passes = boundary.broadcasts_per_step
        for segment in boundary.segments:
            shards, replicas = len(segment.shard_ranks), len(segment.replicate_ranks)
            is_root = segment.is_local
            if shards > 1:
                value, message = segment.value_bytes, segment.message_bytes
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
                for owned in segment.slices:
                    is_owner = owned.owner.replicate == coord.replicate
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
    boundaries: tuple[BoundaryView, ...], grid: OwnerGrid
) -> dict[str, _Traffic]:
    """The sum of :func:`_traffic_of_rank` over every rank of the grid, in closed form (see
    [Note: expert segments in the estimate])."""
    traffic = {kind: _Traffic() for kind in COLLECTIVE_KINDS}
    for boundary in boundaries:
        passes = boundary.broadcasts_per_step
        for segment in boundary.segments:
            shards, replicas = len(segment.shard_ranks), len(segment.replicate_ranks)
            # 1, or the number of EP slots for an expert segment: each runs its own copy
            copies = grid.num_slots // (shards * replicas)
            if shards > 1:
                value, message = segment.value_bytes, segment.message_bytes
                # Every replica (and EP slot) runs the same collectives on its own G ranks.
                groups = copies * replicas
                traffic["shard_broadcast"].add(
                    collectives=groups * shards * passes,
                    payload=groups * shards * passes * value,
                    sent=groups * passes * value,
                    received=groups * (shards - 1) * passes * value,
                )
                traffic["shard_reduce"].add(
                    collectives=groups * shards,
                    payload=groups * shards * message,
                    sent=groups * (shards - 1) * message,
                    received=groups * (shards - 1) * message,
                )
            if replicas > 1:
                for owned in segment.slices:
                    traffic["replicate_reduce"].add(
                        collectives=copies * replicas,
                        payload=copies * replicas * owned.message_bytes,
                        sent=copies * (replicas - 1) * owned.message_bytes,
                        received=copies * (replicas - 1) * owned.message_bytes,
                    )
                    traffic["replicate_publish"].add(
                        collectives=copies * replicas,
                        payload=copies * replicas * owned.value_bytes,
                        sent=copies * owned.value_bytes,
                        received=copies * (replicas - 1) * owned.value_bytes,
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
        ``root_rank`` in this rank's replica, ``group_ranks`` (the ranks its broadcasts and
        first reduce run on: this rank's replica, for expert pieces that of its EP slot, see
        [Note: expert segments in the estimate]), ``replicate_ranks``, ``is_local``, ``num_params``, ``numel``,
        ``dtype``, ``bytes``, ``reduce_dtype``, ``message_bytes``, ``owners`` — per owner replica
        its ``rank``, ``value_bytes`` (publish) and ``message_bytes`` (second-stage reduce) —
        and ``params``);
        ``this_rank`` and ``all_ranks``: per collective kind (``shard_broadcast``,
        ``shard_reduce``, ``replicate_reduce``, ``replicate_publish``) and in total:
        ``collectives``, ``payload_bytes``, ``sent_bytes``, ``received_bytes`` per step;
        ``load``: the partition's per-owner load and imbalance.
    """
    view = dmuon.inspect.view(model)
    grid = view.grid
    return {
        "estimate": True,
        "note": ESTIMATE_NOTE,
        "rank": this_rank(),
        "coord": owner_dict(grid.coord),
        "num_shards": grid.num_shards,
        "num_replicas": grid.num_replicas,
        "adopted": view.is_adopted,
        "boundaries": [_boundary_entry(boundary) for boundary in view.boundaries],
        "this_rank": _traffic_dict(_traffic_of_rank(view.boundaries, grid.coord)),
        "all_ranks": _traffic_dict(_traffic_of_all_ranks(view.boundaries, grid)),
        "load": summarize_owner_loads(view.plan, grid=grid),
    }


def _boundary_entry(boundary: BoundaryView) -> dict[str, Any]:
    return {
        "name": boundary.name,
        "reshard_after_forward": boundary.reshard_after_forward,
        "broadcasts_per_step": boundary.broadcasts_per_step,
        "num_params": len(boundary.params),
        "unshard_bytes": boundary.value_bytes,
        "reduce_message_bytes": boundary.message_bytes,
        "segments": [_segment_entry(segment) for segment in boundary.segments],
    }


def _segment_entry(segment: SegmentView) -> dict[str, Any]:
    return {
        "shard": segment.shard,
        "root_rank": segment.root_rank,
        "group_ranks": list(segment.shard_ranks),
        "replicate_ranks": list(segment.replicate_ranks),
        "is_local": segment.is_local,
        "num_params": len(segment.params),
        "numel": segment.numel,
        "dtype": dtype_name(segment.dtype),
        "bytes": segment.value_bytes,
        "reduce_dtype": dtype_name(segment.reduce_dtype),
        "message_bytes": segment.message_bytes,
        "owners": [
            {
                "replicate": owned.owner.replicate,
                "rank": owned.owner_rank,
                "num_params": len(owned.params),
                "value_bytes": owned.value_bytes,
                "message_bytes": owned.message_bytes,
            }
            for owned in segment.slices
        ],
        "params": list(segment.params),
    }
