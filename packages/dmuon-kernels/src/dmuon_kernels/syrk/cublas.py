"""The torch SYRK backend: ``alpha·A·Aᵀ + beta·C`` with torch.mm / addmm / bmm / baddbmm.

On CUDA this is cuBLAS; on CPU it is the CPU BLAS. It is the universal fallback: every device,
every floating dtype, any batch shape, and the reference the faster kernels are checked against.
It must not import any optional library.
"""

from __future__ import annotations

import torch
from torch import Tensor

NAME = "cublas"


def is_available() -> tuple[bool, str]:
    """Always available: plain torch matmuls run on every device and dtype."""
    return True, "torch.mm/addmm (cuBLAS on CUDA, CPU BLAS elsewhere)"


def syrk(A: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """Return ``alpha·A·Aᵀ + beta·C`` for A (..., M, K) and C (..., M, M) or None."""
    batch_shape = A.shape[:-2]
    rows, inner = A.shape[-2], A.shape[-1]
    if A.dim() == 2:
        if C is None or beta == 0.0:
            return torch.mm(A, A.T) if alpha == 1.0 else torch.mm(A, A.T).mul_(alpha)
        return torch.addmm(C, A, A.T, beta=beta, alpha=alpha)
    A3 = A.reshape(-1, rows, inner)  # (B, M, K)
    if C is None or beta == 0.0:
        out = torch.bmm(A3, A3.mT)
        if alpha != 1.0:
            out.mul_(alpha)
    else:
        out = torch.baddbmm(C.reshape(-1, rows, rows), A3, A3.mT, beta=beta, alpha=alpha)
    return out.reshape(*batch_shape, rows, rows)


def symmetric_product(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """Return ``alpha·A·B + beta·C`` for square A, B, C (..., M, M): a full product here."""
    batch_shape, rows = A.shape[:-2], A.shape[-2]
    if A.dim() == 2:
        if C is None or beta == 0.0:
            return torch.mm(A, B) if alpha == 1.0 else torch.mm(A, B).mul_(alpha)
        return torch.addmm(C, A, B, beta=beta, alpha=alpha)
    A3, B3 = A.reshape(-1, rows, rows), B.reshape(-1, rows, rows)
    if C is None or beta == 0.0:
        out = torch.bmm(A3, B3)
        if alpha != 1.0:
            out.mul_(alpha)
    else:
        out = torch.baddbmm(C.reshape(-1, rows, rows), A3, B3, beta=beta, alpha=alpha)
    return out.reshape(*batch_shape, rows, rows)


def matmul(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """Return ``alpha·A·B + beta·C`` for A (..., M, K), B (..., K, N), C (..., M, N) or None."""
    if A.dim() == 2:
        if C is None or beta == 0.0:
            return torch.mm(A, B) if alpha == 1.0 else torch.mm(A, B).mul_(alpha)
        return torch.addmm(C, A, B, beta=beta, alpha=alpha)
    batch_shape, (M, K), N = A.shape[:-2], A.shape[-2:], B.shape[-1]
    A3, B3 = A.reshape(-1, M, K), B.reshape(-1, K, N)
    if C is None or beta == 0.0:
        out = torch.bmm(A3, B3)
        if alpha != 1.0:
            out.mul_(alpha)
    else:
        out = torch.baddbmm(C.reshape(-1, M, N), A3, B3, beta=beta, alpha=alpha)
    return out.reshape(*batch_shape, M, N)
