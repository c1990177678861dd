"""Step-time what-ifs: one training step of FSDP2 + AdamW, dmuon and naive Muon, as a timeline.

Owns building the operations of a step for each system on a layout and a machine, and reading
the prediction off the timeline: step time, compute per phase, exposed communication by kind,
the optimizer step, bytes per collective kind, memory per GPU. The partition is dmuon's own
(``dmuon.inspect.plan_ownership``, the function ``dedicate_params`` runs); the costs come from
``costs``, the placing in time from ``timeline``, the memory from ``memory``. Pure: no tensors,
no process group. The assumptions are listed in ``docs/simulator.md``.

The step is simulated for the rank that bounds it: the owner whose optimizer step is the longest
(every rank takes part in every collective of its groups, so the communication is the same on
each). Two consecutive steps are laid out and the second is reported, so that what one step
leaves running (dmuon's asynchronous HSDP publish) delays the next as it does in training.

[Note: the three systems, as the simulator runs them]
- ``fsdp2-adamw``: ``fully_shard`` per decoder layer and on the root (embedding, LM head, final
  norm; FSDP2 keeps the root gathered from forward to the end of backward). Forward: each layer's
  all-gather is issued when the layer before starts (one ahead). Backward: the layer is gathered
  again (``reshard_after_forward=True``), recomputed with activation checkpointing, and its
  gradient reduce-scattered in the reduce dtype (HSDP: then all-reduced across replicas). Step:
  fused AdamW on the local shard.
- ``dmuon-z3`` / ``dmuon-z2``: the same for the parameters dmuon does not dedicate (norms, the
  root); each layer's matrices are broadcast by their owners, one broadcast per owner shard
  index (a segment), prefetched one layer ahead, re-broadcast in backward under Z3 only; each
  segment's gradient is reduced to its owner (HSDP: then reduced across replicas to the owner's
  replica). Step: the heaviest owner's batched Newton-Schulz and element-wise passes (the step
  waits for it), then, under HSDP, the owner publishes its matrices across replicas: before the
  next step starts (``-sync``) or behind the next forward, each layer waiting for its own.
- ``naive-muon``: FSDP2 for every parameter, then ``torch.optim.Muon`` on the DTensor matrices:
  every rank all-gathers every matrix's fp32 gradient in the step and runs its Newton-Schulz, one
  after the other on the compute stream, paying DTensor's dispatch on the host per matrix.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dmuon_tools.machine import Machine
from dmuon_tools.memory import MemoryInputs, memory_gib
from dmuon_tools.model_shapes import DecoderShape
from dmuon_tools.owners import Owners, plan_owners
from dmuon_tools.steps import DEFAULT_SYSTEMS, SYSTEMS, StepBuilder, System
from dmuon_tools.workload import (
    Layout,
    ModelSizes,
    Workload,
    accumulation_for,
    forward_backward_flops,
    head_flops,
    layer_flops,
)

__all__ = [
    "DEFAULT_SYSTEMS",
    "SYSTEMS",
    "Layout",
    "ModelSizes",
    "Prediction",
    "Simulation",
    "Workload",
    "accumulation_for",
    "choose_layout",
    "forward_backward_flops",
    "head_flops",
    "layer_flops",
    "simulate",
]


# ---- the prediction -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """One system's predicted steady-state step on the bounding rank."""

    system: str
    description: str
    step_ms: float
    compute_ms: Mapping[str, float]  # busy time of the GPU by phase
    exposed_ms: Mapping[str, float]  # GPU idle, by what it waited for
    optimizer_ms: float  # from the first operation of optimizer.step() to the step's end
    bytes_per_kind: Mapping[str, Mapping[str, float]]  # collective kind -> payload, wire bytes
    memory_gib: Mapping[str, float]
    fits: bool
    spans: tuple[Mapping[str, Any], ...] = field(repr=False, default=())

    @property
    def optimizer_share(self) -> float:
        return self.optimizer_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def exposed_comm_ms(self) -> float:
        return math.fsum(ms for kind, ms in self.exposed_ms.items() if kind not in _NOT_COMM)

    def to_json(self, *, spans: bool = True) -> dict[str, Any]:
        data = {
            "system": self.system,
            "description": self.description,
            "step_ms": self.step_ms,
            "optimizer_ms": self.optimizer_ms,
            "optimizer_share": self.optimizer_share,
            "exposed_comm_ms": self.exposed_comm_ms,
            "compute_ms": dict(self.compute_ms),
            "exposed_ms": dict(self.exposed_ms),
            "bytes_per_kind": {k: dict(v) for k, v in self.bytes_per_kind.items()},
            "memory_gib": dict(self.memory_gib),
            "fits": self.fits,
        }
        if spans:
            data["timeline"] = [dict(span) for span in self.spans]
        return data


