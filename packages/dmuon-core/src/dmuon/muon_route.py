"""The Muon route of ``dmuon.Muon``: its state layout, its Newton-Schulz batches, and one step's
work on them.

Owns the route from an owned fp32 master to its update: which matrices a master holds (the
master, each expert of an expert piece, each row block), the state each keeps and the keys it
goes by (``MOMENTUM_BUFFER`` and the others, the one spelling of each), which matrices share one
Newton-Schulz call (``Batch``, the one type of such a call), and the step's work on each batch:
the plain one, the overlapped step's speculation and commit, and the tensor-parallel matrices'.
Each batch's gradients, momenta and scales are gathered here once and handed to
``muon_update`` (the math, and the route's one road to the kernels) once.

It must not hold the torch optimizer surface (param groups, ``state_dict``, the step's
orchestration: ``dmuon.optim``), do arithmetic on tensors itself (``muon_update`` does), move
data between ranks other than through ``dmuon.tp``'s chunk exchange, or decide when a speculation
is valid (``dmuon.overlap``) or where a master lives (``dmuon.offload``).
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from dmuon import _profiler_labels as labels
from dmuon import muon_update
from dmuon._torch_internals import profiler_range
from dmuon.experts import is_expert_piece
from dmuon.muon_update import (
    MOMENTUM_DTYPES,
    dequantized,
    int8_scale_shape,
    matrix_shape_of,
    quantize_,
)
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

MOMENTUM_BUFFER = "momentum_buffer"
"""A float momentum's state key (torch.optim.Muon's name too, so its checkpoints map)."""
# NorMuon's per-row state ([Note: NorMuon] in ``muon_update``): (m,), or (k, m) for an expert
# piece. A checkpoint without it (plain Muon's) loads with this entry starting at zero.
ROW_SECOND_MOMENT = "row_second_moment"
# An int8 momentum's state ([Note: 8-bit momentum] in ``muon_update``): other names than a float
# buffer's, so a checkpoint never loads one into the other.
MOMENTUM_INT8, MOMENTUM_SCALE = "momentum_int8", "momentum_scale"
# Newton-Schulz input of one batched call, at 2 bytes an element: the iteration's transient
# workspace (a few times its input) stays near a GiB however many matrices share a shape.
NS_CALL_BYTES = 256 * 2**20

Piece = int | slice | None
"""Which matrix of a master an entry is: None (the master), ``i`` (expert i of an expert
piece) or ``slice(start, stop)`` (a row block)."""
Batch = list[tuple[nn.Parameter, Piece]]
"""The matrices of one batched Newton-Schulz call, as (master, piece) pairs: one Newton-Schulz
shape (an (m, n) and an (n, m) matrix share one), equal (rows, cols) adjacent."""


# ---- the state layout -----------------------------------------------------------------------


def matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """(m, n) of a weight, trailing dims flattened into n; of each expert of an expert piece."""
    if is_expert_piece(param):
        return param.shape[1], param.shape[2]
    return matrix_shape_of(param.shape)


def matrices_of(
    master: torch.Tensor, row_blocks: tuple[int, ...] | None = None
) -> list[tuple[torch.Tensor, Piece]]:
    """The matrices Muon orthogonalises in ``master``: itself, each expert of an expert piece
    (k, m, n), or each of its row blocks; each gets its own Newton-Schulz and lr scale."""
    if is_expert_piece(master):
        return [(master, expert) for expert in range(master.shape[0])]
    if row_blocks is not None:
        starts = itertools.accumulate(row_blocks, initial=0)
        return [(master, slice(start, start + rows)) for start, rows in zip(starts, row_blocks)]
    return [(master, None)]


def entry_shape(entry: tuple[torch.Tensor, Piece]) -> tuple[int, int]:
    """(rows, cols) of the matrix an entry of ``matrices_of`` stands for."""
    master, piece = entry
    rows, cols = matrix_shape(master)
    return (piece.stop - piece.start, cols) if isinstance(piece, slice) else (rows, cols)


def matrix(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """(m, n) view of a master-shaped tensor (weight or gradient): the matrix, one expert, or
    one row block."""
    if piece is None:
        return tensor.view(matrix_shape(tensor))
    if isinstance(piece, slice):
        return tensor.view(matrix_shape_of(tensor.shape))[piece]
    return tensor[piece]


def momentum_shape(master: torch.Tensor) -> tuple[int, ...]:
    """Muon's momentum of a master: (m, n), or (k, m, n) for an expert piece."""
    return tuple(master.shape) if is_expert_piece(master) else matrix_shape(master)


