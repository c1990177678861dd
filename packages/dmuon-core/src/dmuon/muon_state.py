"""The Muon route's state and batches: what ``dmuon.Muon`` keeps per matrix, under which keys,
and which matrices share one Newton-Schulz call.

Owns the state layout of the Muon route (which matrices a master holds: the master, each expert
of an expert piece, each row block; the momentum, its int8 scales and NorMuon's row moment of
each, created, converted between dtypes and sliced per matrix), the keys it goes by
(``MOMENTUM_BUFFER`` and the others: the one spelling of each), the one type of a batched
Newton-Schulz call (``Batch``) and the batching (``batches_of``, ``NS_CALL_BYTES``). The route,
the Newton-Schulz counts and the checkpoints take them from here; it sits below ``overlap`` and
``offload`` in the import order so that they can too. It must not do arithmetic on tensors
(``muon_update``'s, the int8 conversion included), run a step (``dmuon.muon_route``) nor hold
the torch optimizer surface (``dmuon.optim``).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from dmuon.experts import is_expert_piece
from dmuon.muon_update import (
    MOMENTUM_DTYPES,
    dequantized,
    int8_scale_shape,
    matrix_shape_of,
    quantize_,
)

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
