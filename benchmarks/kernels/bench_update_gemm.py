"""The Muon update's last product with the forward weight as a second output: Triton against cuBLAS.

For each master shape of the Llama-3-8B stack ``bench_step`` uses and of the 0.89 B Llama of
``bench_e2e`` (wide masters take L·X, tall ones Xᵀ·Lᵀ), this times, GPU-only, interleaved, median
(``syrk.timing.median_ms``):

- ``cublas``: ``addmm`` into the fp32 master (the update epilogue without a copy), the floor;
- ``cublas + copy``: the same, then the bf16 copy of the master (what the step does with
  ``DMUON_UPDATE_GEMM=cublas``);
- ``triton <tiles>``: ``dmuon_kernels._update_gemm_triton.update_gemm_`` writing master and copy
  from one epilogue, for each candidate tile configuration.

It checks each Triton result against the cuBLAS one (master within 1e-5 relative of the float64
update, copy equal to the master rounded) and prints, per shape, the best Triton time over
``cublas + copy``. The default tiles (``DEFAULT_TILES``) are the configuration that wins most.

Usage (repository root, dmuon-kernels on PYTHONPATH, a CUDA GPU with Triton)::

    python benchmarks/kernels/bench_update_gemm.py --out update-gemm.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from benchmarks import _common
from dmuon_kernels import __version__
from dmuon_kernels._update_gemm_triton import DEFAULT_TILES, TileConfig, update_gemm_
from dmuon_kernels.syrk.timing import median_ms

# (name, rows, cols, count in its stack): masters as the model holds them.
SHAPES = [
    ("llama3-8b q/o", 4096, 4096, 8),
    ("llama3-8b k/v", 1024, 4096, 8),
    ("llama3-8b gate/up", 14336, 4096, 8),
    ("llama3-8b down", 4096, 14336, 4),
    ("0.89b q/o", 2048, 2048, 32),
    ("0.89b k/v", 1024, 2048, 32),
    ("0.89b gate/up", 5632, 2048, 32),
    ("0.89b down", 2048, 5632, 16),
]
CANDIDATES = [
    DEFAULT_TILES,
    TileConfig(128, 256, 64, 8, 8, 3),
    TileConfig(256, 128, 64, 8, 8, 3),
    TileConfig(128, 128, 64, 8, 4, 4),
    TileConfig(128, 128, 64, 8, 8, 3),
    TileConfig(64, 256, 64, 8, 4, 4),
]
DECAY, STEP = 0.999, 0.01


def label(tiles: TileConfig) -> str:
    return f"triton {tiles.block_m}x{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}"


def operands(rows: int, cols: int, device: torch.device):
    n, m = min(rows, cols), max(rows, cols)
    generator = torch.Generator(device=device).manual_seed(rows * cols)
    left = (torch.randn(n, n, device=device, generator=generator) / n**0.5).half()
    X = (torch.randn(n, m, device=device, generator=generator) / m**0.5).half()
    first, second = (left, X) if rows <= cols else (X.mT, left.mT)
    master = torch.randn(rows, cols, device=device, generator=generator) * 0.02
    return first, second, master


def check(first, second, master, tiles: TileConfig) -> dict:
    expected = DECAY * master.double() - STEP * (first.double() @ second.double())
    ours, copy = master.clone(), torch.empty_like(master, dtype=torch.bfloat16)
    update_gemm_(first, second, ours, copy, decay=DECAY, step=STEP, tiles=tiles)
    error = ((ours.double() - expected).norm() / expected.norm()).item()
    return {"relative_error": error, "copy_exact": bool(torch.equal(copy, ours.to(copy.dtype)))}


def measure_shape(rows: int, cols: int, device: torch.device, repeats: int) -> dict:
    first, second, master = operands(rows, cols, device)
    copy = torch.empty_like(master, dtype=torch.bfloat16)

    def cublas():
        torch.addmm(master, first, second, out_dtype=torch.float32, beta=DECAY, alpha=-STEP,
                    out=master)  # fmt: skip

    def cublas_and_copy():
        cublas()
        copy.copy_(master)

    contenders = {"cublas": cublas, "cublas + copy": cublas_and_copy}
    checks = {}
    for tiles in CANDIDATES:
        checks[label(tiles)] = check(first, second, master, tiles)
        contenders[label(tiles)] = lambda tiles=tiles: update_gemm_(
            first, second, master, copy, decay=DECAY, step=STEP, tiles=tiles
        )
    timings = median_ms(contenders, device, repeats=repeats)
    best = min((k for k in timings if k.startswith("triton")), key=timings.get)
    return {
        "median_ms": timings, "checks": checks, "best_triton": best,
        "default_over_cublas_copy": timings[label(DEFAULT_TILES)] / timings["cublas + copy"],
        "best_over_cublas_copy": timings[best] / timings["cublas + copy"],
    }  # fmt: skip


def measure(device: torch.device, repeats: int) -> list[dict]:
    rows_out = []
    for name, rows, cols, count in SHAPES:
        result = measure_shape(rows, cols, device, repeats)
        rows_out.append({"shape": name, "rows": rows, "cols": cols, "count": count, **result})
        torch.cuda.empty_cache()
    return rows_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_record_options(parser, "default: benchmarks/results/update-gemm-<gpu>-<date>")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_update_gemm needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    date = _common.utc_now()
    rows = measure(device, args.repeats)
    gpu = _common.device_name(device)
    keys = ("cublas", "cublas + copy", label(DEFAULT_TILES))
    stacks = {
        stack: {
            key: sum(r["median_ms"][key] * r["count"] for r in rows if r["shape"].startswith(stack))
            for key in keys
        }
        for stack in ("llama3-8b", "0.89b")
    }
    record = {
        "benchmark": "update_gemm",
        "date": _common.iso_seconds(date),
        "git_sha": _common.git_sha(args.git_sha),
        "device": gpu,
        **_common.versions(dmuon_kernels=__version__, triton=_common.installed("triton")["triton"]),
        "default_tiles": DEFAULT_TILES._asdict(),
        "results": rows,
        "stack_ms": stacks,
    }
    _common.write_json(args.out or _common.result_path("update-gemm", gpu, date), record)
    print(f"\nmedian ms per master on {gpu} (fp16 factors, fp32 master, bf16 copy)")
    print(f"{'shape':<20}{'cublas':>9}{'+copy':>9}{'default':>9}{'best':>9}  best tiles / ok")
    for row in rows:
        t = row["median_ms"]
        ok = all(c["relative_error"] < 1e-5 and c["copy_exact"] for c in row["checks"].values())
        print(
            f"{row['shape']:<20}{t['cublas']:>9.3f}{t['cublas + copy']:>9.3f}"
            f"{t[label(DEFAULT_TILES)]:>9.3f}{t[row['best_triton']]:>9.3f}  "
            f"{row['best_triton']} / {'ok' if ok else 'MISMATCH'}"
        )
    for stack, times in stacks.items():
        print(f"whole {stack} stack, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