def momentum_of(
    state: dict, master: torch.Tensor, piece: Piece, dtype: torch.dtype, create=None
) -> tuple[bool, torch.Tensor, torch.Tensor | None]:
    """``(first_step, the (m, n) momentum buffer, its int8 scales or None)`` of one matrix,
    created on its first step in ``dtype`` (a buffer held in another dtype, as torch's
    ``load_state_dict`` or a change of ``momentum_dtype`` leaves it, is converted).

    An expert piece keeps one (k, m, n) buffer and a matrix in row blocks one (m, n) buffer,
    created as zeros: ``buf = momentum * 0 + g`` is exactly the first step's ``buf = g`` for
    each of its matrices. An int8 buffer is created as zeros too (its scales must be finite).
    """
    conform_momentum(state, dtype)
    int8 = dtype == torch.int8
    key = MOMENTUM_INT8 if int8 else MOMENTUM_BUFFER
    buf = state.get(key)
    first_step = buf is None
    if first_step:
        create = create or (torch.zeros if piece is not None or int8 else torch.empty)
        shape = momentum_shape(master)
        buf = state[key] = create(shape, dtype=dtype, device=master.device)
        if int8:
            scale_shape = int8_scale_shape(shape)
            state[MOMENTUM_SCALE] = create(scale_shape, dtype=torch.float32, device=master.device)
    scale = state[MOMENTUM_SCALE] if int8 else None
    if piece is None:
        return first_step, buf, scale
    return False, buf[piece], None if scale is None else scale[piece]


def conform_momentum(state: dict, dtype: torch.dtype) -> None:
    """Hold the momentum of ``state`` (if any) in ``dtype``: a float buffer cast, an int8 one
    ([Note: 8-bit momentum]) quantised or dequantised."""
    if dtype == torch.int8:
        if MOMENTUM_BUFFER in state:
            values = state.pop(MOMENTUM_BUFFER).to(torch.float32)
            q = torch.empty(values.shape, dtype=torch.int8, device=values.device)
            scale = torch.empty(int8_scale_shape(values.shape), device=values.device)
            quantize_(q, scale, values)
            state[MOMENTUM_INT8], state[MOMENTUM_SCALE] = q, scale
    elif MOMENTUM_INT8 in state:
        values = dequantized(state.pop(MOMENTUM_INT8), state.pop(MOMENTUM_SCALE))
        state[MOMENTUM_BUFFER] = values.to(dtype)
    elif MOMENTUM_BUFFER in state and state[MOMENTUM_BUFFER].dtype != dtype:
        state[MOMENTUM_BUFFER] = state[MOMENTUM_BUFFER].to(dtype)


def second_moment_of(state: dict, master: torch.Tensor, piece: Piece) -> torch.Tensor:
    """NorMuon's per-row second moment of one matrix (fp32, zeros on its first step)."""
    moment = state.get(ROW_SECOND_MOMENT)
    if moment is None:
        shape = momentum_shape(master)[:-1]  # (m,), or (k, m) for an expert piece
        moment = torch.zeros(shape, dtype=torch.float32, device=master.device)
        state[ROW_SECOND_MOMENT] = moment
    return moment if piece is None else moment[piece]


# ---- the batches ----------------------------------------------------------------------------


