"""Matrices with controlled spectra, and the error yardsticks the Newton-Schulz tests use.

Tolerances, and why:
- fp32 iteration: a rounding of relative size eps made early in the iteration is amplified by
  at most the slope of the composed polynomial, which is largest at 0, where it is the product of
  the rows' ``a`` (about 800 for Polar Express, 490 for Keller). So the output may differ from
  the exact polynomial U·p(Σ)·Vᵀ by ``prod(a) · eps_fp32`` relative (about 1e-4).
- fp16 / bf16 iteration: that bound is useless (0.8 in fp16), so the yardstick is the error of the
  plainest implementation in the same dtype (``reference.direct_newton_schulz(..., dtype)``): the
  fast path may be at most ``LOW_PRECISION_RATIO`` times worse (quack's rule for kernels).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dmuon_kernels import reference
from tests.numerics import relative_error

LOW_PRECISION_RATIO = 2.0


def matrix_with_spectrum(rows: int, cols: int, singular_values, *, seed: int = 0) -> Tensor:
    """A float32 (rows, cols) matrix U·diag(s)·Vᵀ with random orthonormal U, V (float64 QR)."""
    generator = torch.Generator().manual_seed(seed)
    rank_bound = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, rank_bound, dtype=torch.float64, generator=generator))
    V, _ = torch.linalg.qr(torch.randn(cols, rank_bound, dtype=torch.float64, generator=generator))
    s = torch.as_tensor(singular_values, dtype=torch.float64)
    assert s.numel() == rank_bound
    return ((U * s) @ V.T).to(torch.float32)


def log_spectrum(size: int, smallest: float, *, rank: int | None = None) -> Tensor:
    """``rank`` values from 1 down to ``smallest`` (log-spaced), then zeros up to ``size``."""
    rank = size if rank is None else rank
    values = torch.logspace(0, math.log10(smallest), rank, dtype=torch.float64)
    return torch.cat([values, torch.zeros(size - rank, dtype=torch.float64)])


# name -> (rows, cols, singular values): the shapes Muon meets, in both orientations.
SPECTRUM_CASES = {
    "square": (64, 64, log_spectrum(64, 1e-3)),
    "wide": (48, 160, log_spectrum(48, 1e-3)),
    "tall": (160, 48, log_spectrum(48, 1e-3)),
    "very_wide": (32, 256, log_spectrum(32, 1e-4)),
    "single_row": (1, 100, [3.0]),
    "rank_deficient": (64, 128, log_spectrum(64, 1e-2, rank=16)),
}


def fp32_tolerance(coefficients) -> float:
    """``prod(|a|) · eps_fp32``: see the module docstring."""
    return math.prod(abs(a) for a, _, _ in coefficients) * torch.finfo(torch.float32).eps


def plain_loop_error(G: Tensor, coefficients, dtype: torch.dtype) -> float:
    """Relative error of the straightforward NS loop run in ``dtype``, against exact arithmetic."""
    exact = reference.newton_schulz_by_svd(G, coefficients)
    return relative_error(reference.direct_newton_schulz(G, coefficients, dtype=dtype), exact)
