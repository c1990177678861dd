"""Parallel compilation: do Triton and quack (CuTe DSL) compile faster in threads than one by one?

A first step on a fresh machine pays for its kernels' compiles one after the other (about 0.5 s
per Triton specialisation, about 3.3 s per quack variant on the H200). Compiling them in
threads shortens that only if the compilers release the GIL for most of their work (MLIR passes,
LLVM, ptxas). This measures it: each mode runs in a fresh process with empty caches
(``TRITON_CACHE_DIR``, ``QUACK_CACHE_DIR``, ``CUTE_DSL_CACHE_DIR``, ``DMUON_CACHE_DIR``), imports
everything first, then times the same set of first uses (each compiles one kernel variant) run
one after the other (``serial``) or each in its own thread (``threads``).

The jobs are the variants a dense model's first step compiles: the fused step's Triton kernels
(momentum with each output mode and layout, normalisation scaled and not, the update applied
from a row-major and a transposed update, the sum of squares) and quack's symmetric GEMM (A·Aᵀ
from a row-major and a transposed A, and A·A + C with scalars).

Usage (GPU machine, repository root, package sources on PYTHONPATH)::

    python benchmarks/kernels/bench_parallel_compile.py --out "$OUT/parallel-compile.json"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

MODES = ("serial", "threads")
FAMILIES = ("triton", "quack", "both")
RESULT_PREFIX = "parallel-compile-result "


def triton_jobs(device):
    """First uses of the fused step's Triton kernels, one specialisation each."""
    import torch

    from dmuon_kernels import _fused_triton as k

    rows, cols, batch = 1024, 2816, 2
    grads = [torch.randn(rows, cols, device=device, dtype=torch.bfloat16) for _ in range(batch)]

    def buffers():
        return [torch.zeros(rows, cols, device=device) for _ in range(batch)]

    def out_rows():
        return torch.empty(batch, rows, cols, device=device, dtype=torch.bfloat16)

    def out_transposed():
        return torch.empty(batch, cols, rows, device=device, dtype=torch.bfloat16).mT

    src = torch.randn(batch, rows, cols, device=device, dtype=torch.bfloat16)
    square = torch.ones(batch, device=device, dtype=torch.float64)
    exponents = torch.zeros(batch, k.tile_count(rows, cols), device=device, dtype=torch.int32)
    first = [True] * batch
    return [
        lambda: k.momentum_pass(grads, buffers(), first, 0.95, False, None, False),
        lambda: k.momentum_pass(grads, buffers(), first, 0.95, True, out_rows(), True),
        lambda: k.momentum_pass(grads, buffers(), first, 0.95, True, out_transposed(), True),
        lambda: k.normalize(src, out_rows(), square, 1e-7, exponents),
        lambda: k.normalize(src, out_transposed(), square, 1e-7),
        lambda: k.apply_update(buffers(), list(src), 0.99, 0.02),
        lambda: k.apply_update(buffers(), list(out_transposed()), 0.99, 0.02),
        lambda: k.square_sums(src),
    ]


def quack_jobs(device):
    """First uses of quack's symmetric GEMM, one kernel variant each."""
    import torch

    from dmuon_kernels.syrk import quack

    A = torch.randn(2, 1024, 2816, device=device, dtype=torch.bfloat16)
    tall = torch.randn(2, 2816, 1024, device=device, dtype=torch.bfloat16)
    G = torch.randn(2, 1024, 1024, device=device, dtype=torch.bfloat16)
    G = G + G.mT
    return [
        lambda: quack.syrk(A),
        lambda: quack.syrk(tall.mT),
        lambda: quack.symmetric_product(G, G, C=G, alpha=2.0, beta=-1.5),
    ]


def child(family: str, mode: str) -> dict:
    import torch
    import triton  # noqa: F401 (imported before the clock starts)

    from dmuon_kernels.syrk import quack

    device = torch.device("cuda")
    torch.ones(1, device=device).sum().item()  # the CUDA context, outside the clock
    ok, why = quack.is_available()  # imports quack and cutlass-dsl, outside the clock
    if family != "triton" and not ok:
        raise SystemExit(f"quack unavailable: {why}")
    jobs = []
    if family in ("triton", "both"):
        jobs += triton_jobs(device)
    if family in ("quack", "both"):
        jobs += quack_jobs(device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    cpu_started = time.process_time()
    if mode == "serial":
        for job in jobs:
            job()
    else:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            for future in [pool.submit(job) for job in jobs]:
                future.result()
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    # The same jobs again: every kernel is compiled now, so this is launch cost alone.
    again = time.perf_counter()
    for job in jobs:
        job()
    torch.cuda.synchronize()
    return {
        "jobs": len(jobs),
        "wall_s": wall,
        "process_cpu_s": cpu,
        "warm_wall_s": time.perf_counter() - again,
        "cpu_count": os.cpu_count(),
    }


def run_fresh(family: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="parallel-compile-") as folder:
        env = dict(os.environ)
        for name in (
            "TRITON_CACHE_DIR",
            "QUACK_CACHE_DIR",
            "CUTE_DSL_CACHE_DIR",
            "DMUON_CACHE_DIR",
        ):
            env[name] = os.path.join(folder, name.lower())
            os.makedirs(env[name], mode=0o700)
        command = [sys.executable, __file__, "--child", family, mode]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            return {"error": (done.stdout + done.stderr)[-3000:]}
        line = next(x for x in done.stdout.splitlines() if x.startswith(RESULT_PREFIX))
        return json.loads(line[len(RESULT_PREFIX) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    _common.add_record_options(parser)
    parser.add_argument("--child", nargs=2, metavar=("FAMILY", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT_PREFIX + json.dumps(child(*args.child)), flush=True)
        return
    results = {}
    for family in args.families:
        for mode in MODES:
            results[f"{family}/{mode}"] = result = run_fresh(family, mode)
            print(family, mode, json.dumps(result)[:300], flush=True)
    import torch

    record = {
        "benchmark": "bench_parallel_compile",
        "device": _common.device_name(torch.device("cuda")),
        "versions": _common.versions(
            **_common.installed("quack-kernels", "nvidia-cutlass-dsl", "triton")
        ),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(_common.utc_now()),
        "results": results,
    }
    print(f"{'family':8} {'mode':8} {'jobs':>4} {'wall s':>8} {'cpu s':>8} {'warm s':>8}")
    for key, r in results.items():
        family, mode = key.split("/")
        if "error" in r:
            print(f"{family:8} {mode:8} error")
            continue
        print(
            f"{family:8} {mode:8} {r['jobs']:>4} {r['wall_s']:>8.2f} {r['process_cpu_s']:>8.2f} "
            f"{r['warm_wall_s']:>8.3f}"
        )
    if args.out:
        _common.write_json(args.out, record)


if __name__ == "__main__":
    main()
