"""SYRK speed of the CuTe DSL kernel, per tile configuration, against cuBLAS (and quack).

For each dtype and shape A (M, K): ``cublas`` is ``a @ a.T`` (the full product), ``quack`` its
symmetric GEMM (when available), and one column per ``syrk.cute.TILE_CONFIGS`` entry that runs on
this GPU (``--configs`` picks some; "sm90_*" ones need compute capability 9.x) plus ``cute`` (the
path and configuration the adapter picks). Timing is ``syrk.timing.median_ms`` (GPU-only,
interleaved, median). Each cute configuration's relative error against an fp32 product is
recorded next to cuBLAS's. ``triangle_tflops`` divides the M·(M+1)·K flops of one triangle by
each column's time (so cuBLAS, which computes both triangles, really runs at twice its figure).

Each SM90 tiling exists with three epilogues: "<name>" (direct stores), "<name>_smem_flat" and
"<name>_smem" (staged in a plain or a swizzled shared-memory buffer, TMA stores); name them in
``--configs`` to time them side by side, and ``--shapes`` to time only some shapes.

``--smoke`` first runs every chosen configuration once on a few small shapes and compares it
with cuBLAS (exit 1 on a mismatch), so a broken kernel costs seconds, not the whole table.

Usage (repository root, packages on PYTHONPATH)::

    python benchmarks/kernels/bench_cute.py [--out cute.json] [--dtypes float16 bfloat16] [--no-quack]
        [--configs sm90_128x128 128x128_4warps] [--shapes 4096x4096 8192x8192] [--batch 8]
        [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from benchmarks import _common
from dmuon_kernels.syrk import backend_availability, get_backend
from dmuon_kernels.syrk import cute as cute_backend
from dmuon_kernels.syrk.timing import median_ms

SHAPES = [(1024, 4096), (4096, 4096), (4096, 14336), (8192, 8192), (8192, 28672)]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference).norm() / reference.norm())


def parse_shape(text: str) -> tuple[int, int]:
    """ "4096x14336" -> (4096, 14336)."""
    try:
        M, K = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is MxK, like 4096x14336; got {text!r}") from None
    return M, K


def runnable_configs(requested: Sequence[str] | None) -> list[str]:
    """The requested (default: all) tile configurations whose path runs on this GPU."""
    path = cute_backend.kernel_path(torch.device("cuda", torch.cuda.current_device()))
    names = list(requested) if requested else list(cute_backend.TILE_CONFIGS)
    return [n for n in names if cute_backend.TILE_CONFIGS[n].path in (path, cute_backend.SM80)]


def smoke(configs: Sequence[str]) -> bool:
    """Each configuration once per small shape against cuBLAS; prints and returns success."""
    ok = True
    for name in configs:
        for M, K in ((300, 200), (1100, 72), (2048, 515), (4100, 136)):
            for dtype in DTYPES.values():
                generator = torch.Generator(device="cuda").manual_seed(M * K)
                A = torch.randn(M, K, device="cuda", generator=generator).to(dtype)
                expected = (A.float() @ A.float().T).to(dtype)
                out = cute_backend.syrk(A, None, 1.0, 0.0, config=name)
                torch.cuda.synchronize()
                error = relative_error(out, expected.float())
                good = error < 1e-2 and bool(torch.equal(out, out.T))
                ok &= good
                print(f"smoke {name} {M}x{K} {dtype}: error {error:.1e} {'ok' if good else 'BAD'}")
    return ok


def measure(
    M: int, K: int, dtype: torch.dtype, *, quack: bool, repeats: int, configs: Sequence[str],
    batch: int = 1,
) -> dict:  # fmt: skip
    generator = torch.Generator(device="cuda").manual_seed(M + K)
    lead = (batch,) if batch > 1 else ()
    A = torch.randn(*lead, M, K, device="cuda", generator=generator).mul_(K**-0.25).to(dtype)
    columns = {"cublas": lambda: A @ A.mT}
    if quack and backend_availability("quack")[0]:
        quack_backend = get_backend("quack")
        columns["quack"] = lambda: quack_backend.syrk(A, None, 1.0, 0.0)
    for name in configs:
        columns[f"cute[{name}]"] = lambda n=name: cute_backend.syrk(A, None, 1.0, 0.0, config=n)
    columns["cute"] = lambda: cute_backend.syrk(A, None, 1.0, 0.0)

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    reference = A.float() @ A.float().mT
    torch.set_float32_matmul_precision(previous)
    errors, compile_s = {}, {}
    for name, fn in columns.items():
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        compile_s[name] = time.perf_counter() - start
        errors[name] = relative_error(out, reference)
        del out
    del reference
    timings = median_ms(columns, torch.device("cuda"), repeats=repeats)
    flops = batch * M * (M + 1) * K  # one triangle: M(M+1)/2 dot products of 2K flops
    return {
        "shape": [M, K],
        "batch": batch,
        "dtype": str(dtype).removeprefix("torch."),
        "shape_class": cute_backend.shape_class(M, batch, A.device),
        "cute_config": cute_backend.choose_config(M, batch, A.device),
        "median_ms": timings,
        "speedup_vs_cublas": {n: timings["cublas"] / ms for n, ms in timings.items()},
        "triangle_tflops": {n: flops / ms / 1e9 for n, ms in timings.items()},
        "relative_error_vs_fp32": errors,
        "first_call_s": compile_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_record_options(parser, "default: benchmarks/results/syrk-<gpu>-cute-<date>.json")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--no-quack", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--configs", nargs="+", choices=list(cute_backend.TILE_CONFIGS))
    parser.add_argument(
        "--shapes", nargs="+", type=parse_shape, help="MxK shapes (default: the standard set)"
    )
    parser.add_argument("--batch", type=int, default=1, help="matrices per call (default 1)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cute: needs a CUDA device", file=sys.stderr)
        return 2
    available, reason = backend_availability("cute")
    if not available:
        print(f"bench_cute: cute unavailable: {reason}", file=sys.stderr)
        return 2
    configs = runnable_configs(args.configs)
    if args.smoke:
        return 0 if smoke(configs) else 1
    date = _common.utc_now()
    rows = []
    for dtype_name in args.dtypes:
        for M, K in args.shapes or SHAPES:
            row = measure(
                M,
                K,
                DTYPES[dtype_name],
                quack=not args.no_quack,
                repeats=args.repeats,
                configs=configs,
                batch=args.batch,
            )
            rows.append(row)
            cells = "  ".join(
                f"{n} {ms:.3f}ms ({row['speedup_vs_cublas'][n]:.2f}x, "
                f"err {row['relative_error_vs_fp32'][n]:.1e})"
                for n, ms in row["median_ms"].items()
            )
            label = f"{args.batch}x{M}x{K}" if args.batch > 1 else f"{M}x{K}"
            print(f"{dtype_name} {label} [{row['cute_config']}]: {cells}", flush=True)
    gpu = _common.device_name(torch.device("cuda"))
    record = {
        "benchmark": "syrk-cute",
        "date": _common.iso_seconds(date),
        "git_sha": _common.git_sha(args.git_sha),
        "device": gpu,
        "compute_capability": list(torch.cuda.get_device_capability()),
        "versions": _common.versions(**_common.installed("nvidia-cutlass-dsl", "quack-kernels")),
        "tile_configs": {n: str(cute_backend.TILE_CONFIGS[n]) for n in configs},
        "cute_path": cute_backend.kernel_path(torch.device("cuda", torch.cuda.current_device())),
        "timing": "GPU-only (spin kernel ahead of each region), CUDA events, interleaved, median",
        "syrk": rows,
    }
    _common.write_json(args.out or _common.result_path("syrk", gpu, date, "cute"), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
