"""SYRK speed: cuBLAS's full product ``a @ a.T`` against quack, cute and ``kernel="auto"``.

For each dtype (fp16, bf16) and shape A (M, K), every column computes A·Aᵀ on the same input:
``cublas`` is ``a @ a.T`` (the full product, what torch does), ``quack`` and ``cute`` the
backends (a column says why when a backend is unavailable), ``auto`` the dispatcher with its
per-shape autotune (tuned during warm-up, so its verdict is in place before timing). A second
table does the same for ``symmetric_product`` (A·B with A, B commuting symmetric n x n; the
Gram iteration's other products) against ``torch.mm``, a third for ``matmul`` (0.5·C + A·B,
Newton-Schulz's non-symmetric products) against ``torch.addmm``.

Timing is ``dmuon_kernels.syrk.timing.median_ms``, the autotuner's own: GPU-only (a spin kernel
keeps the host's launch overhead out), CUDA events, the columns interleaved, median of
``--repeats`` regions of about 1 ms each. Ratios are cublas_ms / column_ms (> 1 is faster) and
``auto / best`` compares auto with the faster of cuBLAS and quack, in the same run.

Usage (repository root, packages on PYTHONPATH)::

    python benchmarks/kernels/bench_syrk.py                         # JSON: benchmarks/results/syrk-<gpu>-<date>.json
    python benchmarks/kernels/bench_syrk.py --out syrk.json --repeats 25 --git-sha <sha>
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from benchmarks import _common
from dmuon_kernels import __version__
from dmuon_kernels.syrk import (
    backend_availability,
    get_backend,
    matmul,
    resolve_kernel,
    symmetric_product,
    syrk,
)
from dmuon_kernels.syrk.timing import median_ms

SHAPES = [(1024, 4096), (4096, 4096), (4096, 14336), (8192, 8192), (8192, 28672)]
SQUARE_SIZES = [1024, 4096, 8192]  # symmetric_product: the Gram matrices of the shapes above
# matmul (M, K, N): Newton-Schulz's Q·X and poly·X for the shapes above
MATMUL_SHAPES = [(1024, 1024, 4096), (4096, 4096, 4096), (4096, 4096, 14336), (8192, 8192, 8192),
                 (8192, 8192, 28672)]  # fmt: skip
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
BACKENDS = ("quack", "cute")
COLUMNS = ("cublas", *BACKENDS, "auto")


def syrk_columns(A: torch.Tensor) -> dict[str, Callable[[], object] | str]:
    """Column name -> zero-argument call on A, or the reason the column cannot run."""
    columns: dict[str, Callable[[], object] | str] = {"cublas": lambda: A @ A.T}
    for name in BACKENDS:
        available, reason = backend_availability(name)
        backend = get_backend(name)
        columns[name] = (lambda b=backend: b.syrk(A, None, 1.0, 0.0)) if available else reason
    columns["auto"] = lambda: syrk(A, kernel="auto")
    return columns


def product_columns(S: torch.Tensor, B: torch.Tensor) -> dict[str, Callable[[], object] | str]:
    columns: dict[str, Callable[[], object] | str] = {"cublas": lambda: torch.mm(S, B)}
    for name in BACKENDS:
        available, reason = backend_availability(name)
        backend = get_backend(name)
        if available and not hasattr(backend, "symmetric_product"):
            available, reason = False, f"{name} has no symmetric_product"
        columns[name] = (
            (lambda b=backend: b.symmetric_product(S, B, None, 1.0, 0.0)) if available else reason
        )
    columns["auto"] = lambda: symmetric_product(S, B, kernel="auto")
    return columns


def matmul_columns(
    A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> dict[str, Callable[[], object] | str]:
    """a·X + P·X as Newton-Schulz's direct step issues it: torch.addmm against the backends."""
    columns: dict[str, Callable[[], object] | str] = {
        "cublas": lambda: torch.addmm(C, A, B, beta=0.5)
    }
    for name in BACKENDS:
        available, reason = backend_availability(name)
        backend = get_backend(name)
        if available and not hasattr(backend, "matmul"):
            available, reason = False, f"{name} has no matmul"
        columns[name] = (lambda b=backend: b.matmul(A, B, C, 1.0, 0.5)) if available else reason
    columns["auto"] = lambda: matmul(A, B, C=C, beta=0.5, kernel="auto")
    return columns


def measure(
    label: list[int], dtype_name: str, columns: dict[str, Callable[[], object] | str], *,
    repeats: int, chosen: str,
) -> dict:  # fmt: skip
    runnable = {name: fn for name, fn in columns.items() if callable(fn)}
    for fn in runnable.values():  # warm-up: compiles quack, tunes "auto"
        fn()
    timings = median_ms(runnable, torch.device("cuda"), repeats=repeats)
    entry: dict = {"shape": label, "dtype": dtype_name, "auto_chose": chosen, "median_ms": {}}
    entry["unavailable"] = {name: fn for name, fn in columns.items() if isinstance(fn, str)}
    entry["median_ms"] = {name: timings.get(name) for name in columns}
    cublas_ms = timings["cublas"]
    entry["speedup_vs_cublas"] = {name: cublas_ms / ms for name, ms in timings.items()}
    best = min(ms for name, ms in timings.items() if name in ("cublas", "quack"))
    entry["auto_vs_best_of_cublas_quack"] = best / timings["auto"]
    return entry