def batches_of(
    masters: list[nn.Parameter], row_blocks: dict[int, tuple[int, ...]]
) -> Iterator[Batch]:
    """The batched Newton-Schulz calls of ``masters`` (``row_blocks``: id(master) -> its row
    blocks). Newton-Schulz runs on rows <= cols, so an (m, n) and an (n, m) matrix share one
    call (Llama's gate/up and down projections, say); same-shape runs stay adjacent for the
    element-wise batches."""
    by_ns_shape: dict[tuple[int, int], Batch] = defaultdict(list)
    for master in masters:
        for entry in matrices_of(master, row_blocks.get(id(master))):
            rows, cols = entry_shape(entry)
            by_ns_shape[(min(rows, cols), max(rows, cols))].append(entry)
    for (short, long), same_shape in by_ns_shape.items():
        same_shape.sort(key=entry_shape)  # (rows, cols) adjacent
        yield from _split(same_shape, short * long)


def _split(entries: Batch, numel: int) -> Iterator[Batch]:
    """``entries`` in equal runs of at most ``NS_CALL_BYTES`` of fp16 Newton-Schulz input (the
    iteration's workspace is a few times its input, and lives only during the call)."""
    per_call = max(1, NS_CALL_BYTES // (2 * numel))
    calls = -(-len(entries) // per_call)
    size = -(-len(entries) // calls)
    for start in range(0, len(entries), size):
        yield entries[start : start + size]


def init_state(state: dict, master: torch.Tensor, group: dict) -> None:
    """Create the state a master's next Muon step would create (zeros; see
    ``Muon.init_state``)."""
    momentum_of(state, master, None, MOMENTUM_DTYPES[group["momentum_dtype"]], create=torch.zeros)
    if group["normuon"]:
        second_moment_of(state, master, None)


# ---- the work of a step ---------------------------------------------------------------------


class MuonRoute:
    """One ``dmuon.Muon``'s Muon route: the step of each Muon param group on the masters this
    rank owns, in batches (plain, offloaded or committed from the overlapped step's
    speculation), and the tensor-parallel matrices' step.

    ``optimizer``: the optimizer whose ``state`` holds the route's entries (read at each use:
    torch's ``load_state_dict`` replaces the dict); ``owned``: the dedicated parameters whose
    masters this rank owns; ``overlapped``: ``overlap_step=True`` (Newton-Schulz inputs up to
    ``SPECULATION_GRAPH_MAX_NUMEL`` replay as CUDA graphs).
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
    ) -> None:
        self._optimizer = optimizer
        self._newton_schulz = newton_schulz
        self._mesh = mesh
        self._ns_counts = ns_counts
        self._graph_max_numel = SPECULATION_GRAPH_MAX_NUMEL if overlapped else None
        # id(master) -> the TP-sharded parameter whose chunk it holds (masters never change).
        self._tp_chunks = {id(p.master): p for p in owned if p.is_tp_sharded}
        # id(master) -> its row-block sizes ([Note: row blocks] in ``dmuon.row_blocks``).
        self._row_blocks = {id(p.master): p.row_blocks for p in owned if p.row_blocks is not None}

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
        for batch in batches:
            self._update(group, batch)

    def _update(self, group: dict, batch: Batch) -> None:
        """The Muon step of one batch: its gradients, momenta and scales gathered once, the
        math ``muon_update``'s."""
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
        int8 = momentum_dtype == torch.int8
        orthogonal = self._orthogonal(group, grads, momenta, first_steps, scales if int8 else None)
        self.apply(group, batch, orthogonal)

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
            for master in group["params"]:
                if master.numel() == 0 or id(master) in self._tp_chunks:
                    continue
                for entry in matrices_of(master, self._row_blocks.get(id(master))):
                    shapes_by_device[master.device].add(entry_shape(entry))
            for device, shapes in shapes_by_device.items():
                muon_update.compile_kernels_ahead(
                    self._newton_schulz,
                    device,
                    shapes,
                    nesterov=group["nesterov"],
                    momentum_dtype=MOMENTUM_DTYPES[group["momentum_dtype"]],
                    normuon=group["normuon"],
                )
