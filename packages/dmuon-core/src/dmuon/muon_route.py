"""The Muon route of ``dmuon.Muon``: one step's work on the masters this rank owns.

Owns the step of each Muon param group, batch by batch: the plain one, the overlapped step's
speculation and commit, the offloaded masters' and the tensor-parallel matrices'. Each batch's
gradients, momenta and scales are gathered here once, from the state ``dmuon.muon_state`` lays
out, and handed to ``muon_update`` (the math, and the route's one road to the kernels) once.

It must not hold the torch optimizer surface (param groups, ``state_dict``, the step's
orchestration: ``dmuon.optim``), lay out the state or choose the batches (``dmuon.muon_state``),
do arithmetic on tensors itself (``muon_update``), move data between ranks other than through
``dmuon.tp``'s chunk exchange, or decide when a speculation is valid (``dmuon.overlap``) or
where a master lives (``dmuon.offload``).

[Note: the step writes the segments]
Forward computes with each master rounded to the compute dtype, held in the owner's local
segment; the publish after the step (``BoundaryGroup.refresh_from_masters``) would copy it there,
one more pass over every master. The plain update instead hands Newton-Schulz each master's
segment value as its copy (``NewtonSchulz.update_masters_``'s ``copies``: on CUDA the update
GEMM's epilogue writes master and copy at once), and once every batch of the group has run marks
the parameter ``segment_fresh``, which the publish consumes instead of copying. No copy where the
master is its segment (fp32 compute), is offloaded (``dmuon.offload`` writes its segment before
it goes home), is a TP chunk (``_tensor_parallel_step``), nor where the Newton-Schulz output is
written out (NorMuon, the overlapped step). A mark must never outlive what it vouches for:
whatever writes a master after the update (QK-clip's master-update hook, loads, checkpoints)
goes through ``DedicatedParam.master_value()``, which forgets it, and ``before_step`` forgets
every mark, so a step that failed before its publish leaves none to a later one.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn

from dmuon import _profiler_labels as labels
from dmuon import muon_update
from dmuon._torch_internals import profiler_range
from dmuon.experts import is_expert_piece
from dmuon.muon_state import (
    MOMENTUM_BUFFER,
    Batch,
    batches_of,
    entry_shape,
    matrices_of,
    matrix,
    momentum_of,
    momentum_shape,
    second_moment_of,
)
from dmuon.muon_update import MOMENTUM_DTYPES
from dmuon.overlap import SPECULATION_GRAPH_MAX_NUMEL
from dmuon.param import MUON_ROUTE
from dmuon.tp import ChunkExchange

if TYPE_CHECKING:
    from dmuon.mesh import OwnershipMesh
    from dmuon.ns_counts import NewtonSchulzCounts
    from dmuon.offload import MasterOffload
    from dmuon.overlap import OverlappedStep
    from dmuon.param import DedicatedParam
    from dmuon_kernels.newton_schulz import NewtonSchulz


class MuonRoute:
    """One ``dmuon.Muon``'s Muon route: the step of each Muon param group on the masters this
    rank owns, in batches (plain, offloaded or committed from the overlapped step's
    speculation), and the tensor-parallel matrices' step.

    ``optimizer``: the optimizer whose ``state`` holds the route's entries (read at each use:
    torch's ``load_state_dict`` replaces the dict); ``owned``: the dedicated parameters whose
    masters this rank owns; ``overlapped``: ``overlap_step=True`` (Newton-Schulz inputs up to
    ``SPECULATION_GRAPH_MAX_NUMEL`` replay as CUDA graphs); ``segment_values``: id(p) -> the
    value of each of ``owned`` in its local segment (``DedicatedState.owned_segment_values``),
    which the plain update writes ([Note: the step writes the segments]).
    """

    def __init__(
        self,
        *,
        optimizer: torch.optim.Optimizer,
        newton_schulz: NewtonSchulz,
        owned: list[DedicatedParam],
        mesh: OwnershipMesh,
        ns_counts: NewtonSchulzCounts,
        overlapped: bool,
        segment_values: dict[int, torch.Tensor],
    ) -> None:
        self._optimizer = optimizer
        self._newton_schulz = newton_schulz
        self._mesh = mesh
        self._ns_counts = ns_counts
        self._graph_max_numel = SPECULATION_GRAPH_MAX_NUMEL if overlapped else None
        # The overlapped step applies Newton-Schulz outputs computed during backward: its
        # recomputed units write the output out too, so both are one computation bit for bit
        # (the plain step's last product writes the update itself on CUDA: [Note: the update
        # epilogue] in ``dmuon_kernels.update_epilogue``). NorMuon's rows need the output.
        self._writes_output_out = overlapped
        # id(master) -> the TP-sharded parameter whose chunk it holds (masters never change).
        self._tp_chunks = {id(p.master): p for p in owned if p.is_tp_sharded}
        # id(master) -> its row-block sizes ([Note: row blocks] in ``dmuon.row_blocks``).
        self._row_blocks = {id(p.master): p.row_blocks for p in owned if p.row_blocks is not None}
        # id(master) -> (its parameter, its value in the local segment, which the update writes):
        # local segments are never reallocated, so the views stay valid.
        self._segment_copies = {
            id(p.master): (p, value)
            for p in owned
            if (value := segment_values.get(id(p))) is not None
            and not p.is_tp_sharded
            and value.dtype != torch.float32
            and value.data_ptr() != p.master.data_ptr()  # fp32 compute: the master is its segment
        }

    @property
    def _state(self) -> dict:
        return self._optimizer.state

    def step(
        self,
        index: int,
        group: dict,
        overlap: OverlappedStep | None,
        offload: MasterOffload | None,
    ) -> None:
        """The Muon step of param group ``index`` (``group``): its TP-sharded matrices, then its
        other masters with a gradient, batch by batch."""
        tp_sharded = self._tp_chunks
        self._tensor_parallel_step(
            group, [tp_sharded[id(m)] for m in group["params"] if id(m) in tp_sharded]
        )
        masters = [
            master
            for master in group["params"]
            if master.grad is not None and master.numel() > 0 and id(master) not in tp_sharded
        ]
        # Overlapped: one chunk's matrices at a time, committed from backward's speculation
        # where it is valid, computed here otherwise (see [Note: the overlapped step]).
        units = [masters] if overlap is None else overlap.units_to_compute(index, masters)
        batches = [batch for unit in units for batch in batches_of(unit, self._row_blocks)]
        if offload is not None:  # the masters come from CPU memory a batch ahead
            offload.run(batches, functools.partial(self._update, group))
            return
        written = [p for batch in batches for p in self._update(group, batch)]
        # Marked once every batch ran: a master in row blocks is written by several batches.
        for p in written:
            p.segment_fresh = True

    def _update(self, group: dict, batch: Batch) -> list[DedicatedParam]:
        """The Muon step of one batch: its gradients, momenta and scales gathered once, the
        math ``muon_update``'s; the update written by Newton-Schulz's last product unless the
        output is needed (NorMuon, the overlapped step), and with it the new weights into the
        local segments. Returns the parameters whose segment it wrote ([Note: the step writes
        the segments])."""
        momentum_dtype = MOMENTUM_DTYPES[group["momentum_dtype"]]
        grads, momenta, scales, first_steps = [], [], [], []
        for master, piece in batch:
            first_step, momentum, scale = momentum_of(
                self._state[master], master, piece, momentum_dtype
            )
            grads.append(matrix(master.grad, piece))
            momenta.append(momentum)
            scales.append(scale)
            first_steps.append(first_step)
        int8_scales = scales if momentum_dtype == torch.int8 else None
        if group["normuon"] or self._writes_output_out:
            orthogonal = self._orthogonal(group, grads, momenta, first_steps, int8_scales)
            self.apply(group, batch, orthogonal)
            return []
        copies, written = self._segment_copies_of(batch)
        with profiler_range(labels.NEWTON_SCHULZ):
            muon_update.updated_matrices_(
                self._newton_schulz,
                [matrix(master, piece) for master, piece in batch],
                grads,
                momenta,
                first_steps,
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                adjust_lr=group["adjust_lr"],
                scales=int8_scales,
                copies=copies,
            )
        self._ns_counts.received(batch)
        return written

    def _segment_copies_of(
        self, batch: Batch
    ) -> tuple[list[torch.Tensor | None], list[DedicatedParam]]:
        """Each entry's copy, its matrix of the segment value as ``matrix`` takes it of the
        master (None where the update must not write the segment), and the parameters written."""
        copies, written = [], []
        for master, piece in batch:
            p, value = self._segment_copies.get(id(master), (None, None))
            if p is None or p.offload is not None:  # offloaded: ``dmuon.offload`` writes it
                copies.append(None)
                continue
            copies.append(matrix(value, piece))
            written.append(p)
        return copies, written

    def _orthogonal(
        self,
        group: dict,
        grads: list[torch.Tensor],
        momenta: list[torch.Tensor],
        first_steps: list[bool],
        scales: list[torch.Tensor] | None = None,
        new_momenta: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Momentum and Nesterov (into ``momenta``, or from them into ``new_momenta``) and one
        batched Newton-Schulz of one batch's matrices; returns its output (B, short, long)."""
        with profiler_range(labels.NEWTON_SCHULZ):
            return muon_update.orthogonalized_matrices(
                self._newton_schulz,
                grads,
                momenta,
                first_steps,
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                scales=scales,
                graph_max_numel=self._graph_max_numel,
                new_momenta=new_momenta,
            )

    def apply(self, group: dict, batch: Batch, orthogonal: torch.Tensor) -> None:
        """NorMuon's rows if on, then decay and the scaled update of one batch's masters from
        its Newton-Schulz output (the plain step, and the overlapped step's commit)."""
        normuon = None
        if group["normuon"]:
            moments = [second_moment_of(self._state[m], m, piece) for m, piece in batch]
            normuon = (moments, group["normuon_beta2"], group["normuon_eps"])
        muon_update.apply_matrices_(
            [matrix(master, piece) for master, piece in batch],
            orthogonal,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            adjust_lr=group["adjust_lr"],
            normuon=normuon,
        )
        self._ns_counts.received(batch)

    def speculate(
        self,
        group: dict,
        masters: list[nn.Parameter],
        grads: dict[int, torch.Tensor],
        scratch: dict[int, torch.Tensor],
    ) -> list[tuple[Batch, torch.Tensor]]:
        """The overlapped step's work during backward on one unit: ``_update``'s, with each
        master's gradient from ``grads`` (id -> its landed gradient) and its momentum computed
        from the state's buffer into a new one (``scratch``, id -> buffer), the state left
        untouched; returns each batch and its Newton-Schulz output, which ``apply`` applies at
        commit."""
        first_step_of, read = {}, {}
        for master in masters:
            buffer = self._state.get(master, {}).get(MOMENTUM_BUFFER)
            if buffer is not None:
                scratch[id(master)], first_step_of[id(master)] = torch.empty_like(buffer), False
                read[id(master)] = buffer
            else:  # as ``momentum_of`` creates it: zeros for an expert piece, whose experts
                # each run ``buf = momentum * 0 + g``
                create = torch.zeros if is_expert_piece(master) else torch.empty
                scratch[id(master)] = create(
                    momentum_shape(master), dtype=torch.float32, device=master.device
                )
                first_step_of[id(master)] = not is_expert_piece(master)
                read[id(master)] = scratch[id(master)]  # read and written in place
        speculated = []
        for batch in batches_of(masters, self._row_blocks):
            grads_of_batch = [matrix(grads[id(master)], expert) for master, expert in batch]
            momenta = [matrix(read[id(master)], expert) for master, expert in batch]
            new_momenta = [matrix(scratch[id(master)], expert) for master, expert in batch]
            first_steps = [first_step_of[id(master)] for master, _ in batch]
            output = self._orthogonal(
                group, grads_of_batch, momenta, first_steps, new_momenta=new_momenta
            )
            speculated.append((batch, output))
        return speculated

    def _tensor_parallel_step(self, group: dict, params: list[DedicatedParam]) -> None:
        """The Muon route of TP-sharded matrices; see [Note: tensor-parallel matrices] in
        ``dmuon.tp``. Every TP rank of the owner runs it with the same matrices, in one order.

        Momentum and Nesterov are element-wise, so each TP rank applies them to its chunk; the
        chunks of the Muon input meet on the matrix's runner, which normalises and
        orthogonalises the whole matrix; each TP rank applies its chunk of the result.
        """
        params = [p for p in params if p.master.grad is not None]
        if not params:
            return
        mu = group["momentum"]
        momentum_dtype = MOMENTUM_DTYPES[group["momentum_dtype"]]
        inputs = []
        for p in params:
            first_step, momentum, _ = momentum_of(
                self._state[p.master], p.master, None, momentum_dtype
            )
            update = muon_update.momentum_(
                matrix(p.master.grad, None), momentum, first_step, mu, group["nesterov"]
            )
            inputs.append(update.view(p.local_shape))
        exchange = ChunkExchange(
            layouts=[p.tp for p in params],
            runners=[p.owner.tp for p in params],
            tp_ranks=self._mesh.tp_ranks,
            group=self._mesh.tp_group,
        )
        full_inputs = exchange.gather(inputs)
        results = muon_update.orthogonalized(
            self._newton_schulz, {i: (u, params[i].tp.shape) for i, u in full_inputs.items()}
        )
        device = params[0].master.device
        chunks = exchange.scatter(results, self._newton_schulz.iteration_dtype(device), device)
        for p, chunk in zip(params, chunks):
            muon_update.apply_update_(
                p.master,
                chunk,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                adjust_lr=group["adjust_lr"],
                matrix_shape=tuple(p.shape),
            )
        self._ns_counts.received((p.master, None) for p in params)

    def compile_kernels_ahead(self, param_groups: list[dict]) -> None:
        """Start compiling the fused step kernels for this rank's Muon matrices, so that they
        compile together while the first forward and backward run rather than one by one in
        the first step ([Note: compiles ahead] in ``dmuon_kernels._fused_triton``)."""
        for group in param_groups:
            if group["route"] != MUON_ROUTE:
                continue
            shapes_by_device: dict[torch.device, set[tuple[int, int]]] = defaultdict(set)
            # device -> copy dtype -> shapes whose update writes a copy ([Note: the step
            # writes the segments]); none where the output is written out
            copies_by_device: dict[torch.device, dict[torch.dtype, set[tuple[int, int]]]] = (
                defaultdict(lambda: defaultdict(set))
            )
            writes_copies = not (group["normuon"] or self._writes_output_out)
            for master in group["params"]:
                if master.numel() == 0 or id(master) in self._tp_chunks:
                    continue
                copy = self._segment_copies.get(id(master)) if writes_copies else None
                for entry in matrices_of(master, self._row_blocks.get(id(master))):
                    shapes_by_device[master.device].add(entry_shape(entry))
                    if copy is not None:
                        copies_by_device[master.device][copy[1].dtype].add(entry_shape(entry))
            for device, shapes in shapes_by_device.items():
                muon_update.compile_kernels_ahead(
                    self._newton_schulz,
                    device,
                    shapes,
                    nesterov=group["nesterov"],
                    momentum_dtype=MOMENTUM_DTYPES[group["momentum_dtype"]],
                    normuon=group["normuon"],
                    copies=copies_by_device.get(device),
                )
