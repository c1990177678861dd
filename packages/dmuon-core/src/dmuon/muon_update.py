"""The Muon update of matrices: the step's one road to the fused kernels and Newton-Schulz.

Owns the math of the Muon route, as ``optim`` calls it: momentum and Nesterov into the
normalised Newton-Schulz input, the iteration (``NewtonSchulz.iterate_normalized``), the learning
rate's scale for an (m, n) matrix (``adjust_lr``) and the decayed, scaled update of the fp32
masters, the element-wise parts through ``dmuon_kernels.fused``. On CUDA with Triton a batch of B
(rows, cols) matrices costs a constant number of launches, whatever B: the input in two passes
(one over g and the momentum, one over the Newton-Schulz buffer), the update in one; the torch
fallback (CPU) uses multi-tensor ``_foreach_`` ops. It must not hold optimizer state (``optim``
creates the momentum buffers and passes them in) nor choose which matrices share a
Newton-Schulz call (``optim`` does).

The tensor-parallel path takes the same kernels one matrix at a time (``momentum_``,
``orthogonalized``, ``apply_update_``).

Batches: a matrix of more than ``BATCHED_NUMEL`` elements is a batch alone; otherwise a batch
stays under ``BATCH_BYTES`` of fp32 Muon inputs, which the torch fallback materialises at once
(the fused kernels never materialise them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import Tensor

from dmuon_kernels.fused import (
    DEFAULT_NS_EPS,
    muon_apply_updates_,
    muon_momentum_,
    muon_normalize,
    muon_normalized_inputs_,
)

if TYPE_CHECKING:
    from dmuon_kernels.newton_schulz import NewtonSchulz

BATCH_BYTES = 256 * 2**20
"""fp32 Muon inputs held at once by one batch (the torch fallback materialises them)."""
BATCHED_NUMEL = 2**22
"""Matrices up to this size are batched; a larger one is a batch alone."""
MUON_RMS_MATCH = 0.2
"""``adjust_lr="match_rms_adamw"`` scales the update by this times sqrt(max(m, n)), so its RMS
matches AdamW's."""


def lr_scale(adjust_lr: str | None, rows: int, cols: int) -> float:
    """The factor on ``lr`` for an (rows, cols) matrix (``dmuon.Muon``'s ``adjust_lr``)."""
    if adjust_lr == "match_rms_adamw":  # the update's RMS matches AdamW's
        return MUON_RMS_MATCH * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":  # the update's spectral norm scales with sqrt(fan-out / fan-in)
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def matrix_shape_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(m, n) of a weight's shape: trailing dims flattened into n."""
    return shape[0], math.prod(shape[1:])


def oriented(matrix: Tensor, transposed: bool) -> Tensor:
    """Newton-Schulz works on rows <= cols; a tall weight sees its slice transposed."""
    return matrix.mT if transposed else matrix


def orthogonalized_matrices(
    newton_schulz: NewtonSchulz,
    grads: list[Tensor],
    momenta: list[Tensor],
    first_steps: list[bool],
    *,
    momentum: float,
    nesterov: bool,
) -> Tensor:
    """B matrices of one Newton-Schulz shape (an (m, n) and an (n, m) matrix share one), with
    equal (rows, cols) adjacent: momentum and Nesterov into ``momenta``, the normalised input and
    one batched Newton-Schulz; returns its output (B, short, long). ``grads`` and ``momenta`` are
    fp32 (rows, cols) matrices; ``first_steps[i]``: the momentum buffer is new (``buf = g``). The
    overlapped step runs it during backward on momentum copies (``dmuon.overlap``)."""
    rows, cols = grads[0].shape
    inputs = newton_schulz.normalized_buffer(
        (len(grads), min(rows, cols), max(rows, cols)), grads[0].device
    )
    for start, stop in _batches(grads):
        normalized_inputs_(
            grads[start:stop],
            momenta[start:stop],
            first_steps[start:stop],
            momentum,
            nesterov,
            out=inputs[start:stop],
        )
    return newton_schulz.iterate_normalized(inputs)


def apply_matrices_(
    masters: list[Tensor],
    orthogonal: Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr: str | None,
) -> None:
    """Decay and the scaled update of each fp32 master (rows, cols), in place, from its
    Newton-Schulz output (``orthogonal[i]``, (short, long)); at commit for the overlapped step."""
    for start, stop in _batches(masters):
        rows, cols = masters[start].shape
        apply_updates_(
            masters[start:stop],
            [oriented(ortho, rows > cols) for ortho in orthogonal[start:stop]],
            lr,
            weight_decay,
            lr_scale(adjust_lr, rows, cols),
        )