_NOT_COMM = ("optimizer", "forward", "backward", "head", "idle")


def simulate_system(
    system: System,
    model: ModelSizes,
    layout: Layout,
    workload: Workload,
    machine: Machine,
    owners: Owners,
) -> Prediction:
    builder = StepBuilder(system, model, layout, workload, machine, owners)
    first_ends, _ = builder.run_step([])
    first_end = builder.timeline.end_of(dep.op for dep in first_ends)
    second_ends, second_first = builder.run_step(first_ends)
    timeline = builder.timeline
    second_end = timeline.end_of(dep.op for dep in second_ends)
    ops = [op for op in timeline.ops[second_first:] if op.start_ms < second_end]
    compute_ms: dict[str, float] = defaultdict(float)
    bytes_per_kind: dict[str, dict[str, float]] = {}
    for op in ops:
        if op.resource == "compute" and op.kind in _NOT_COMM:
            compute_ms[op.kind] += op.duration_ms
        if op.payload_bytes:
            entry = bytes_per_kind.setdefault(op.kind, {"payload": 0.0, "wire": 0.0, "count": 0})
            entry["payload"] += op.payload_bytes
            entry["wire"] += op.wire_bytes
            entry["count"] += 1
    optimizer_start = min((op.start_ms for op in ops if op.phase == "step"), default=second_end)
    memory = memory_gib(_memory_inputs(system, model, layout, workload, owners.owned_numel_max))
    # The timeline shows what runs inside the step's window: its own operations and what the
    # step before left running into it (an asynchronous publish), the latter with "step": -1.
    spans = tuple(
        {
            "name": op.name,
            "stream": op.stream,
            "resource": op.resource,
            "kind": op.kind,
            "layer": op.layer,
            "step": op.step - 1,
            "start_ms": op.start_ms - first_end,
            "end_ms": op.end_ms - first_end,
        }
        for op in timeline.ops
        if op.start_ms < second_end
        and (op.step == 1 or (op.kind == "replicate publish" and op.end_ms > first_end))
    )
    return Prediction(
        system=system.name,
        description=system.description,
        step_ms=second_end - first_end,
        compute_ms=dict(compute_ms),
        exposed_ms=timeline.exposed_by_kind(first_end, second_end),
        optimizer_ms=second_end - optimizer_start,
        bytes_per_kind=bytes_per_kind,
        memory_gib=memory,
        fits=memory["peak"] <= machine.memory_gib,
        spans=spans,
    )


