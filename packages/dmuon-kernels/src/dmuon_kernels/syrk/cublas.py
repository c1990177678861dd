"""The torch SYRK backend: ``alpha·A·Aᵀ + beta·C`` with torch.mm / addmm / bmm / baddbmm.

On CUDA this is cuBLAS; on CPU it is the CPU BLAS. It is the universal fallback: every device,
every floating dtype, any batch shape, and the reference the faster kernels are checked against.
It must not import any optional library.

Symmetric results (``syrk`` and ``symmetric_product``) of large CUDA problems are assembled from
block columns instead of one full GEMM: with the M columns cut into b blocks, block column j is
one GEMM over rows ``j·w ..`` only (the lower part, diagonal block included), and the strict upper
part above each diagonal block is the transpose of the block below it, copied. That is
(b + 1) / 2b of the full product's FLOPs (3/4 for b = 2) for b GEMMs and one transposed copy of
about half the output, and it stays deterministic. ``symmetric_block_count`` picks b so that every
GEMM is still big enough to run at full speed; small problems and CPU tensors run one GEMM.

[Note: exact symmetry off CUDA] A GEMM does not promise that out[i, j] and out[j, i] are summed
in the same order: the CPU BLAS computes the two in different micro-kernel lanes and differs in
the last bit (max|out - outᵀ| ~ 1e-7 for a 6 x 10 fp32 A). ``syrk`` promises a symmetric result,
so off CUDA it keeps the GEMM's lower triangle (diagonal included) and copies it over the upper
one: every element is still one GEMM output, within the same error bound, and C is read through
its lower triangle only, as the symmetric kernels do. CUDA results are left as the GEMM (or the
block columns above) computes them.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from dmuon_kernels.syrk._operands import effective_c, one_batch

NAME = "cublas"
# Bumped whenever the way results are computed changes, so cached autotune verdicts re-measure.
BLOCKING_REVISION = "1"

# When to assemble block columns, measured on the H200 (benchmarks/results/cublas-blocks-*.json):
# below MIN_BLOCKED_VOLUME = M·K·batch the GEMMs are too short for the saved FLOPs to outweigh
# the smaller launches and the mirror copy; blocks narrower than MIN_BLOCK_WIDTH lose the same
# way; more than MAX_SYMMETRIC_BLOCKS gains at most a few percent more.
MIN_BLOCKED_VOLUME = 2**25
MIN_BLOCK_WIDTH = 1024
MAX_SYMMETRIC_BLOCKS = 4
_BLOCK_ALIGNMENT = 128  # block edges on multiples of 128 rows keep every GEMM operand aligned


def is_available() -> tuple[bool, str]:
    """Always available: plain torch matmuls run on every device and dtype."""
    return True, "torch.mm/addmm (cuBLAS on CUDA, CPU BLAS elsewhere)"


def versions() -> dict[str, str]:
    """What makes an autotune verdict measured against this backend stale when it changes."""
    return {"dmuon-cublas-blocking": BLOCKING_REVISION}


def symmetric_block_count(M: int, K: int, batch: int = 1) -> int:
    """How many block columns a symmetric (batch, M, M) CUDA result with inner size K is
    assembled from (1 = one full GEMM)."""
    if M * K * batch < MIN_BLOCKED_VOLUME:
        return 1
    return max(1, min(MAX_SYMMETRIC_BLOCKS, M // MIN_BLOCK_WIDTH))


def block_edges(M: int, blocks: int) -> list[int]:
    """``[0, e1, ..., M]``: ``blocks`` column blocks of nearly equal, 128-aligned width."""
    width = -(-M // blocks)
    width = max(_BLOCK_ALIGNMENT, -(-width // _BLOCK_ALIGNMENT) * _BLOCK_ALIGNMENT)
    return [*range(0, M, width), M]


def _gemm_into(
    out: Tensor, left: Tensor, right: Tensor, C: Tensor | None, alpha: float, beta: float
) -> None:
    """``out = alpha·left·right + beta·C`` for 2-D or 3-D (batched) operands; out may be a view."""
    if out.dim() == 2:
        if C is None:
            torch.mm(left, right, out=out)
        else:
            torch.addmm(C, left, right, beta=beta, alpha=alpha, out=out)
    elif C is None:
        torch.bmm(left, right, out=out)
    else:
        torch.baddbmm(C, left, right, beta=beta, alpha=alpha, out=out)
    if C is None and alpha != 1.0:
        out.mul_(alpha)


def _gemm(left: Tensor, right: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """``alpha·left·right + beta·C`` as a new tensor, for 2-D or 3-D (batched) operands: one
    torch call, no output buffer made beforehand (the cheapest launch on the host)."""
    if left.dim() == 2:
        out = (
            torch.mm(left, right)
            if C is None
            else torch.addmm(C, left, right, beta=beta, alpha=alpha)
        )
    elif C is None:
        out = torch.bmm(left, right)
    else:
        out = torch.baddbmm(C, left, right, beta=beta, alpha=alpha)
    if C is None and alpha != 1.0:
        out.mul_(alpha)
    return out


def symmetric_blocked(
    left: Tensor, right: Tensor, C: Tensor | None, alpha: float, beta: float, blocks: int
) -> Tensor:
    """``alpha·left·right + beta·C`` for a product known to be symmetric, from ``blocks`` block
    columns (see the module docstring). left (B, M, K) or (M, K), right (.., K, M), C (.., M, M)
    or None. Everything outside the diagonal blocks is exactly symmetric."""
    M = left.shape[-2]
    out = left.new_empty((*left.shape[:-1], M))
    edges = block_edges(M, blocks)
    for start, stop in itertools.pairwise(edges):
        _gemm_into(
            out[..., start:, start:stop],
            left[..., start:, :],
            right[..., :, start:stop],
            None if C is None else C[..., start:, start:stop],
            alpha,
            beta,
        )
    for start, stop in itertools.pairwise(edges[:-1]):
        out[..., start:stop, stop:].copy_(out[..., stop:, start:stop].mT)
    return out


def _symmetric(left: Tensor, right: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    C = effective_c(C, beta)
    M, K = left.shape[-2:]
    batch = left.shape[0] if left.dim() == 3 else 1
    blocks = symmetric_block_count(M, K, batch) if left.is_cuda else 1
    if blocks > 1:
        return symmetric_blocked(left, right, C, alpha, beta, blocks)
    return _gemm(left, right, C, alpha, beta)


def _mirror_lower_triangle(out: Tensor) -> Tensor:
    """``out`` (.., M, M) with its strict upper triangle replaced by the transpose of its strict
    lower one: exactly symmetric, every value taken from ``out``."""
    M = out.shape[-1]
    upper = torch.ones(M, M, dtype=torch.bool, device=out.device).triu_(1)  # (M, M)
    return torch.where(upper, out.mT, out)


def syrk(A: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """Return ``alpha·A·Aᵀ + beta·C`` for A (..., M, K) and C (..., M, M) or None; exactly
    symmetric off CUDA (see [Note: exact symmetry off CUDA])."""
    A3 = one_batch(A)
    out = _symmetric(A3, A3.mT, one_batch(C), alpha, beta)
    if not A3.is_cuda:
        out = _mirror_lower_triangle(out)
    return out if A.dim() <= 3 else out.reshape(*A.shape[:-1], A.shape[-2])


def symmetric_product(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """Return ``alpha·A·B + beta·C`` for square A, B, C (..., M, M) when A·B is symmetric."""
    out = _symmetric(one_batch(A), one_batch(B), one_batch(C), alpha, beta)
    return out if A.dim() <= 3 else out.reshape(A.shape)


def matmul(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """Return ``alpha·A·B + beta·C`` for A (..., M, K), B (..., K, N), C (..., M, N) or None."""
    out = _gemm(one_batch(A), one_batch(B), one_batch(effective_c(C, beta)), alpha, beta)
    return out if A.dim() <= 3 else out.reshape(*A.shape[:-1], B.shape[-1])
