"""The Muon update written by Newton-Schulz's last product: ``W = decay·W − step·O`` in the
epilogue of the GEMM that computes O, so the orthogonalised matrix O is never stored.

Owns that product (``final_update_``) and the switch that turns it on (``epilogue_enabled``).
It must not run the rest of the iteration (``dmuon_kernels.newton_schulz``) nor know about
optimizers: the caller passes the masters, one decay and one step per matrix.

[Note: the update epilogue]
The iteration ends with one product, O = L·X (L = Q of the gram form, or poly + a·I of the
direct one; X (n, m), n <= m). Written out, the step then costs a store of O in the iteration
dtype, and a separate pass that reads O and the fp32 master and writes the master: 4 bytes per
element more than necessary, and one launch. Here the product is a GEMM whose C operand is the
master itself, ``master = decay·master − step·(L·X)`` (cuBLAS's ``beta·C + alpha·A·B``, fp16 or
bf16 operands, fp32 accumulation and output), in place: the master is read and written once by
the GEMM's epilogue and O exists only in registers. A tall master (m, n) takes
``Xᵀ·Lᵀ = (L·X)ᵀ``, so its rows stay contiguous.

Numerics: O is no longer rounded to the iteration dtype before it is scaled, so the update is
closer to the exact product than the written-out one (one fp32 rounding instead of an fp16 one
and an fp32 one). The direct form's ``a·X + poly·X`` becomes ``(poly + a·I)·X``, with the
diagonal rounded to the iteration dtype once, as the gram form's Q = Z + a·I always was. So the
two schedules that must agree bit for bit use one way each: ``dmuon.Muon``'s plain step (and
its offloaded masters) this one, on CUDA; the overlapped step, whose Newton-Schulz output is
computed during backward and applied at ``step()`` with the learning rate of that moment, writes
O out (``dmuon.overlap``), and so does every step on the CPU, where there is no memory traffic
to save and the CPU tests keep the overlapped step equal to the plain one bit for bit.

The bf16 copy of the weight (the owner's segment that forward broadcasts) is refreshed after the
step by a separate cast (``dmuon.group``): a cuBLAS epilogue writes one output. Fusing that cast
here needs a GEMM with a second, bf16 output in its epilogue (a kernel of our own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dmuon_kernels._env import UPDATE_EPILOGUE_ENV, env_flag


def epilogue_enabled(X: Tensor) -> bool:
    """Whether the update of masters from a Newton-Schulz iteration on ``X`` is written by its
    last product (CUDA, and ``DMUON_UPDATE_EPILOGUE`` not off; see [Note: the update
    epilogue]). Raises ValueError for a value of the variable that is not on/off."""
    return env_flag(UPDATE_EPILOGUE_ENV, default=True) and X.is_cuda


def final_update_(
    left: Tensor,
    X: Tensor,
    masters: Sequence[Tensor],
    *,
    diagonal: float | None,
    decay: float,
    steps: Sequence[float],
) -> None:
    """``masters[i] = decay·masters[i] − steps[i]·(L_i·X_i)`` in place, as one GEMM each.

    ``left`` (B, n, n) and ``X`` (B, n, m) are the iteration's last factors, its scratch (a
    CUDA graph's outputs, which the next replay rewrites); ``diagonal``: the direct form's
    ``a``, added to ``left``'s diagonal in place first (None for the gram form's Q).
    ``masters[i]`` is fp32 (or X's dtype), of shape (n, m), or (m, n) for a matrix iterated
    transposed, rows or columns contiguous. Nothing is returned or kept."""
    if len(masters) != X.shape[0] or len(steps) != X.shape[0]:
        raise ValueError(
            f"final_update_: {X.shape[0]} Newton-Schulz outputs, {len(masters)} masters and "
            f"{len(steps)} steps; pass one master and one step per matrix"
        )
    if diagonal is not None:  # in place: a copy of the B·n² factor would cost a pass
        left.diagonal(dim1=-2, dim2=-1).add_(diagonal)
    n, m = X.shape[-2:]
    for L, x, master, step in zip(left, X, masters, steps, strict=True):
        if tuple(master.shape) == (n, m):
            first, second = L, x
        elif tuple(master.shape) == (m, n):
            first, second = x.mT, L.mT  # (L·X)ᵀ
        else:
            raise ValueError(
                f"final_update_: a master of shape {tuple(master.shape)} for a Newton-Schulz "
                f"output of shape {(n, m)}; it must be that shape or its transpose"
            )
        if master.dtype == x.dtype:
            master.addmm_(first, second, beta=decay, alpha=-step)
        else:
            torch.addmm(
                master, first, second, out_dtype=master.dtype, beta=decay, alpha=-step,
                out=master,
            )  # fmt: skip


__all__ = ["epilogue_enabled", "final_update_"]
