"""What dmuon's partition means for a step: the heaviest owner, the segments, the HSDP pieces.

Owns running dmuon's own partition (``dmuon.inspect.plan_ownership``, the function
``dedicate_params`` runs) on a simulated layout and reading off what the step builder needs:
each owner slot's step time (batched Newton-Schulz and element-wise passes), the slot the step
waits for, each layer's broadcast segments (one per owner shard index) and, for the heaviest
owner's shard index, the pieces its replicate group reduces and publishes; and the overlapped
step's chunks of the heaviest owner's layers, cut by dmuon's own rule
(``dmuon.inspect.speculation_chunks``). Pure.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass

from dmuon.inspect import (
    OwnershipPlan,
    ParamSpec,
    layer_id_of,
    plan_ownership,
    speculation_chunks,
)
from dmuon_tools.costs import (
    MUON_BYTES_PER_ELEMENT,
    OVERLAP_COMMIT_BYTES_PER_ELEMENT,
    elementwise_ms,
    owner_ns_ms,
)
from dmuon_tools.machine import Machine
from dmuon_tools.ns_table import shape_key
from dmuon_tools.workload import Layout, ModelSizes, layer_index


@dataclass(frozen=True, slots=True)
class SpeculationChunk:
    """One chunk of the overlapped step: consecutive layers whose owner work (momentum and
    Newton-Schulz batched within the chunk) starts once every one of them has landed."""

    layers: tuple[int, ...]  # in model order; the first lands last in backward
    ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Owners:
    """What the partition means for the step: the heaviest owner and the segments."""

    plan: OwnershipPlan
    step_ms_per_slot: tuple[float, ...]  # NS + element-wise of each owner slot
    heaviest_slot: int
    heaviest_shard: int
    heaviest_numel: int  # elements of the whole matrices the heaviest slot orthogonalises
    owned_numel_max: float  # per GPU (TP ranks split an owner's matrices)
    # per layer: numel of each segment (one per owner shard index), in shard order
    segments: tuple[tuple[int, ...], ...]
    # per layer: numel of each piece of the heaviest owner's shard index, per owner replica
    replica_pieces: tuple[tuple[int, ...], ...]
    # The overlapped step (``dmuon.Muon(overlap_step=True)``) of the heaviest slot: its chunks
    # in model order, and the commit left to ``step()`` (decay and update of its masters).
    overlap_chunks: tuple[SpeculationChunk, ...] = ()
    overlap_commit_ms: float = 0.0


def plan_owners(model: ModelSizes, layout: Layout, machine: Machine) -> Owners:
    specs = [
        ParamSpec(name=name, shape=dims, layer_id=layer_id_of(name))
        for layer in model.layers
        for name, dims in layer
    ]
    plan = plan_ownership(specs, layout.num_shards, layout.num_replicas, num_tp=layout.tp)
    shapes = {name: dims for layer in model.layers for name, dims in layer}
    counts: list[Counter[tuple[int, int]]] = [Counter() for _ in range(plan.num_slots)]
    # (slot, layer) -> NS shape counts: the overlapped step batches within a chunk of layers
    layer_counts: dict[tuple[int, int], Counter[tuple[int, int]]] = defaultdict(Counter)
    numel_per_owner: dict[tuple[int, int], float] = defaultdict(float)  # (shard, replicate)
    segments: list[dict[int, int]] = [defaultdict(int) for _ in model.layers]
    for name, owner in plan.owners.items():
        dims = shapes[name]
        counts[plan.slot_of(owner)][shape_key(dims)] += 1
        layer_counts[(plan.slot_of(owner), layer_index(name))][shape_key(dims)] += 1
        numel_per_owner[(owner.shard, owner.replicate)] += math.prod(dims)
        segments[layer_index(name)][owner.shard] += math.prod(dims)
    step_ms = tuple(
        owner_ns_ms(machine.ns_ms, slot_counts)
        + elementwise_ms(
            _numel(slot_counts),
            MUON_BYTES_PER_ELEMENT,
            machine.copy_gbps,
        )
        for slot_counts in counts
    )
    heaviest = max(range(plan.num_slots), key=lambda slot: (step_ms[slot], -slot))
    heaviest_shard = plan.owner_of_slot(heaviest).shard
    pieces: list[dict[int, int]] = [defaultdict(int) for _ in model.layers]
    for name, owner in plan.owners.items():
        if owner.shard == heaviest_shard:
            pieces[layer_index(name)][owner.replicate] += math.prod(shapes[name])
    heaviest_numel = _numel(counts[heaviest])
    overlap_chunks = _speculation_chunks(
        [layer_counts[(heaviest, layer)] for layer in range(len(model.layers))], machine
    )
    return Owners(
        plan=plan,
        step_ms_per_slot=step_ms,
        heaviest_slot=heaviest,
        heaviest_shard=heaviest_shard,
        heaviest_numel=heaviest_numel,
        owned_numel_max=max(numel_per_owner.values(), default=0.0) / layout.tp,
        segments=tuple(tuple(v for _, v in sorted(layer.items())) for layer in segments),
        replica_pieces=tuple(tuple(v for _, v in sorted(layer.items())) for layer in pieces),
        overlap_chunks=overlap_chunks,
        overlap_commit_ms=elementwise_ms(
            heaviest_numel, OVERLAP_COMMIT_BYTES_PER_ELEMENT, machine.copy_gbps
        ),
    )


def _speculation_chunks(
    layer_counts: list[Counter[tuple[int, int]]], machine: Machine
) -> tuple[SpeculationChunk, ...]:
    """The heaviest owner's layers (its NS shape counts per layer) cut into the overlapped step's
    chunks as ``dmuon.overlap`` cuts its boundaries, each chunk's owner work priced."""
    numel = {layer: _numel(counts) for layer, counts in enumerate(layer_counts)}
    owned = [layer for layer, elements in numel.items() if elements > 0]
    layers_of: dict[int, list[int]] = defaultdict(list)
    for layer, chunk in speculation_chunks(owned, numel).items():
        layers_of[chunk].append(layer)
    chunks = []
    for chunk in sorted(layers_of):
        counts = sum((layer_counts[layer] for layer in layers_of[chunk]), Counter())
        ms = owner_ns_ms(machine.ns_ms, counts) + elementwise_ms(
            sum(numel[layer] for layer in layers_of[chunk]),
            MUON_BYTES_PER_ELEMENT - OVERLAP_COMMIT_BYTES_PER_ELEMENT,
            machine.copy_gbps,
        )
        chunks.append(SpeculationChunk(layers=tuple(layers_of[chunk]), ms=ms))
    return tuple(chunks)


def _numel(counts: Counter[tuple[int, int]]) -> int:
    """Elements of the matrices an NS shape count stands for."""
    return sum(count * a * b for (a, b), count in counts.items())
