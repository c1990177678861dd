"""Coefficient tables for the quintic Newton-Schulz iteration, their derivation, their validation.

Each row (a, b, c) is one iteration ``X <- a X + b (X Xᵀ) X + c (X Xᵀ)² X``, which maps every
singular value x of X through ``a x + b x³ + c x⁵``. This module owns the tables, the Polar
Express construction they come from (``polar_express_rows``, pure Python float64, used to verify
the tables and to derive new ones) and the check that a user-supplied table is well formed; it
must not run any iteration.

Sources: Polar Express — N. Amsel, D. Persson, C. Musco, R. M. Gower, "The Polar Express: Optimal
Matrix Sign Methods and Their Application to the Muon Algorithm", arXiv 2505.16932 (2025): the
greedy composition of minimax odd polynomials with a cushion and recentring (their Algorithm 1
and Section 4), re-derived here from those formulas; You Jiacheng's five-step table; Keller
Jordan's Muon row (the one ``torch.optim.Muon`` uses).

[Note: cheaper schedules]
Each quintic row costs the gram iteration about 4·n³ of symmetric products (n the short side),
the direct one a full step (3·n²·m + n³); a cubic row (c = 0) saves one n³ product. On the test
suite's matrices (``reference.SPECTRUM_CASES``: singular values log-spaced over three to four
decades) no table built this way with four quintic rows, or with four quintic rows and one cubic
(any lower bound from 3e-4 to 1e-2, safety factor 1 to 1.06, the cubic at any position), is as
close to the polar factor as the default on every matrix; computed in exact arithmetic from the
matrices' SVDs, even a four-step table applied to singular values divided by the exact largest
one stays at 0.25 or more where the default reaches 0.18-0.20, because the suite's smallest
sigma / ||G||_F (down to 5e-5) need five quintic steps' gain at 0 (prod(a) = 804).
``POLAR_EXPRESS_4_COEFFICIENTS`` is the opt-in four-step table: every sigma / ||G||_F in
[4.16e-3, 1] (instead of [1e-3, 1]) ends within the default's band [0.729, 1.124], for 13-20 %
fewer Newton-Schulz FLOPs. ``benchmarks/kernels/bench_ns_schedules.py`` prints each table's
error and time; the default stays.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

CoefficientRow = tuple[float, float, float]
CoefficientTable = tuple[CoefficientRow, ...]

# Polar Express (arXiv 2505.16932), 5 rows optimised for inputs with singular values in
# [1e-3, 1]: ``polar_express_rows(5)`` reproduces them.
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

# Four steps for singular values in [4.16e-3, 1] (see [Note: cheaper schedules]): from there one
# step lands where the five-step table's second lands, so rows 2-4 are its rows 3-5 (before the
# safety factor); ``polar_express_rows(4, POLAR_EXPRESS_4_LOWER_BOUND)`` reproduces them.
POLAR_EXPRESS_4_LOWER_BOUND = 4.160835023053225e-3
POLAR_EXPRESS_4_RAW_COEFFICIENTS: CoefficientTable = (
    (8.18008225036562, -23.290859709380488, 17.07674316402387),
    *POLAR_EXPRESS_RAW_COEFFICIENTS[2:],
)
POLAR_EXPRESS_4_COEFFICIENTS: CoefficientTable = apply_safety_factor(
    POLAR_EXPRESS_4_RAW_COEFFICIENTS, POLAR_EXPRESS_SAFETY_FACTOR
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


def validate_coefficients(coefficients: object) -> CoefficientTable:
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


# ---- the Polar Express construction ------------------------------------------------------------

# Polar Express's cushion: each step is fitted on [max(lower, cushion·upper), upper], which keeps
# the first polynomials' slope moderate (and so their rounding error) when the lower end is tiny.
POLAR_EXPRESS_CUSHION = 0.02407327424182761
_REMEZ_ITERATIONS = 100


def polar_express_rows(
    steps: int, lower_bound: float = 1e-3, cushion: float = POLAR_EXPRESS_CUSHION
) -> CoefficientTable:
    """The Polar Express rows (without safety factor) for singular values in [lower_bound, 1].

    Greedy: on the current interval [l, u] (first [lower_bound, 1]) take the odd quintic p that
    best approximates 1 in the max norm on [max(l, cushion·u), u], rescale it so that
    p(l) + p(u) = 2 (it then maps [l, u] into [p(l), 2 − p(l)]), and continue on that interval.
    """
    lower, upper = float(lower_bound), 1.0
    rows = []
    for _ in range(steps):
        a, b, c = _minimax_odd_quintic(max(lower, cushion * upper), upper)
        recentre = 2.0 / (_quintic(a, b, c, lower) + _quintic(a, b, c, upper))
        a, b, c = a * recentre, b * recentre, c * recentre
        rows.append((a, b, c))
        lower = _quintic(a, b, c, lower)
        upper = 2.0 - lower
    return tuple(rows)


def _quintic(a: float, b: float, c: float, x: float) -> float:
    return a * x + b * x**3 + c * x**5


def _minimax_odd_quintic(lower: float, upper: float) -> CoefficientRow:
    """(a, b, c) minimising max |1 − (a·x + b·x³ + c·x⁵)| over [lower, upper], by Remez exchange:
    the error equioscillates at lower, q, r, upper (q, r the interior extrema, where
    p'(x) = a + 3·b·x² + 5·c·x⁴ = 0)."""
    q, r = lower + (upper - lower) / 3, lower + 2 * (upper - lower) / 3
    for _ in range(_REMEZ_ITERATIONS):
        points = (lower, q, r, upper)
        # p(x_i) − s_i·E = 1 with alternating signs s = (−1, +1, −1, +1)
        system = [[x, x**3, x**5, -sign] for x, sign in zip(points, (-1.0, 1.0, -1.0, 1.0))]
        a, b, c, _ = _solve(system, [1.0] * 4)
        root = math.sqrt(9 * b * b - 20 * a * c)
        q_next, r_next = sorted(math.sqrt((-3 * b + s * root) / (10 * c)) for s in (-1.0, 1.0))
        converged = abs(q_next - q) + abs(r_next - r) <= 1e-15
        q, r = q_next, r_next
        if converged:
            break
    return a, b, c


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """x with matrix·x = rhs: Gaussian elimination with partial pivoting (a small dense system)."""
    size = len(rhs)
    rows = [[*row, value] for row, value in zip(matrix, rhs, strict=True)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda i: abs(rows[i][column]))
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for i in range(column + 1, size):
            factor = rows[i][column] / rows[column][column]
            rows[i] = [x - factor * y for x, y in zip(rows[i], rows[column])]
    solution = [0.0] * size
    for i in reversed(range(size)):
        tail = sum(rows[i][j] * solution[j] for j in range(i + 1, size))
        solution[i] = (rows[i][size] - tail) / rows[i][i]
    return solution
