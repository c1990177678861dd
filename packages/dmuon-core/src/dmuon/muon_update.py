"""The Muon update of a batch of same-shape matrices, issued as a few multi-tensor kernels.

Owns the element-wise parts of the Muon route around Newton-Schulz: momentum and Nesterov into
the normalised Newton-Schulz input, and the decayed, scaled update of the fp32 masters. A batch
of B (rows, cols) matrices costs a constant number of kernel launches (torch's ``_foreach_`` ops,
one norm, one normalise-and-cast pass) instead of two or three per matrix: a model of many small
matrices spends a step's host time launching them (GPT-2-small-shaped: 84 matrices, 252 Triton
launches). It must not choose which matrices form a batch (``optim`` does) nor run the iteration.

A matrix of more than ``BATCHED_NUMEL`` elements is a batch alone and takes the fused
per-matrix kernels instead (``dmuon_kernels.fused``): its step is bound by memory traffic, which
they keep to the minimum, not by launches. Memory: the fp32 Muon inputs of one batch exist at
once; ``optim`` keeps a batch under ``BATCH_BYTES``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmuon_kernels.fused import (
    DEFAULT_NS_EPS,
    muon_apply_update_,
    muon_momentum_normalize_,
    normalize_cast,
)

BATCH_BYTES = 256 * 2**20
"""fp32 Muon inputs held at once by one batch."""
BATCHED_NUMEL = 2**22
"""Matrices up to this size are batched; a larger one is a batch alone (fused kernels)."""


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
    rows, cols = grads[0].shape
    if len(grads) == 1:
        oriented = out[0] if out.shape[-2:] == (rows, cols) else out[0].mT
        muon_momentum_normalize_(
            grads[0], momenta[0], momentum, nesterov=nesterov, first_step=first_steps[0],
            dtype=out.dtype, eps=eps, out=oriented,
        )  # fmt: skip
        return
    continuing = [i for i, first in enumerate(first_steps) if not first]
    starting = [i for i, first in enumerate(first_steps) if first]
    if continuing:
        buffers = [momenta[i] for i in continuing]
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, [grads[i] for i in continuing])
    if starting:
        torch._foreach_copy_([momenta[i] for i in starting], [grads[i] for i in starting])
    update = torch.empty((len(grads), rows, cols), dtype=torch.float32, device=grads[0].device)
    updates = list(update.unbind(0))
    if nesterov:
        torch._foreach_copy_(updates, grads)
        torch._foreach_add_(updates, momenta, alpha=momentum)
    else:
        torch._foreach_copy_(updates, momenta)
    norm = torch.linalg.vector_norm(update, dim=(-2, -1), keepdim=True)
    normalize_cast(
        update if out.shape[-2:] == (rows, cols) else update.mT, norm, eps, out.dtype, out
    )


def apply_updates_(
    masters: list[Tensor], orthogonal: list[Tensor], lr: float, weight_decay: float, scale: float
) -> None:
    """``master = master·(1 − lr·weight_decay) − lr·scale·ortho`` for every pair (fp32 masters,
    Newton-Schulz outputs in any float dtype and strides)."""
    if len(masters) == 1:
        muon_apply_update_(masters[0], orthogonal[0], lr, weight_decay, scale)
        return
    decay = 1.0 - lr * weight_decay
    if decay != 1.0:
        torch._foreach_mul_(masters, decay)
    torch._foreach_add_(masters, orthogonal, alpha=-lr * scale)
