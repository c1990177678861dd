"""Yardsticks and operands shared by the kernel tests (tests/kernels on the CPU, tests/gpu).

- ``relative_error``: the one error measure, Frobenius over every element, in float64;
- ``fp32_product`` and ``assert_within_twice_cublas``: quack's rule for a GPU kernel: its error
  against a true fp32 product may be at most twice cuBLAS's own error on the same inputs, plus a
  quarter of the dtype's rounding unit, so two correctly rounding kernels never fail on a draw;
- ``syrk_operands``: A (..., M, K) and a symmetric C (..., M, M), seeded;
- ``momentum_inputs``: a gradient and a momentum buffer for the fused step pieces.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The floor of the twice-cuBLAS rule, in units of the dtype's rounding (eps / 2).
CUBLAS_ERROR_FLOOR_ULPS = 0.25


def relative_error(actual: Tensor, reference: Tensor) -> float:
    """``||actual - reference|| / ||reference||`` in float64, on ``reference``'s device."""
    reference = reference.to(torch.float64)
    actual = actual.to(device=reference.device, dtype=torch.float64)
    return ((actual - reference).norm() / reference.norm()).item()


def fp32_product(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """alpha·A·B + beta·C in true fp32 (no TF32)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        out = alpha * (A.float() @ B.float())
        return out if C is None else out + beta * C.float()
    finally:
        torch.set_float32_matmul_precision(previous)


def assert_within_twice_cublas(
    out: Tensor, cublas_out: Tensor, reference: Tensor, dtype: torch.dtype
) -> None:
    """``out``'s error against ``reference`` is at most twice ``cublas_out``'s, plus the floor."""
    floor = CUBLAS_ERROR_FLOOR_ULPS * torch.finfo(dtype).eps / 2
    error, cublas_error = relative_error(out, reference), relative_error(cublas_out, reference)
    assert error <= 2 * cublas_error + floor, (error, cublas_error)


def batch_dims(batch: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """Leading dimensions from None (no batch), a count, or a tuple of them."""
    if batch is None:
        return ()
    return (batch,) if isinstance(batch, int) else tuple(batch)


def syrk_operands(
    batch: int | tuple[int, ...] | None,
    M: int,
    K: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cuda",
) -> tuple[Tensor, Tensor]:
    """A (*batch, M, K), scaled so A·Aᵀ has entries of order 1 off the diagonal, and a symmetric
    C (*batch, M, M), both in ``dtype``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    lead = batch_dims(batch)
    A = torch.randn((*lead, M, K), device=device, generator=generator).mul_(K**-0.25)
    S = torch.randn((*lead, M, M), device=device, generator=generator)
    return A.to(dtype), ((S + S.mT) / 2).to(dtype)


def momentum_inputs(
    shape: tuple[int, ...], grad_dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """A gradient in ``grad_dtype`` and an fp32 momentum buffer of ``shape``, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(shape, generator=generator).to(grad_dtype)
    buf = torch.randn(shape, generator=generator)
    return grad, buf
