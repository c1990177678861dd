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
"""

from __future__ import annotations

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


def normalized_input_(update: Tensor, out: Tensor, eps: float = DEFAULT_NS_EPS) -> None:
    """``u / (‖u‖_F + eps)`` of one whole matrix into ``out`` (its shape, any strides, the
    Newton-Schulz dtype); overflow-safe for any finite ``u``."""
    muon_normalize(update, None, out.dtype, eps, out)


def apply_update_(
    master: Tensor, orthogonal: Tensor, lr: float, weight_decay: float, scale: float
) -> None:
    """``master = master·(1 − lr·weight_decay) − lr·scale·ortho`` for one chunk."""
    muon_apply_updates_([master], [orthogonal], lr, weight_decay, scale)
