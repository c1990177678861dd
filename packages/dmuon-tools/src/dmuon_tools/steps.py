"""The operations of one training step, per system, laid out on a ``Timeline``.

Owns what each system issues, in which order, on which stream and resource, and what waits for
what (see [Note: the three systems, as the simulator runs them] in ``simulator``): FSDP2's
all-gathers and reduce-scatters, dmuon's broadcasts, reduces, owner step and HSDP publish, naive
Muon's all-gathers and redundant Newton-Schulz, and the TP all-reduces. The costs come from
``costs``; it must not read the result (``simulator`` does).

[Note: gradient accumulation]
A step of ``Workload.accumulation`` micro-batches lays out each micro-batch's forward and
backward in turn, then one optimizer step. By default every micro-batch's backward reduces its
gradients (FSDP2's reduce-scatters, dmuon's reduces to the owners, the HSDP stage): what a loop
without ``dmuon.no_sync`` does, and what torchtitan's gradient accumulation and pipeline
schedules do. With ``Workload.no_sync`` the micro-batches before the last reduce nothing and
every rank holds their gradients unsharded (``memory``'s ``accumulated_grad_numel``). A
micro-batch starts when the one before has ended its backward and its reduces (FSDP2 and dmuon
end backward by waiting for them), so the reduces of a micro-batch never overlap the next
forward. The overlapped step (``overlap_step``) speculates on the last backward under
``no_sync``; without it, the first backward's speculation is discarded by the second and the
step computes everything (``dmuon.Muon``'s behaviour), so the step is the plain one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dmuon_tools.costs import (
    ADAMW_BYTES_PER_ELEMENT,
    NS_INPUT_BYTES_PER_ELEMENT,
    REFERENCE_MUON_BYTES_PER_ELEMENT,
    collective_ms,
    elementwise_ms,
    ns_batch_ms,
    wire_bytes,
)
from dmuon_tools.machine import Machine
from dmuon_tools.ns_table import shape_key
from dmuon_tools.owners import Owners
from dmuon_tools.timeline import After, Op, Timeline
from dmuon_tools.workload import Layout, ModelSizes, Workload, head_flops, layer_flops

# Share of a layer's host floor spent in forward (the rest in backward): forward's share of
# the FLOPs without recomputation.
FORWARD_HOST_SHARE = 1 / 3


@dataclass(frozen=True, slots=True, kw_only=True)
class System:
    name: str
    family: str  # "fsdp2", "dmuon", "naive"
    reshard_after_forward: bool = True
    replicate_async: bool = True
    overlap_step: bool = False  # dmuon.Muon(overlap_step=True): see ``_overlapped_owner_work``
    description: str = ""


SYSTEMS: dict[str, System] = {
    system.name: system
    for system in (
        System(name="fsdp2-adamw", family="fsdp2", description="FSDP2 + fused AdamW"),
        System(name="dmuon-z3", family="dmuon", description="dmuon, reshard after forward"),
        System(
            name="dmuon-z2",
            family="dmuon",
            reshard_after_forward=False,
            description="dmuon, weights kept through backward",
        ),
        System(
            name="dmuon-z3-sync",
            family="dmuon",
            replicate_async=False,
            description="dmuon Z3, HSDP publish before the next step",
        ),
        System(
            name="dmuon-z2-sync",
            family="dmuon",
            reshard_after_forward=False,
            replicate_async=False,
            description="dmuon Z2, HSDP publish before the next step",
        ),
        System(
            name="dmuon-z3-overlap",
            family="dmuon",
            overlap_step=True,
            description="dmuon Z3, owner step started during backward",
        ),
        System(
            name="dmuon-z2-overlap",
            family="dmuon",
            reshard_after_forward=False,
            overlap_step=True,
            description="dmuon Z2, owner step started during backward",
        ),
        System(
            name="naive-muon",
            family="naive",
            description="FSDP2 + torch.optim.Muon on DTensors",
        ),
    )
}
DEFAULT_SYSTEMS = ("fsdp2-adamw", "dmuon-z3", "dmuon-z2", "naive-muon")


class StepBuilder:
    """Lays out two steps of one system on one timeline."""

    def __init__(
        self,
        system: System,
        model: ModelSizes,
        layout: Layout,
        workload: Workload,
        machine: Machine,
        owners: Owners,
    ) -> None:
        self.system, self.model, self.layout = system, model, layout
        self.workload, self.machine, self.owners = workload, machine, owners
        self.timeline = Timeline()
        self.step = 0
        self.phase = "forward"
        self.pending_publish: dict[int, list[int]] = {}
        # Per layer, what its gradients landing on the heaviest owner waits for (the overlapped
        # step): that owner's segment reduce and, under HSDP, the replicate stage.
        self.landings: dict[int, list[int]] = {}

    # -- primitives --

    def _compute(self, name: str, kind: str, ms: float, deps, layer=None) -> int:
        return self.timeline.add(
            Op(
                name=name,
                stream="compute",
                resource="compute",
                kind=kind,
                duration_ms=ms,
                deps=tuple(deps),
                step=self.step,
                phase=self.phase,
                layer=layer,
            )
        )

    def _comm(
        self, name, stream, kind, group, collective, num_bytes, deps, layer=None
    ) -> int | None:
        """One collective on ``group``'s link; None where the group has one rank."""
        size = self.layout.group_size(group)
        if size == 1 or num_bytes <= 0:
            return None
        link_class = self.layout.link_class(group)
        link = self.machine.group_link(link_class, self.layout.ranks_per_node_in(group))
        return self.timeline.add(
            Op(
                name=name,
                stream=stream,
                resource=f"{group} group: {link_class}",
                kind=kind,
                duration_ms=collective_ms(collective, num_bytes, size, link),
                deps=tuple(deps),
                step=self.step,
                phase=self.phase,
                layer=layer,
                payload_bytes=num_bytes,
                wire_bytes=wire_bytes(collective, num_bytes, size),
            )
        )

    # -- costs --

    def _compute_ms(self, flops: float, host_ms: float) -> float:
        ms = flops / self.layout.tp / (self.machine.training_tflops * 1e12) * 1e3
        return max(ms, host_ms) * self.layout.ranks_per_gpu

    def _layer_ms(self, layer: int) -> tuple[float, float]:
        """Forward and backward (with recomputation) milliseconds of one layer."""
        forward, backward = layer_flops(self.model, self.workload, layer)
        floor_family = "dmuon" if self.system.family == "dmuon" else "fsdp2"
        floor = self.machine.layer_host_ms.get(floor_family, 0.0)
        return (
            self._compute_ms(forward, floor * FORWARD_HOST_SHARE),
            self._compute_ms(backward, floor * (1 - FORWARD_HOST_SHARE)),
        )

    def _head_ms(self) -> float:
        return self._compute_ms(head_flops(self.model, self.workload), 0.0)

    # -- phases --

    def _gather_layer(self, layer: int, deps: list[After], phase: str) -> list[int]:
        """The collectives that bring layer ``layer``'s weights to every rank."""
        model, tp, pb = self.model, self.layout.tp, self.workload.param_bytes
        ops: list[int | None] = []
        if self.system.family == "dmuon":
            for shard, numel in enumerate(self.owners.segments[layer]):
                ops.append(
                    self._comm(
                        f"{phase} broadcast layer {layer} segment {shard}",
                        "dmuon shard",
                        "shard broadcast",
                        "shard",
                        "broadcast",
                        numel * pb / tp,
                        deps,
                        layer,
                    )
                )
            gathered = model.norm_numel_per_layer
        else:
            gathered = model.layer_matrix_numel(layer) + model.norm_numel_per_layer
        ops.append(
            self._comm(
                f"{phase} all-gather layer {layer}",
                "fsdp2 all-gather",
                "all-gather",
                "shard",
                "all_gather",
                gathered * pb / tp,
                deps,
                layer,
            )
        )
        return [op for op in ops if op is not None]

    def _backward_gather(self, layer: int, deps: list[After]) -> list[int]:
        """Z3 gathers a layer again for its backward; Z2 kept it."""
        if not self.system.reshard_after_forward:
            return []
        return self._gather_layer(layer, deps, "backward")

    def _reduce_layer(self, layer: int, after: int) -> list[int]:
        """The collectives that take layer ``layer``'s gradients to where they are stepped."""
        model, tp, rb = self.model, self.layout.tp, self.workload.reduce_bytes
        ops: list[int | None] = []
        deps = [After(after)]
        if self.system.family == "dmuon":
            heaviest_reduce = None
            for shard, numel in enumerate(self.owners.segments[layer]):
                op = self._comm(
                    f"reduce layer {layer} segment {shard}",
                    "dmuon shard",
                    "shard reduce",
                    "shard",
                    "reduce",
                    numel * rb / tp,
                    deps,
                    layer,
                )
                ops.append(op)
                if shard == self.owners.heaviest_shard:
                    heaviest_reduce = op
            stage_two = [After(heaviest_reduce)] if heaviest_reduce is not None else deps
            landing = [heaviest_reduce] if heaviest_reduce is not None else [after]
            for replica, numel in enumerate(self.owners.replica_pieces[layer]):
                landing.append(
                    self._comm(
                        f"replicate reduce layer {layer} piece {replica}",
                        "dmuon replicate",
                        "replicate reduce",
                        "replicate",
                        "reduce",
                        numel * rb / tp,
                        stage_two,
                        layer,
                    )
                )
            self.landings[layer] = [op for op in landing if op is not None]
            ops += landing[1:]
            scattered = model.norm_numel_per_layer
        else:
            scattered = model.layer_matrix_numel(layer) + model.norm_numel_per_layer
        ops += self._fsdp2_reduce(f"layer {layer}", scattered, deps, layer)
        return [op for op in ops if op is not None]

    def _fsdp2_reduce(self, what: str, numel: float, deps, layer=None) -> list[int | None]:
        rb, tp, shard_size = self.workload.reduce_bytes, self.layout.tp, self.layout.num_shards
        scatter = self._comm(
            f"reduce-scatter {what}",
            "fsdp2 reduce-scatter",
            "reduce-scatter",
            "shard",
            "reduce_scatter",
            numel * rb / tp,
            deps,
            layer,
        )
        after = [After(scatter)] if scatter is not None else deps
        all_reduce = self._comm(
            f"all-reduce {what}",
            "fsdp2 reduce-scatter",
            "replicate all-reduce",
            "replicate",
            "all_reduce",
            numel * rb / tp / shard_size,
            after,
            layer,
        )
        return [scatter, all_reduce]

    def _tp_exchange(self, name: str, deps: list[After], count: int, layer: int) -> After | None:
        """``count`` all-reduces of a layer's activations across the TP group (Megatron's two
        per layer forward, two per layer backward); compute waits for them."""
        tokens_bytes = self.workload.tokens * self.model.hidden * self.workload.param_bytes
        op = self._comm(
            name, "compute", "tp all-reduce", "tp", "all_reduce", count * tokens_bytes, deps, layer
        )
        return After(op) if op is not None else None

    def run_step(self, start: list[After]) -> tuple[list[After], int]:
        """Lay out one step after ``start``: the workload's micro-batches, then the optimizer
        step; returns what the next step waits for and the index of the first operation of this
        step ([Note: gradient accumulation])."""
        first = len(self.timeline.ops)
        accumulation = self.workload.accumulation
        after_backward = list(start)
        for micro_batch in range(accumulation):
            last = micro_batch == accumulation - 1
            reduce = last or not self.workload.no_sync
            if micro_batch > 0:
                # What ends last stands for all of them (each of the next micro-batch's
                # operations would otherwise wait on every reduce of this one: the same
                # placement, in quadratic time).
                after_backward = [max(after_backward, key=self._ends_at)]
            after_backward = self._micro_batch(after_backward, reduce=reduce)
        self.phase = "step"
        ends = self._optimizer_step(after_backward)
        self.step += 1
        return ends, first

    def _ends_at(self, dep: After) -> float:
        placed = self.timeline.ops[dep.op]
        return placed.start_ms if dep.at_start else placed.end_ms

    def _micro_batch(self, start: list[After], *, reduce: bool) -> list[After]:
        """One micro-batch's forward and backward after ``start``, its gradients reduced (or,
        under ``no_sync`` before the last micro-batch, kept on every rank); returns what comes
        after its backward waits for (its last compute and every reduce: FSDP2's and dmuon's
        end of backward wait for them)."""
        model, layout = self.model, self.layout
        self.phase = "forward"
        root = self._comm(
            "all-gather root (embedding, LM head, norm)",
            "fsdp2 all-gather",
            "all-gather",
            "shard",
            "all_gather",
            model.root_numel * self.workload.param_bytes / layout.tp,
            start,
        )
        previous: int | None = None
        waits: list[After] = [After(root)] if root is not None else list(start)
        for layer in range(model.num_layers):
            prefetch = [After(previous, at_start=True)] if previous is not None else []
            published = [After(op) for op in self.pending_publish.get(layer, [])]
            weights = self._gather_layer(layer, list(start) + prefetch + published, "forward")
            forward_ms, _ = self._layer_ms(layer)
            deps = waits + [After(op) for op in weights] + list(start)
            previous = self._compute(f"forward layer {layer}", "forward", forward_ms, deps, layer)
            exchange = self._tp_exchange(f"tp forward {layer}", [After(previous)], 2, layer)
            waits = [exchange] if exchange is not None else []
        self.pending_publish = {}
        head = self._compute(
            "LM head and loss, forward and backward", "head", self._head_ms(), waits
        )
        reduces: list[int] = []
        previous = head
        waits = []
        self.phase = "backward"
        # Backward's pre-hook of a layer issues the gather of the layer below (one ahead), then
        # its compute runs, then its post-hook issues the gradient reduces: in that issue order.
        last = model.num_layers - 1
        weights = self._backward_gather(last, [After(head, at_start=True)])
        for layer in reversed(range(model.num_layers)):
            _, backward_ms = self._layer_ms(layer)
            deps = waits + [After(op) for op in weights] + [After(previous)]
            previous = self._compute(
                f"backward layer {layer}", "backward", backward_ms, deps, layer
            )
            if layer > 0:
                weights = self._backward_gather(layer - 1, [After(previous, at_start=True)])
            count = 4 if self.workload.activation_checkpointing else 2
            exchange = self._tp_exchange(f"tp backward {layer}", [After(previous)], count, layer)
            waits = [exchange] if exchange is not None else []
            if reduce:
                reduces += self._reduce_layer(layer, previous)
        if reduce:
            reduces += [
                op
                for op in self._fsdp2_reduce("root", model.root_numel, [After(previous), *waits])
                if op is not None
            ]
        return [After(op) for op in reduces] + waits + [After(previous)]

    def _optimizer_step(self, deps: list[After]) -> list[After]:
        family = self.system.family
        machine, layout, model = self.machine, self.layout, self.model
        local_share = 1 / (layout.num_shards * layout.tp)
        if family == "fsdp2":
            numel = (model.dedicated_numel + model.other_numel) * local_share
            ms = elementwise_ms(numel, ADAMW_BYTES_PER_ELEMENT, machine.copy_gbps)
            step = self._compute("fused AdamW", "optimizer", ms, deps)
            return [After(step)]
        if family == "naive":
            return self._naive_step(deps)
        return self._dmuon_step(deps)

    def _dmuon_step(self, deps: list[After]) -> list[After]:
        machine, layout, model, owners = self.machine, self.layout, self.model, self.owners
        adamw_ms = elementwise_ms(
            model.other_numel / (layout.num_shards * layout.tp),
            ADAMW_BYTES_PER_ELEMENT,
            machine.copy_gbps,
        )
        owner_ms = self._owner_step_ms()
        # Accumulating without no_sync, the speculation of the first backward is discarded when
        # the second adds into the gradients and the later ones do not speculate: the step
        # computes everything, as the plain step does.
        speculates = self.workload.accumulation == 1 or self.workload.no_sync
        if self.system.overlap_step and layout.tp == 1 and speculates:
            deps = deps + self._overlapped_owner_work()
            owner_ms = owners.overlap_commit_ms
        # Under TP the Muon inputs of the heaviest owner's matrices meet on their TP runner and
        # the results go back (NS dtype, 2 bytes): a gather, then a scatter that moves what the
        # gather moved (priced as an all-gather of the whole matrix each way).
        exchanged = NS_INPUT_BYTES_PER_ELEMENT * owners.heaviest_numel
        gather = self._comm(
            "tp gather Muon inputs", "compute", "tp exchange", "tp", "all_gather", exchanged, deps
        )
        step = self._compute(
            "owner step", "optimizer", owner_ms + adamw_ms, [After(gather)] if gather else deps
        )
        ends = [After(step)]
        scatter = self._comm(
            "tp scatter updates", "compute", "tp exchange", "tp", "all_gather", exchanged, ends
        )
        if scatter is not None:
            ends = [After(scatter)]
        publishes: dict[int, list[int]] = {}
        for layer, pieces in enumerate(owners.replica_pieces):
            for replica, numel_piece in enumerate(pieces):
                op = self._comm(
                    f"publish layer {layer} piece {replica}",
                    "dmuon replicate",
                    "replicate publish",
                    "replicate",
                    "broadcast",
                    numel_piece * self.workload.param_bytes / layout.tp,
                    ends,
                    layer,
                )
                if op is not None:
                    publishes.setdefault(layer, []).append(op)
        if self.system.replicate_async:
            self.pending_publish = publishes
            return ends
        return ends + [After(op) for ops in publishes.values() for op in ops]

    def _overlapped_owner_work(self) -> list[After]:
        """The overlapped step's work of the heaviest owner, one chunk of layers once all its
        layers' gradients have landed (in backward's order), on the side stream: in the
        compute's idle time during backward where it fits ([Note: work that only fills idle
        time] in ``timeline``), after the backward otherwise. Returns what the commit in
        ``step()`` waits for. Under TP the real step recomputes the sharded matrices, so
        ``_dmuon_step`` does not call this there."""
        side_end: After | None = None
        for chunk in reversed(self.owners.overlap_chunks):
            if chunk.ms <= 0:
                continue
            landing = [After(op) for layer in chunk.layers for op in self.landings.get(layer, [])]
            deps = landing + ([side_end] if side_end is not None else [])
            first, last = chunk.layers[0], chunk.layers[-1]
            op = Op(
                name=f"owner step layers {first}-{last} (speculative)",
                stream="dmuon owner step",
                resource="compute",
                kind="optimizer",
                duration_ms=chunk.ms,
                deps=tuple(deps),
                step=self.step,
                phase="backward",
                layer=first,  # the chunk's last layer to land
            )
            ready = max((self.timeline.ops[d.op].end_ms for d in deps), default=0.0)
            pieces, left = self.timeline.fill_idle(op, ready)
            if pieces:
                side_end = After(pieces[-1])
            if left > 0:  # after the backward: part of the step's time
                op.duration_ms, op.deps = left, tuple(deps + ([side_end] if side_end else []))
                op.phase = "step"
                side_end = After(self.timeline.add(op))
        return [side_end] if side_end is not None else []

    def _owner_step_ms(self) -> float:
        """The heaviest owner's step: the step waits for it."""
        return self.owners.step_ms_per_slot[self.owners.heaviest_slot]

    def _naive_step(self, deps: list[After]) -> list[After]:
        machine, layout, model = self.machine, self.layout, self.model
        previous = deps
        for layer in model.layers:
            for name, dims in layer:
                numel = math.prod(dims)
                gather = self._comm(
                    f"all-gather {name}",
                    "compute",
                    "naive all-gather",
                    "shard",
                    "all_gather",
                    numel * 4 / layout.tp,
                    previous,
                )
                after = [After(gather)] if gather is not None else previous
                ms = ns_batch_ms(machine.reference_ns_ms, shape_key(dims), 1)
                ms += machine.dtensor_host_ms_per_matrix
                previous = [After(self._compute(f"Newton-Schulz {name}", "optimizer", ms, after))]
        local_share = 1 / (layout.num_shards * layout.tp)  # FSDP2's shard of each parameter
        ms = elementwise_ms(
            model.dedicated_numel * local_share, REFERENCE_MUON_BYTES_PER_ELEMENT, machine.copy_gbps
        ) + elementwise_ms(
            model.other_numel * local_share, ADAMW_BYTES_PER_ELEMENT, machine.copy_gbps
        )
        step = self._compute("Muon and AdamW updates", "optimizer", ms, previous)
        return [After(step)]