def run(repeats: int) -> tuple[list[dict], list[dict], list[dict]]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    syrk_rows, product_rows, matmul_rows = [], [], []
    for dtype_name, dtype in DTYPES.items():
        for M, K in SHAPES:
            A = torch.randn(M, K, device="cuda", generator=generator).mul_(K**-0.25).to(dtype)
            chosen = resolve_kernel("auto", A)
            syrk_rows.append(
                measure([M, K], dtype_name, syrk_columns(A), repeats=repeats, chosen=chosen)
            )
            del A
            torch.cuda.empty_cache()
        for n in SQUARE_SIZES:
            S = torch.randn(n, n, device="cuda", generator=generator).mul_(n**-0.25)
            S = ((S + S.T) / 2).to(dtype)
            B = 0.5 * S.float() + 0.1 * (S.float() @ S.float())  # a polynomial in S
            B = ((B + B.T) / 2).to(dtype)  # exactly symmetric: cute reads B's transpose
            chosen = resolve_kernel("auto", S, op="symmetric_product")
            product_rows.append(
                measure([n, n], dtype_name, product_columns(S, B), repeats=repeats, chosen=chosen)
            )
            del S, B
            torch.cuda.empty_cache()
        for M, K, N in MATMUL_SHAPES:
            A, B, C = (
                torch.randn(shape, device="cuda", generator=generator).mul_(K**-0.25).to(dtype)
                for shape in ((M, K), (K, N), (M, N))
            )
            chosen = resolve_kernel("auto", A, C, op="matmul", B=B)
            matmul_rows.append(
                measure([M, K, N], dtype_name, matmul_columns(A, B, C), repeats=repeats,
                        chosen=chosen)
            )  # fmt: skip
            del A, B, C
            torch.cuda.empty_cache()
    return syrk_rows, product_rows, matmul_rows


def format_table(title: str, rows: Sequence[dict]) -> str:
    lines = [
        title,
        f"{'dtype':>9} {'shape':>16}"
        + "".join(f"{c:>18}" for c in COLUMNS)
        + f"{'auto/best':>11}  auto chose",
    ]
    for row in rows:
        cells = []
        for name in COLUMNS:
            ms = row["median_ms"].get(name)
            if ms is None:
                cells.append(f"{'n/a':>18}")
            elif name == "cublas":
                cells.append(f"{ms:>12.3f} ms   ")
            else:
                cells.append(f"{ms:>8.3f} ({row['speedup_vs_cublas'][name]:.2f}x)  ")
        shape = "x".join(str(size) for size in row["shape"])
        lines.append(
            f"{row['dtype']:>9} {shape:>16}" + "".join(cells)
            + f"{row['auto_vs_best_of_cublas_quack']:>10.3f}  {row['auto_chose']}"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25, help="timed regions per column")
    _common.add_record_options(parser, "default: benchmarks/results/syrk-<gpu>-<date>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_syrk: needs a CUDA device", file=sys.stderr)
        return 2
    date = _common.utc_now()
    gpu = _common.device_name(torch.device("cuda"))
    syrk_rows, product_rows, matmul_rows = run(args.repeats)
    print(f"SYRK on {gpu}, GPU-only median ms; (x) = speedup vs cuBLAS a @ a.T")
    print(format_table("A·Aᵀ for A (M, K):", syrk_rows))
    unavailable = {k: v for row in syrk_rows for k, v in row["unavailable"].items()}
    for name, reason in unavailable.items():
        print(f"{name}: {reason}")
    print(format_table("symmetric_product S·B, (n, n):", product_rows))
    print(format_table("matmul 0.5·C + A·B, (M, K, N) (cublas = torch.addmm):", matmul_rows))
    record = {
        "benchmark": "syrk",
        "date": _common.iso_seconds(date),
        "git_sha": _common.git_sha(args.git_sha),
        "device": gpu,
        "compute_capability": list(torch.cuda.get_device_capability()),
        "versions": _common.versions(
            **{"dmuon-kernels": __version__},
            **_common.installed("quack-kernels", "nvidia-cutlass-dsl", "triton"),
        ),
        "timing": "GPU-only (spin kernel ahead of each region), CUDA events, interleaved, median",
        "inputs": {"shapes": SHAPES, "square_sizes": SQUARE_SIZES, "matmul_shapes": MATMUL_SHAPES,
                   "dtypes": list(DTYPES), "repeats": args.repeats},
        "syrk": syrk_rows,
        "symmetric_product": product_rows,
        "matmul": matmul_rows,
    }  # fmt: skip
    _common.write_json(args.out or _common.result_path("syrk", gpu, date), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
