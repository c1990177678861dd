"""Coefficient tables for the quintic Newton-Schulz iteration, and their validation.

Each row (a, b, c) is one iteration ``X <- a X + b (X Xᵀ) X + c (X Xᵀ)² X``, which maps every
singular value x of X through ``a x + b x³ + c x⁵``. This module owns the tables and the check
that a user-supplied table is well formed; it must not run any iteration.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

CoefficientRow = tuple[float, float, float]
CoefficientTable = tuple[CoefficientRow, ...]

# Polar Express (arXiv 2505.16932), 5 rows optimised for inputs with singular values in (0, 1].
POLAR_EXPRESS_RAW_COEFFICIENTS: CoefficientTable = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)

# Dividing x by s before each row, (a/s, b/s³, c/s⁵), leaves head-room for rounding in low precision
# so singular values slightly above 1 are not blown up. With s = 1.05 every singular value
# sigma/||G||_F in [1e-3, 1] ends in [0.729, 1.124].
POLAR_EXPRESS_SAFETY_FACTOR = 1.05


def apply_safety_factor(table: CoefficientTable, safety: float) -> CoefficientTable:
    """Return the rows (a/s, b/s³, c/s⁵): each iteration evaluated at x/s."""
    return tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in table)


POLAR_EXPRESS_COEFFICIENTS: CoefficientTable = apply_safety_factor(
    POLAR_EXPRESS_RAW_COEFFICIENTS, POLAR_EXPRESS_SAFETY_FACTOR
)

# You Jiacheng's five-step table.
YOU_COEFFICIENTS: CoefficientTable = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Keller Jordan's row repeated five times: what torch.optim.Muon uses.
KELLER_COEFFICIENTS: CoefficientTable = ((3.4445, -4.7750, 2.0315),) * 5

DEFAULT_COEFFICIENTS = POLAR_EXPRESS_COEFFICIENTS


def validate_coefficients(coefficients: Sequence[Sequence[float]] | None) -> CoefficientTable:
    """Return ``coefficients`` as a tuple of (a, b, c) float tuples, or raise ValueError.

    ``None`` means the default table (Polar Express with safety factor 1.05).
    """
    if coefficients is None:
        return DEFAULT_COEFFICIENTS
    if isinstance(coefficients, str | bytes) or not isinstance(coefficients, Sequence):
        raise ValueError(
            "coefficients must be a sequence of (a, b, c) rows, one per iteration, e.g. "
            f"dmuon_kernels.POLAR_EXPRESS_COEFFICIENTS; got {coefficients!r}"
        )
    if len(coefficients) == 0:
        raise ValueError(
            "coefficients is empty: give at least one (a, b, c) row (one row per iteration), "
            "or None for the default Polar Express table"
        )
    rows = []
    for index, row in enumerate(coefficients):
        if isinstance(row, str | bytes) or not isinstance(row, Sequence) or len(row) != 3:
            raise ValueError(
                f"coefficients row {index} must have exactly 3 values (a, b, c); got {row!r}"
            )
        for value in row:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(
                    f"coefficients row {index} must hold real numbers; got {row!r} "
                    f"(value {value!r} of type {type(value).__name__})"
                )
            if not math.isfinite(value):
                raise ValueError(f"coefficients row {index} must be finite; got {row!r}")
        rows.append((float(row[0]), float(row[1]), float(row[2])))
    return tuple(rows)
