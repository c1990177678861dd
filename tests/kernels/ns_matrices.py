"""Matrices with controlled spectra (from ``dmuon_kernels.reference``, where the benchmarks find
them too), and the error yardsticks the Newton-Schulz tests use.

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
from dmuon_kernels.reference import SPECTRUM_CASES, log_spectrum, matrix_with_spectrum
from tests.numerics import relative_error

__all__ = [
    "LOW_PRECISION_RATIO",
    "SPECTRUM_CASES",
    "fp32_tolerance",
    "log_spectrum",
    "matrix_with_spectrum",
    "plain_loop_error",
]

LOW_PRECISION_RATIO = 2.0


def fp32_tolerance(coefficients) -> float:
    """``prod(|a|) · eps_fp32``: see the module docstring."""
    return math.prod(abs(a) for a, _, _ in coefficients) * torch.finfo(torch.float32).eps


def plain_loop_error(G: Tensor, coefficients, dtype: torch.dtype) -> float:
    """Relative error of the straightforward NS loop run in ``dtype``, against exact arithmetic."""
    exact = reference.newton_schulz_by_svd(G, coefficients)
    return relative_error(reference.direct_newton_schulz(G, coefficients, dtype=dtype), exact)
