"""How many block columns the cuBLAS backend should assemble a symmetric result from.

For each symmetric problem of Newton-Schulz on the stacks we benchmark (the Gram matrix
``syrk(X)``, ``b·R + c·R²`` = ``syrk(R, C=R)``, and ``a·Q + Z·Q`` = ``symmetric_product``), fp16,
single and batched, this times ``syrk.cublas.symmetric_blocked`` with 2, 3, 4, 6 and 8 block
columns against the full product (1 block), GPU-only, interleaved, median
(``syrk.timing.median_ms``), and prints which count wins next to what
``symmetric_block_count`` picks. A second table compares fp16 and bf16, ``mm`` and ``addmm``
at 4096³, the shape of the square direct iteration.

Usage (repository root, dmuon-kernels on PYTHONPATH)::

    python benchmarks/kernels/bench_cublas_blocks.py --out blocks.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from benchmarks import _common
from dmuon_kernels import __version__
from dmuon_kernels.syrk import cublas
from dmuon_kernels.syrk.timing import median_ms

BLOCK_COUNTS = (1, 2, 3, 4, 6, 8)
# (operation, batch, M, K): K is the long side for "syrk", M for the square operations.
PROBLEMS = [
    ("syrk", 1, 1024, 4096),
    ("syrk", 8, 1024, 4096),
    ("syrk", 1, 2048, 8192),
    ("syrk", 1, 4096, 4096),
    ("syrk", 8, 4096, 4096),
    ("syrk", 1, 4096, 14336),
    ("syrk", 12, 4096, 14336),
    ("syrk", 1, 8192, 8192),
    ("syrk", 1, 8192, 28672),
    ("syrk_with_c", 1, 1024, 1024),
    ("syrk_with_c", 8, 1024, 1024),
    ("syrk_with_c", 1, 4096, 4096),
    ("syrk_with_c", 12, 4096, 4096),
    ("syrk_with_c", 1, 8192, 8192),
    ("symmetric_product", 1, 4096, 4096),
    ("symmetric_product", 12, 4096, 4096),
    ("symmetric_product", 1, 8192, 8192),
]


def problem_contenders(
    operation: str, batch: int, M: int, K: int, device: torch.device
) -> dict[str, Callable[[], object]]:
    def rand(*shape):
        return torch.randn(batch, *shape, device=device, dtype=torch.float16) / shape[-1] ** 0.5

    if operation == "syrk":
        left = rand(M, K)
        right, C, alpha, beta = left.mT, None, 1.0, 0.0
    else:
        left = rand(M, M)
        left = (left + left.mT) / 2
        C, alpha, beta = left, 0.75, -1.25
        right = left.mT if operation == "syrk_with_c" else left @ left
    return {
        str(blocks): lambda blocks=blocks: cublas.symmetric_blocked(
            left, right, C, alpha, beta, blocks
        )
        for blocks in BLOCK_COUNTS
    }


def measure_blocks(device: torch.device, repeats: int) -> list[dict]:
    rows = []
    for operation, batch, M, K in PROBLEMS:
        contenders = problem_contenders(operation, batch, M, K, device)
        timings = median_ms(contenders, device, repeats=repeats)
        best = min(timings, key=timings.get)
        rule = cublas.symmetric_block_count(M, K, batch)
        rows.append(
            {
                "operation": operation,
                "batch": batch,
                "M": M,
                "K": K,
                "median_ms": timings,
                "best_blocks": int(best),
                "rule_blocks": rule,
                "best_speedup_vs_full": timings["1"] / timings[best],
                "rule_speedup_vs_full": timings["1"] / timings[str(rule)],
            }
        )
        del contenders
        torch.cuda.empty_cache()
    return rows


def measure_square_gemm(device: torch.device, repeats: int) -> dict[str, float]:
    contenders = {}
    for dtype_name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        A, B, C = (torch.randn(4096, 4096, device=device, dtype=dtype) for _ in range(3))
        contenders[f"mm {dtype_name}"] = lambda A=A, B=B: torch.mm(A, B)
        contenders[f"addmm {dtype_name}"] = lambda A=A, B=B, C=C: torch.addmm(C, A, B, beta=0.5)
        contenders[f"mm A·Aᵀ {dtype_name}"] = lambda A=A: torch.mm(A, A.T)
    return median_ms(contenders, device, repeats=repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_record_options(parser, "default: benchmarks/results/cublas-blocks-<gpu>-<date>")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cublas_blocks needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    date = _common.utc_now()
    rows = measure_blocks(device, args.repeats)
    square = measure_square_gemm(device, args.repeats)
    gpu = _common.device_name(device)
    record = {
        "benchmark": "cublas_blocks",
        "date": _common.iso_seconds(date),
        "git_sha": _common.git_sha(args.git_sha),
        "device": gpu,
        **_common.versions(dmuon_kernels=__version__),
        "rule": {
            "MIN_BLOCKED_VOLUME": cublas.MIN_BLOCKED_VOLUME,
            "MIN_BLOCK_WIDTH": cublas.MIN_BLOCK_WIDTH,
            "MAX_SYMMETRIC_BLOCKS": cublas.MAX_SYMMETRIC_BLOCKS,
        },
        "results": rows,
        "square_gemm_4096_ms": square,
    }
    _common.write_json(args.out or _common.result_path("cublas-blocks", gpu, date), record)
    header = "".join(f"{blocks:>8}" for blocks in BLOCK_COUNTS)
    print(f"\nfp16 median ms per block count on {gpu}")
    print(f"{'operation':<18}{'batch':>6}{'M':>6}{'K':>7}{header}   best  rule  rule/full")
    for row in rows:
        cells = "".join(f"{row['median_ms'][str(b)]:>8.3f}" for b in BLOCK_COUNTS)
        print(
            f"{row['operation']:<18}{row['batch']:>6}{row['M']:>6}{row['K']:>7}{cells}"
            f"{row['best_blocks']:>7}{row['rule_blocks']:>6}{row['rule_speedup_vs_full']:>10.2f}x"
        )
    print("\n4096^3 GEMMs, median ms:")
    for name, ms in square.items():
        print(f"  {name:<22}{ms:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