def _memory_inputs(
    system: System, model: ModelSizes, layout: Layout, workload: Workload, owned_numel: float
) -> MemoryInputs:
    tp = layout.tp
    return MemoryInputs(
        family=system.family,
        reshard_after_forward=system.reshard_after_forward,
        num_layers=model.num_layers,
        dedicated_numel=model.dedicated_numel / tp,
        other_numel=model.other_numel / tp,
        root_numel=model.root_numel / tp,
        layer_numel=(model.layer_matrix_numel(0) + model.norm_numel_per_layer) / tp,
        layer_dedicated_numel=model.layer_matrix_numel(0) / tp,
        owned_numel=owned_numel,
        largest_matrix_numel=max(math.prod(d) for layer in model.layers for _, d in layer),
        shard_size=layout.num_shards,
        tokens=workload.tokens,
        hidden=model.hidden,
        kv_width=model.kv_width,
        ffn=model.ffn,
        vocab=model.vocab // tp,
        tp=tp,
        param_bytes=workload.param_bytes,
        reduce_bytes=workload.reduce_bytes,
        activation_checkpointing=workload.activation_checkpointing,
        overlap_step=system.overlap_step and tp == 1,
        accumulated_grad_numel=(
            (model.dedicated_numel + model.other_numel) / tp
            if workload.no_sync and workload.accumulation > 1
            else 0.0
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Simulation:
    model: ModelSizes
    layout: Layout
    workload: Workload
    machine: Machine
    owners: Owners
    predictions: Mapping[str, Prediction]

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step consumes over every data-parallel rank (G x R)."""
        return self.workload.tokens_per_step(self.layout.num_shards * self.layout.num_replicas)

    def to_json(self, *, spans: bool = True) -> dict[str, Any]:
        plan = self.owners.plan
        return {
            "model": {
                "name": self.model.name,
                "num_layers": self.model.num_layers,
                "num_matrices": self.model.num_matrices,
                "dedicated_numel": self.model.dedicated_numel,
                "other_numel": self.model.other_numel,
            },
            "layout": {
                "num_shards": self.layout.num_shards,
                "num_replicas": self.layout.num_replicas,
                "tp": self.layout.tp,
                "gpus_per_node": self.layout.gpus_per_node,
                "ranks_per_gpu": self.layout.ranks_per_gpu,
                "world_size": self.layout.world_size,
                "shard_link": self.layout.link_class("shard"),
                "replicate_link": self.layout.link_class("replicate"),
                "description": self.layout.describe(),
            },
            "workload": {
                "seq_len": self.workload.seq_len,
                "micro_batch": self.workload.micro_batch,
                "accumulation": self.workload.accumulation,
                "no_sync": self.workload.no_sync,
                "tokens_per_step": self.tokens_per_step,
                "activation_checkpointing": self.workload.activation_checkpointing,
                "param_bytes": self.workload.param_bytes,
                "reduce_bytes": self.workload.reduce_bytes,
            },
            "machine": self.machine.name,
            "partition": plan.describe(),
            "heaviest_owner_step_ms": max(self.owners.step_ms_per_slot),
            "mean_owner_step_ms": math.fsum(self.owners.step_ms_per_slot) / plan.num_slots,
            "predictions": {name: p.to_json(spans=spans) for name, p in self.predictions.items()},
        }


def simulate(
    shape: DecoderShape | ModelSizes,
    layout: Layout,
    workload: Workload,
    machine: Machine,
    systems: Sequence[str] = DEFAULT_SYSTEMS,
) -> Simulation:
    """Predict the step of each of ``systems`` (names in ``SYSTEMS``)."""
    unknown = [name for name in systems if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}.")
    model = shape if isinstance(shape, ModelSizes) else ModelSizes.of(shape)
    owners = plan_owners(model, layout, machine)
    predictions = {
        name: simulate_system(SYSTEMS[name], model, layout, workload, machine, owners)
        for name in systems
    }
    return Simulation(
        model=model,
        layout=layout,
        workload=workload,
        machine=machine,
        owners=owners,
        predictions=predictions,
    )


def choose_layout(
    shape: DecoderShape | ModelSizes,
    num_gpus: int,
    machine: Machine,
    workload: Workload,
    *,
    gpus_per_node: int = 8,
) -> Layout:
    """The layout a user would pick for ``num_gpus``: FSDP2 sharded over the smallest power of
    two of at least a node (or all GPUs, if fewer) whose FSDP2 + AdamW step fits in memory,
    replicated (HSDP) over the rest; all GPUs in one shard group if nothing smaller fits."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {num_gpus!r}.")
    model = shape if isinstance(shape, ModelSizes) else ModelSizes.of(shape)
    shards = min(num_gpus, gpus_per_node)
    while shards < num_gpus:
        if num_gpus % shards == 0:
            layout = Layout(
                num_shards=shards, num_replicas=num_gpus // shards, gpus_per_node=gpus_per_node
            )
            inputs = _memory_inputs(SYSTEMS["fsdp2-adamw"], model, layout, workload, 0.0)
            if memory_gib(inputs)["peak"] <= machine.memory_gib:
                return layout
        shards *= 2
    return Layout(num_shards=num_gpus, gpus_per_node=gpus_per_node)
