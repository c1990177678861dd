"""The Muon update of a batch of same-shape matrices: the step's one road to the fused kernels.

Owns the element-wise parts of the Muon route around Newton-Schulz, as ``optim`` calls them:
momentum and Nesterov into the normalised Newton-Schulz input, and the decayed, scaled update of
the fp32 masters, both through ``dmuon_kernels.fused``. On CUDA with Triton a batch of B
(rows, cols) matrices costs a constant number of launches, whatever B: the input in two passes
(one over g and the momentum, one over the Newton-Schulz buffer), the update in one; the torch
fallback (CPU) uses multi-tensor ``_foreach_`` ops. It must not choose which matrices form
a batch (``optim`` does) nor run the iteration.

The tensor-parallel path takes the same kernels one matrix at a time (``momentum_``,
``normalized_input_``, ``apply_update_``).

Batches: a matrix of more than ``BATCHED_NUMEL`` elements is a batch alone; otherwise ``optim``
keeps a batch under ``BATCH_BYTES`` of fp32 Muon inputs, which the torch fallback materialises
at once (the fused kernels never materialise them).

Two opt-in variants of the update live here too (``docs/update-rules.md``):

- NorMuon (``normuon_rows``): a per-row second moment of the Newton-Schulz output, after it;
- low-precision momentum (``MOMENTUM_DTYPES``): the buffer stored in bf16, the arithmetic in
  fp32 ([Note: low-precision momentum] in ``dmuon_kernels.fused``); or in int8 with block
  scales ([Note: 8-bit momentum]).

[Note: NorMuon]
Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable" (arXiv
2510.05491, 2025), Algorithm 1. For the (m, n) Newton-Schulz output O of a matrix, with a per-row
(per output neuron) state v of shape (m,), zero at the start:

    v = β2·v + (1 − β2)·mean_cols(O ⊙ O)          (no bias correction, as in the paper)
    Ô = O / (sqrt(v) + ε)                          (row i divided by sqrt(v_i) + ε)
    Ô = Ô · sqrt(min(m, n)) / ‖Ô‖_F

then the usual ``W = W·(1 − lr·wd) − lr·scale·Ô`` with the learning-rate rule's ``scale``. The
last line is the paper's rescale written so it composes with every ``adjust_lr``: Ô gets the
Frobenius norm of an exactly orthogonal O, so the update has the norm (and RMS) the
learning-rate rule gives plain Muon. With ``adjust_lr="match_rms_adamw"`` this is the paper's
``η̂ = 0.2·η·sqrt(m·n) / ‖Ô‖_F`` exactly (update RMS 0.2·lr); with ``"spectral"`` or None the
update's RMS is ``lr·scale / sqrt(max(m, n))``, as for plain Muon. Since the rescale removes any
common factor of the rows, a bias correction of v would change nothing but ε's weight. The
paper's defaults: β2 = 0.95; ε guards the division (1e-8 here). Cost: one more fp32 pass over
O (read, row sums, divide, norm, scale: about 6·m·n FLOPs, nothing next to Newton-Schulz) and
m fp32 numbers of state per matrix.

[Note: 8-bit momentum]
``momentum_dtype="int8"`` stores the momentum of an (m, n) matrix as int8 q (m, n) and fp32
scales s (m, ceil(n / INT8_BLOCK)): each run of ``INT8_BLOCK`` consecutive elements of a row
shares the scale s = max |x| of the run, and x ≈ q · s / 127 with q = round(127 · x / s) (round to
nearest; an all-zero run stores s = 0). Blocks follow rows, so a row block or an expert of the
buffer is a slice of both tensors. Each step dequantises a batch to fp32, runs the same fp32
momentum arithmetic as any dtype, and quantises the new buffer back: 1 + 4 / INT8_BLOCK bytes
per element instead of 4. The state has other names than a float buffer's
(``momentum_int8``, ``momentum_scale``), so a checkpoint never loads one into the other: a
change between int8 and a float dtype across a checkpoint restarts the momentum, with
``dmuon.checkpoint``'s warning. Not fused: the torch ops run per matrix (a few launches each).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dmuon_kernels.fused import (
    DEFAULT_NS_EPS,
    muon_apply_updates_,
    muon_momentum_,
    muon_normalize,
    muon_normalized_inputs_,
)

BATCH_BYTES = 256 * 2**20
"""fp32 Muon inputs held at once by one batch (the torch fallback materialises them)."""
BATCHED_NUMEL = 2**22
"""Matrices up to this size are batched; a larger one is a batch alone."""
MOMENTUM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
"""The dtypes a Muon momentum buffer may be stored in, by name (the arithmetic is fp32)."""
INT8_BLOCK = 256
"""Elements of a row sharing one scale of an int8 momentum ([Note: 8-bit momentum])."""
_INT8_LEVELS = 127
NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-8


def normalized_inputs_(
    grads: list[Tensor],
    momenta: list[Tensor],
    first_steps: list[bool],
    momentum: float,
    nesterov: bool,
    out: Tensor,
    eps: float = DEFAULT_NS_EPS,
    scales: list[Tensor] | None = None,
) -> None:
    """Momentum (``buf = momentum·buf + g``, or ``buf = g`` on a first step) then the Muon
    input ``u = g + momentum·buf`` (Nesterov) or ``u = buf``, each divided by its Frobenius norm
    (+ ``eps``) and written into ``out``: (B, rows, cols), or its ``.mT`` for tall matrices, in
    the Newton-Schulz dtype. ``grads`` are B fp32 (rows, cols) matrices, ``momenta`` their fp32
    or bf16 buffers, or int8 ones with their ``scales`` ([Note: 8-bit momentum])."""
    if scales is None:
        muon_normalized_inputs_(grads, momenta, first_steps, momentum, nesterov, out, eps)
        return
    wide = [dequantized(q, scale) for q, scale in zip(momenta, scales, strict=True)]
    muon_normalized_inputs_(grads, wide, first_steps, momentum, nesterov, out, eps)
    for q, scale, value in zip(momenta, scales, wide):
        quantize_(q, scale, value)


# ---- int8 momentum: see [Note: 8-bit momentum]


def int8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape of an int8 momentum of ``shape`` (..., n): (..., ceil(n / block))."""
    return (*shape[:-1], -(-shape[-1] // INT8_BLOCK))


def _blocks(x: Tensor, blocks: int) -> Tensor:
    """(..., n) -> (..., blocks, INT8_BLOCK), the last run zero-padded."""
    padding = blocks * INT8_BLOCK - x.shape[-1]
    return torch.nn.functional.pad(x, (0, padding)).unflatten(-1, (blocks, INT8_BLOCK))


def dequantized(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 values of an int8 momentum q (..., n) with its scales (..., blocks)."""
    values = _blocks(q.to(torch.float32), scale.shape[-1]) * (scale / _INT8_LEVELS).unsqueeze(-1)
    return values.flatten(-2)[..., : q.shape[-1]]


def quantize_(q: Tensor, scale: Tensor, values: Tensor) -> None:
    """Store fp32 ``values`` (..., n) into the int8 q and its scales, in place (views allowed)."""
    runs = _blocks(values.to(torch.float32), scale.shape[-1])
    peak = runs.abs().amax(dim=-1)  # (..., blocks)
    scale.copy_(peak)
    step = (peak / _INT8_LEVELS).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    q.copy_(runs.div(step).round_().flatten(-2)[..., : q.shape[-1]])


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


def normalized_input_(update: Tensor, out: Tensor, eps: float = DEFAULT_NS_EPS) -> None:
    """``u / (‖u‖_F + eps)`` of one whole matrix into ``out`` (its shape, any strides, the
    Newton-Schulz dtype); overflow-safe for any finite ``u``."""
    muon_normalize(update, None, out.dtype, eps, out)


def apply_update_(
    master: Tensor, orthogonal: Tensor, lr: float, weight_decay: float, scale: float
) -> None:
    """``master = master·(1 − lr·weight_decay) − lr·scale·ortho`` for one chunk."""
    muon_apply_updates_([master], [orthogonal], lr, weight_decay, scale)


# ---- NorMuon: see [Note: NorMuon]


def normuon_rows(
    orthogonal: list[Tensor], second_moments: list[Tensor], beta2: float, eps: float
) -> list[Tensor]:
    """NorMuon's row normalisation of B Newton-Schulz outputs of one (rows, cols) shape (any
    dtype, any strides): each row's second moment updated in place in ``second_moments`` (B fp32
    (rows,) vectors), returns the B fp32 (rows, cols) updates Ô of [Note: NorMuon]."""
    update = torch.stack([o.to(torch.float32) for o in orthogonal])  # (B, rows, cols)
    rows, cols = update.shape[-2:]
    moments = torch.stack(second_moments)  # (B, rows)
    moments.mul_(beta2).add_(update.square().mean(dim=-1), alpha=1.0 - beta2)
    for moment, value in zip(second_moments, moments.unbind(0)):
        moment.copy_(value)
    update.div_(moments.sqrt_().add_(eps).unsqueeze(-1))
    # A zero gradient gives a zero Ô: the clamp keeps it zero instead of 0/0.
    norms = torch.linalg.matrix_norm(update).clamp_min_(torch.finfo(torch.float32).tiny)
    update.mul_((math.sqrt(min(rows, cols)) / norms).view(-1, 1, 1))
    return list(update.unbind(0))
