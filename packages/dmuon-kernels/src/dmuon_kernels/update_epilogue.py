"""The Muon update written by Newton-Schulz's last product: ``W = decay·W − step·O`` in the
epilogue of the GEMM that computes O, so the orthogonalised matrix O is never stored.

Owns that product (``final_update_``) and the switch that turns it on (``epilogue_enabled``).
It must not run the rest of the iteration (``dmuon_kernels.newton_schulz``) nor know about
optimizers: the caller passes the masters, one decay and one step per matrix.

[Note: the update epilogue]
The iteration ends with one product, O = L·X (L = Q of the gram form, or a·I + poly of the
direct one; X (n, m), n <= m). Written out, the step then costs a store of O in the iteration
dtype, and a separate pass that reads O and the fp32 master and writes the master: 4 bytes per
element more than necessary, and one launch. Here the product is a GEMM whose C operand is the
master itself, ``master = decay·master − step·(L·X)`` (cuBLAS's ``beta·C + alpha·A·B``, fp16 or
bf16 operands, fp32 accumulation and output), in place: the master is read and written once by
the GEMM's epilogue and O exists only in registers. A tall master (m, n) takes
``Xᵀ·Lᵀ = (L·X)ᵀ``, so its rows stay contiguous.

Numerics: O is no longer rounded to the iteration dtype before it is scaled, so the update is
closer to the exact product than the written-out one (one fp32 rounding instead of an fp16 one
and an fp32 one). So the two schedules that must agree bit for bit use one way each:
``dmuon.Muon``'s plain step (and its offloaded masters) this one, on CUDA; the overlapped step,
whose Newton-Schulz output is computed during backward and applied at ``step()`` with the
learning rate of that moment, writes O out (``dmuon.overlap``), and so does every step on the
CPU, where there is no memory traffic to save and the CPU tests keep the overlapped step equal
to the plain one bit for bit.

The weight forward computes with (the owner's bf16 segment, which forward broadcasts) is the
step's second output: ``copies[i]``, the new master rounded to the copy's dtype. A cuBLAS
epilogue writes one output, so by default the copy is a pass of its own right after each GEMM
(it reads the master again: 6 bytes an element). ``DMUON_UPDATE_GEMM=triton`` runs this
package's Triton GEMM instead (``dmuon_kernels._update_gemm_triton``), whose epilogue stores the
master and the rounded copy from the same registers (2 bytes an element for the copy). It is not
the default because its mainloop is slower than cuBLAS's by more than the copy costs: on an H100
the Llama-3-8B stack's last products took 14.0 ms with the best Triton tiles per shape against
13.0 for cuBLAS and the copy (11.3 without it); it wins only on small masters (1024 x 4096:
0.031 against 0.035 ms). Without Triton, or off CUDA, the copy is the separate pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from dmuon_kernels._env import UPDATE_EPILOGUE_ENV, UPDATE_GEMM_ENV, env_choice, env_flag
from dmuon_kernels.fused import triton_available

UPDATE_GEMMS = ("cublas", "triton")


def epilogue_enabled(X: Tensor) -> bool:
    """Whether the update of masters from a Newton-Schulz iteration on ``X`` is written by its
    last product (CUDA, and ``DMUON_UPDATE_EPILOGUE`` not off; see [Note: the update
    epilogue]). Raises ValueError for a value of the variable that is not on/off."""
    return env_flag(UPDATE_EPILOGUE_ENV, default=True) and X.is_cuda


def fused_copies_enabled(X: Tensor | None) -> bool:
    """Whether a copy of the updated master is written by the update GEMM itself (the Triton
    kernel: ``X`` on CUDA, or None for any CUDA tensor; Triton installed;
    ``DMUON_UPDATE_GEMM=triton``, not the default ``cublas``). Raises ValueError for a value of
    the variable that is not one of ``UPDATE_GEMMS``."""
    choice = env_choice(UPDATE_GEMM_ENV, UPDATE_GEMMS, default="cublas")
    return choice == "triton" and (X is None or X.is_cuda) and triton_available()


def update_gemm_launches(
    shapes: Iterable[tuple[int, int]], ns_dtype: torch.dtype, copy_dtype: torch.dtype
) -> list[tuple[object, tuple, dict]]:
    """The Triton update GEMM's launches for fp32 masters of ``shapes`` with copies in
    ``copy_dtype`` ([Note: compiles ahead] in ``dmuon_kernels._fused_triton``); none where the
    step would not run it (the epilogue or the Triton GEMM switched off)."""
    if not env_flag(UPDATE_EPILOGUE_ENV, default=True) or not fused_copies_enabled(None):
        return []
    from dmuon_kernels._update_gemm_triton import update_gemm_launches as launches_of

    return [
        launch
        for rows, cols in shapes
        for launch in launches_of(rows, cols, ns_dtype=ns_dtype, copy_dtype=copy_dtype)
    ]


def copy_into_(copies: Sequence[Tensor | None] | None, masters: Sequence[Tensor]) -> None:
    """``copies[i] = masters[i]`` rounded to the copy's dtype, for each copy that is not None
    (the separate pass the fused update GEMM saves)."""
    for copy, master in zip(copies or [None] * len(masters), masters, strict=True):
        if copy is not None:
            copy.copy_(master)


def final_update_(
    left: Tensor,
    X: Tensor,
    masters: Sequence[Tensor],
    *,
    decay: float,
    steps: Sequence[float],
    copies: Sequence[Tensor | None] | None = None,
) -> None:
    """``masters[i] = decay·masters[i] − steps[i]·(L_i·X_i)`` in place, as one GEMM each, and
    ``copies[i]`` (None, or a tensor of the master's shape) the new master rounded.

    ``left`` (B, n, n) and ``X`` (B, n, m) are the iteration's last factors (``L·X`` is its
    output). ``masters[i]`` is fp32 (or X's dtype), of shape (n, m), or (m, n) for a matrix
    iterated transposed, rows or columns contiguous. Nothing is returned or kept."""
    if len(masters) != X.shape[0] or len(steps) != X.shape[0]:
        raise ValueError(
            f"final_update_: {X.shape[0]} Newton-Schulz outputs, {len(masters)} masters and "
            f"{len(steps)} steps; pass one master and one step per matrix"
        )
    n, m = X.shape[-2:]
    copies = [None] * len(masters) if copies is None else copies
    fused = fused_copies_enabled(X) and any(c is not None for c in copies)
    if fused:
        from dmuon_kernels._update_gemm_triton import update_gemm_
    unfused = []
    for L, x, master, step, copy in zip(left, X, masters, steps, copies, strict=True):
        if tuple(master.shape) == (n, m):
            first, second = L, x
        elif tuple(master.shape) == (m, n):
            first, second = x.mT, L.mT  # (L·X)ᵀ
        else:
            raise ValueError(
                f"final_update_: a master of shape {tuple(master.shape)} for a Newton-Schulz "
                f"output of shape {(n, m)}; it must be that shape or its transpose"
            )
        if copy is not None and tuple(copy.shape) != tuple(master.shape):
            raise ValueError(
                f"final_update_: a copy of shape {tuple(copy.shape)} for a master of shape "
                f"{tuple(master.shape)}; they must be equal"
            )
        if fused and copy is not None and master.dtype == torch.float32:
            update_gemm_(first, second, master, copy, decay=decay, step=step)
            continue
        if copy is not None:
            unfused.append((copy, master))
        if master.dtype == x.dtype:
            master.addmm_(first, second, beta=decay, alpha=-step)
        else:
            torch.addmm(
                master, first, second, out_dtype=master.dtype, beta=decay, alpha=-step,
                out=master,
            )  # fmt: skip
    copy_into_([c for c, _ in unfused], [m for _, m in unfused])


__all__ = [
    "copy_into_",
    "epilogue_enabled",
    "final_update_",
    "fused_copies_enabled",
    "update_gemm_launches",
]
