"""What an optimizer step's device time is made of, against what its Newton-Schulz could cost.

Owns two things the profiling scripts share: the class of a device kernel (symmetric GEMM, full
GEMM, the fused element-wise passes, foreach/AdamW, copies, other) from its name, and the FLOP
floor of the default Newton-Schulz per class (symmetric products counted at half, as symmetric
kernels compute them) at a given GEMM rate. Measured time per class minus its floor is what
stands between a step and the floor, kernel class by kernel class. A symmetric product the
autotuner kept on cuBLAS runs as a full GEMM (at twice its counted FLOPs) and is timed in that
class: the two GEMM classes' sum against the two floors' sum is the GEMMs' whole gap.

Must not: measure anything (the scripts profile, this sums their rows) or import dmuon.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from dmuon_kernels.coefficients import DEFAULT_COEFFICIENTS
from dmuon_kernels.newton_schulz import DEFAULT_RESTART_ITERATIONS, uses_gram_form

SYMMETRIC_GEMM = "symmetric GEMM (quack, cute)"
FULL_GEMM = "full GEMM (cuBLAS, quack)"
FUSED_PASSES = "fused element-wise (Triton)"
FOREACH = "foreach / fused AdamW"
COPIES = "copies and fills"
OTHER = "other"
CLASSES = (SYMMETRIC_GEMM, FULL_GEMM, FUSED_PASSES, FOREACH, COPIES, OTHER)

NS_STEPS = len(DEFAULT_COEFFICIENTS)  # one iteration a row

# dmuon's Triton kernels are module-private functions named "_<what>_kernel".
_TRITON_NAME = re.compile(r"^_\w+_kernel$")


def kernel_class(name: str) -> str:
    """The class of a device kernel (or copy) from the name the profiler gives it."""
    lowered = name.lower()
    if "symmetric" in lowered or "syrk" in lowered:
        return SYMMETRIC_GEMM
    if any(word in lowered for word in ("nvjet", "gemm", "xmma", "cutlass")):
        return FULL_GEMM
    if _TRITON_NAME.match(name):
        return FUSED_PASSES
    if "multi_tensor_apply" in lowered or "fused" in lowered:
        return FOREACH
    if any(word in lowered for word in ("memcpy", "memset", "copy", "fill", "cat")):
        return COPIES
    return OTHER


def milliseconds_by_class(rows: Iterable[dict]) -> dict[str, float]:
    """Device ms per class over profiler rows ``{"kernel": name, "device_ms": ms}``."""
    totals = dict.fromkeys(CLASSES, 0.0)
    for row in rows:
        totals[kernel_class(row["kernel"])] += row["device_ms"]
    return totals


def newton_schulz_flops(
    shape: tuple[int, int],
    steps: int = NS_STEPS,
    restart_iterations: Sequence[int] = DEFAULT_RESTART_ITERATIONS,
) -> tuple[float, float]:
    """(symmetric, full) FLOPs of the default "gram" Newton-Schulz on one matrix, a symmetric
    product counted at half; the products ``gram_iteration`` / ``direct_iteration`` run."""
    n, m = min(shape), max(shape)
    if not uses_gram_form(n, m):  # per step: syrk n²m, b·A + c·A² n³, poly·X 2n²m
        return steps * (n * n * m + n**3), steps * 2.0 * n * n * m
    symmetric, full = float(n * n * m), 2.0 * n * n * m  # R = X·Xᵀ, and the output Q·X
    restarts = set(restart_iterations)
    for i in range(steps):
        starts_segment = i == 0 or i in restarts
        ends_segment = i == steps - 1 or (i + 1) in restarts
        if starts_segment and i > 0:  # X <- Q·X, R <- X·Xᵀ
            full += 2.0 * n * n * m
            symmetric += n * n * m
        symmetric += n**3  # Z = b·R + c·R²
        if not starts_segment:
            symmetric += n**3  # Q <- a·Q + Z·Q
        if not ends_segment:
            symmetric += 2.0 * n**3  # R <- (aI + Z)·R·(aI + Z)
    return symmetric, full


def floor_ms_by_class(shapes: Iterable[tuple[int, int]], peak_tflops: float) -> dict[str, float]:
    """The GEMM classes' FLOP floor in ms for these matrices at ``peak_tflops``."""
    symmetric = full = 0.0
    for shape in shapes:
        matrix_symmetric, matrix_full = newton_schulz_flops(shape)
        symmetric += matrix_symmetric
        full += matrix_full
    per_ms = peak_tflops * 1e9
    return {SYMMETRIC_GEMM: symmetric / per_ms, FULL_GEMM: full / per_ms}


def anatomy(rows: list[dict], shapes: list[tuple[int, int]], peak_tflops: float) -> dict:
    """Per class: measured device ms, the FLOP floor where there is one, and the gap."""
    measured = milliseconds_by_class(rows)
    floors = floor_ms_by_class(shapes, peak_tflops)
    return {
        name: {
            "device_ms": measured[name],
            "floor_ms": floors.get(name),
            "over_floor_ms": measured[name] - floors[name] if name in floors else None,
        }
        for name in CLASSES
    }


def format_anatomy(title: str, table: dict) -> str:
    lines = [f"{title:<34} {'device ms':>10} {'floor ms':>9} {'over':>8}"]
    for name, row in table.items():
        floor = "" if row["floor_ms"] is None else f"{row['floor_ms']:.2f}"
        over = "" if row["over_floor_ms"] is None else f"{row['over_floor_ms']:+.2f}"
        lines.append(f"{name:<34} {row['device_ms']:>10.2f} {floor:>9} {over:>8}")
    return "\n".join(lines)
