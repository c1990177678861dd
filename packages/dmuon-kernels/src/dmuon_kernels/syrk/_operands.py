"""The operand rules every SYRK backend applies alike, written once.

Owns what the backends (``cublas``, ``quack``, ``cute``) do to their operands before their own
layout work: the ``beta == 0`` rule and bringing a batch of any depth to the one batch dimension
the kernels take. Each backend's module does the rest (padding, alignment, launch). Plain torch;
it must not import a backend or an optional library.
"""

from __future__ import annotations

from torch import Tensor


def effective_c(C: Tensor | None, beta: float) -> Tensor | None:
    """C as ``alpha·A·B + beta·C`` reads it: None when ``beta == 0``, so a NaN or inf in C never
    reaches the result (torch.addmm ignores C there too), and the kernel without C runs."""
    return None if beta == 0.0 else C


def one_batch(t: Tensor | None) -> Tensor | None:
    """``t`` (..., M, N) as one matrix or one (B, M, N) batch: the shapes torch.mm / torch.bmm
    and the kernels take. A view where the layout allows it."""
    return t if t is None or t.dim() <= 3 else t.reshape(-1, *t.shape[-2:])