def _batches(masters: list[Tensor]) -> Iterator[tuple[int, int]]:
    """[start, stop) runs of matrices of one (rows, cols), each under ``BATCH_BYTES`` of fp32
    Muon inputs; a matrix over ``BATCHED_NUMEL`` elements alone."""
    start = 0
    while start < len(masters):
        shape = masters[start].shape
        numel = shape.numel()
        per_batch = 1 if numel > BATCHED_NUMEL else max(1, BATCH_BYTES // (4 * numel))
        stop = start + 1
        while stop < len(masters) and stop - start < per_batch and masters[stop].shape == shape:
            stop += 1
        yield start, stop
        start = stop


def normalized_inputs_(
    grads: list[Tensor],
    momenta: list[Tensor],
    first_steps: list[bool],
    momentum: float,
    nesterov: bool,
    out: Tensor,
    eps: float = DEFAULT_NS_EPS,
) -> None:
    """Momentum (``buf = momentum·buf + g``, or ``buf = g`` on a first step) then the Muon
    input ``u = g + momentum·buf`` (Nesterov) or ``u = buf``, each divided by its Frobenius norm
    (+ ``eps``) and written into ``out``: (B, rows, cols), or its ``.mT`` for tall matrices, in
    the Newton-Schulz dtype. ``grads`` and ``momenta`` are B fp32 (rows, cols) matrices."""
    muon_normalized_inputs_(grads, momenta, first_steps, momentum, nesterov, out, eps)


def apply_updates_(
    masters: list[Tensor], orthogonal: list[Tensor], lr: float, weight_decay: float, scale: float
) -> None:
    """``master = master·(1 − lr·weight_decay) − lr·scale·ortho`` for every pair (fp32 masters,
    Newton-Schulz outputs in any float dtype and strides)."""
    muon_apply_updates_(masters, orthogonal, lr, weight_decay, scale)


# ---- one matrix at a time: the tensor-parallel path (momentum per chunk, the gathered matrix
# normalised and orthogonalised on its runner, the update per chunk; see ``dmuon.tp``)


def momentum_(
    grad: Tensor, buf: Tensor, first_step: bool, momentum: float, nesterov: bool
) -> Tensor:
    """Momentum of one chunk in place; returns its Muon input ``u`` (unnormalised)."""
    update, _ = muon_momentum_(grad, buf, momentum, nesterov=nesterov, first_step=first_step)
    return update


def orthogonalized(
    newton_schulz: NewtonSchulz, updates: dict[int, tuple[Tensor, tuple[int, ...]]]
) -> dict[int, Tensor]:
    """Newton-Schulz of whole (unnormalised) Muon inputs ``{i: (u, its parameter's shape)}``,
    batched by shape; each result in its parameter's shape and the Newton-Schulz dtype."""
    by_ns_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (_, shape) in updates.items():
        rows, cols = matrix_shape_of(shape)
        by_ns_shape[(min(rows, cols), max(rows, cols))].append(i)
    results = {}
    for (short, long), indices in by_ns_shape.items():
        first = updates[indices[0]][0]
        inputs = newton_schulz.normalized_buffer((len(indices), short, long), first.device)
        for i, ns_input in zip(indices, inputs):
            update, shape = updates[i]
            rows, cols = matrix_shape_of(shape)
            normalized_input_(update.reshape(rows, cols), out=oriented(ns_input, rows > cols))
        orthogonal = newton_schulz.iterate_normalized(inputs)
        for i, ortho in zip(indices, orthogonal):
            rows, cols = matrix_shape_of(updates[i][1])
            results[i] = oriented(ortho, rows > cols).reshape(updates[i][1])
    return results


def normalized_input_(update: Tensor, out: Tensor, eps: float = DEFAULT_NS_EPS) -> None:
    """``u / (‖u‖_F + eps)`` of one whole matrix into ``out`` (its shape, any strides, the
    Newton-Schulz dtype); overflow-safe for any finite ``u``."""
    muon_normalize(update, None, out.dtype, eps, out)


def apply_update_(
    master: Tensor,
    orthogonal: Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr: str | None,
    matrix_shape: tuple[int, ...],
) -> None:
    """``master = master·(1 − lr·weight_decay) − lr·scale·ortho`` for one chunk of a matrix of
    ``matrix_shape`` (the whole parameter's shape, which decides the scale)."""
    scale = lr_scale(adjust_lr, *matrix_shape_of(matrix_shape))
    muon_apply_updates_([master], [orthogonal], lr, weight_decay, scale)
