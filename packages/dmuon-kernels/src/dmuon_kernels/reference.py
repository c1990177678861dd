"""Slow, readable float64 twins of the Newton-Schulz pieces, used as test oracles, and the
matrices with controlled spectra they are checked on.

Everything here runs in float64 on the input's device with plain matmuls and SVDs; nothing is
tuned for speed, and the fast modules must never call into this one. ``SPECTRUM_CASES`` are the
test suite's matrices (tests/kernels) and the rows of ``benchmarks/kernels/bench_ns_schedules.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def polar_factor(G: Tensor) -> Tensor:
    """U·Vᵀ from the float64 SVD of G (..., m, n): the orthogonal factor NS approximates.

    For a rank-deficient G the polar factor is not unique; this returns the one the SVD picks.
    """
    U, _, Vh = torch.linalg.svd(G.to(torch.float64), full_matrices=False)
    return U @ Vh


def scalar_recurrence(
    sigma: Tensor | float, coefficients: Sequence[Sequence[float]]
) -> Tensor | float:
    """Apply ``x <- a·x + b·x³ + c·x⁵`` once per (a, b, c) row to every value of ``sigma``.

    This is what Newton-Schulz does to each singular value of its (normalised) input.
    """
    x = sigma.to(torch.float64) if isinstance(sigma, Tensor) else float(sigma)
    for a, b, c in coefficients:
        x = a * x + b * x**3 + c * x**5
    return x


def newton_schulz_by_svd(
    G: Tensor, coefficients: Sequence[Sequence[float]], eps: float = 1e-7
) -> Tensor:
    """What Newton-Schulz computes in exact arithmetic: U·diag(p(σ / (||G||_F + eps)))·Vᵀ."""
    G64 = G.to(torch.float64)
    U, sigma, Vh = torch.linalg.svd(G64, full_matrices=False)
    norm = torch.linalg.matrix_norm(G64, keepdim=True).squeeze(-1)  # (..., 1)
    mapped = scalar_recurrence(sigma / (norm + eps), coefficients)
    return U @ (mapped.unsqueeze(-1) * Vh)


def direct_newton_schulz(
    G: Tensor,
    coefficients: Sequence[Sequence[float]],
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The classic iteration spelled out: orient, normalise, iterate in ``dtype``, orient back.

    In float64 (the default) it is an oracle; in a low precision it measures the rounding error
    of the most straightforward implementation, the yardstick for the fast paths.
    """
    X = G.to(torch.float64)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = X.mT
    X = (X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)).to(dtype)
    for a, b, c in coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if transposed else X).to(torch.float64)


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


def spectrum_case(name: str, seed: int = 0) -> Tensor:
    """The float32 matrix of ``SPECTRUM_CASES[name]``."""
    rows, cols, spectrum = SPECTRUM_CASES[name]
    return matrix_with_spectrum(rows, cols, spectrum, seed=seed)
