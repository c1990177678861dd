"""Host cost of the public kernel calls on a warmed shape, against the bare torch call.

For each shape A (M, K) every contender runs on the same input; three figures per contender:

- ``host_us``: the time the call takes to return, the device idle before it (synchronised
  outside the timed region) and nothing synchronised inside: what the Python dispatch, the
  operand checks and the kernel launches cost the host. Median of ``--host-repeats`` calls.
- ``call_us``: one call from its start to the end of its GPU work (synchronised after it): a
  single call with the host included, as a user sees it. Median of ``--host-repeats`` calls.
- ``device_ms``: GPU-only time per call (``dmuon_kernels.syrk.timing.median_ms``: a spin kernel
  hides the host, CUDA events, contenders interleaved).

Contenders: ``a @ a.mT`` (cuBLAS, the baseline), ``syrk`` (kernel auto) and ``syrk cublas``
(dispatch around the same torch product), ``syrk quack`` and ``syrk cute`` where they can run,
and ``syrk quack (custom op)``, quack through its public entry and torch's custom-op dispatch,
which the adapter skips where it can (``dmuon_kernels.syrk.quack``, [Note: host cost of a quack
call]);
``torch.mm(S, B)``, ``symmetric_product`` (auto) and ``symmetric_product quack``/``cute`` on
the M x M Gram-sized square; Newton-Schulz on an fp32 G (M, K): the ``newton_schulz()``
function, a reused ``NewtonSchulz()`` instance, and torch.optim.Muon's own iteration (Keller's
coefficients, bf16). The first call of each contender (autotune, compilation, CUDA-graph capture
happen there) is recorded as ``first_call_s``. The summary prints, per shape, syrk's host cost
against ``a @ a.mT`` and the function against the instance (issue 15 targets: <= 30 us per call;
the function within 1.1x of the instance).

``--host-profile N`` then runs N more warmed calls of each contender under cProfile (the device
idle before each, nothing synchronised while profiling) and records, as ``host_profile``, the 12
functions with the most own time per call (``benchmarks/_host_profile.py``), printed per shape
and contender after the summary.

On a machine without CUDA the same runs on the CPU with smaller shapes (``host_us`` then
includes the computation, ``device_ms`` is host time): a smoke test of the script.

Usage (repository root, packages importable)::

    python benchmarks/kernels/bench_dispatch.py                    # JSON: benchmarks/results/dispatch-<gpu>-<date>.json
    python benchmarks/kernels/bench_dispatch.py --out "$OUT/dispatch.json" --git-sha <sha>
    python benchmarks/kernels/bench_dispatch.py --shapes 256x256 1024x4096 --host-repeats 100
    python benchmarks/kernels/bench_dispatch.py --shapes 2048x2048 --host-profile 50
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
from torch.optim import _muon as torch_muon

from benchmarks import (
    _common,
    _host_profile,
)
from dmuon_kernels import NewtonSchulz, __version__, get_backend_status, newton_schulz
from dmuon_kernels.syrk import backend_availability, resolve_kernel, symmetric_product, syrk
from dmuon_kernels.syrk import quack as quack_backend
from dmuon_kernels.syrk.timing import median_ms

CUDA_SHAPES = [(256, 256), (512, 512), (1024, 1024), (2048, 2048), (4096, 4096), (1024, 4096)]
CPU_SHAPES = [(32, 32), (64, 64), (128, 128), (64, 256)]
SYRK_BASELINE, SYRK_AUTO, SYRK_CUBLAS = "a @ a.mT", "syrk", "syrk cublas"
SYRK_QUACK_CUSTOM_OP = "syrk quack (custom op)"
PRODUCT_BASELINE, PRODUCT_AUTO = "torch.mm(S, B)", "symmetric_product"
NS_FUNCTION, NS_INSTANCE, NS_TORCH = "newton_schulz()", "NewtonSchulz instance", "torch Muon NS"
TABLE_COLUMNS = 5  # contenders per printed table
HOST_TARGET_US = 30.0
FUNCTION_TARGET_RATIO = 1.1
HOST_PROFILE_TOP = 12  # functions kept per contender, by own time


def contenders(
    M: int, K: int, device: torch.device, dtype: torch.dtype, generator: torch.Generator
) -> dict[str, Callable[[], object]]:
    """Contender name -> zero-argument call, all on inputs of this shape."""
    A = torch.randn(M, K, device=device, generator=generator).mul_(K**-0.25).to(dtype)
    S = torch.randn(M, M, device=device, generator=generator).mul_(M**-0.25)
    S = (S + S.mT) / 2
    B = 0.5 * S + 0.1 * (S @ S)  # a polynomial in S: S·B is symmetric
    B = ((B + B.mT) / 2).to(dtype)  # exactly symmetric: the CuTe kernel reads B's transpose
    S = S.to(dtype)
    G = torch.randn(M, K, device=device, generator=generator)
    instance = NewtonSchulz()
    keller = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    # Each fast backend on its own (where it can run), whatever "auto" resolves to.
    runnable = [
        name
        for name in ("quack", "cute")
        if device.type == "cuda" and backend_availability(name)[0]
    ]
    fast = {f"syrk {name}": (lambda name=name: syrk(A, kernel=name)) for name in runnable}
    if "quack" in runnable:
        fast[SYRK_QUACK_CUSTOM_OP] = quack_through_custom_op(A)
    fast_products = {
        f"symmetric_product {name}": (lambda name=name: symmetric_product(S, B, kernel=name))
        for name in runnable
    }
    return {
        SYRK_BASELINE: lambda: A @ A.mT,
        SYRK_AUTO: lambda: syrk(A),
        SYRK_CUBLAS: lambda: syrk(A, kernel="cublas"),
        **fast,
        PRODUCT_BASELINE: lambda: torch.mm(S, B),
        PRODUCT_AUTO: lambda: symmetric_product(S, B),
        **fast_products,
        NS_FUNCTION: lambda: newton_schulz(G),
        NS_INSTANCE: lambda: instance(G),
        NS_TORCH: lambda: torch_muon._zeropower_via_newtonschulz(
            G, keller, torch_muon.DEFAULT_NS_STEPS, torch_muon.EPS
        ),
    }


def quack_through_custom_op(A: torch.Tensor) -> Callable[[], object]:
    """``syrk(A)`` on quack as its public entry runs it (torch's custom-op dispatch included)."""
    api = quack_backend._quack_api()
    public = dataclasses.replace(api, symmetric_launcher=None)

    def call() -> object:
        saved, quack_backend._probe_result = quack_backend._probe_result, public
        try:
            return quack_backend.syrk(A)
        finally:
            quack_backend._probe_result = saved

    return call


def first_call_s(fn: Callable[[], object], device: torch.device) -> float:
    _common.synchronize(device)
    start = time.perf_counter()
    fn()
    _common.synchronize(device)
    return time.perf_counter() - start


def host_and_call_us(
    fn: Callable[[], object], device: torch.device, repeats: int
) -> tuple[float, float]:
    """Medians of (return time, start-to-GPU-done time) of single calls, device idle before."""
    host, call = [], []
    for _ in range(repeats):
        _common.synchronize(device)
        start = time.perf_counter()
        fn()
        returned = time.perf_counter()
        _common.synchronize(device)
        done = time.perf_counter()
        host.append((returned - start) * 1e6)
        call.append((done - start) * 1e6)
    return statistics.median(host), statistics.median(call)


def measure_shape(
    M: int, K: int, device: torch.device, dtype: torch.dtype, args: argparse.Namespace
) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)
    calls = contenders(M, K, device, dtype, generator)
    row: dict = {"shape": [M, K], "dtype": str(dtype).removeprefix("torch."), "contenders": {}}
    for name, fn in calls.items():
        first = first_call_s(fn, device)
        for _ in range(args.warmup):  # the second call captures CUDA graphs; then replays
            fn()
        _common.synchronize(device)
        host_us, call_us = host_and_call_us(fn, device, args.host_repeats)
        row["contenders"][name] = {"first_call_s": first, "host_us": host_us, "call_us": call_us}
        if args.host_profile > 0:
            stats, _ = _host_profile.profile_calls(fn, device, args.host_profile)
            row["contenders"][name]["host_profile"] = _host_profile.top_functions(
                stats, args.host_profile, _host_profile.OWN_TIME, HOST_PROFILE_TOP
            )
    device_ms = median_ms(calls, device, repeats=args.device_repeats)
    for name, ms in device_ms.items():
        row["contenders"][name]["device_ms"] = ms
    A = torch.empty(M, K, device=device, dtype=dtype)
    row["syrk_auto_resolves_to"] = resolve_kernel("auto", A)
    row["symmetric_product_auto_resolves_to"] = resolve_kernel(
        "auto", torch.empty(M, M, device=device, dtype=dtype), op="symmetric_product"
    )
    found = row["contenders"]
    row["syrk_host_over_matmul"] = found[SYRK_AUTO]["host_us"] / found[SYRK_BASELINE]["host_us"]
    row["function_over_instance_call"] = (
        found[NS_FUNCTION]["call_us"] / found[NS_INSTANCE]["call_us"]
    )
    row["function_over_instance_host"] = (
        found[NS_FUNCTION]["host_us"] / found[NS_INSTANCE]["host_us"]
    )
    return row


def format_table(rows: Sequence[dict], names: Sequence[str]) -> str:
    """One column per contender: host us / call us / device ms."""
    width = 27
    lines = [
        f"{'shape':>10} " + "".join(f"{name:>{width}}" for name in names),
        f"{'':>10} " + "".join(f"{'host us/call us/dev ms':>{width}}" for _ in names),
    ]
    for row in rows:
        cells = "".join(
            f"{found['host_us']:>10.1f}/{found['call_us']:>7.0f}/{found['device_ms']:>7.3f}"
            for found in (row["contenders"][name] for name in names)
        )
        lines.append(f"{'x'.join(map(str, row['shape'])):>10} {cells}")
    return "\n".join(lines)


def summary(rows: Sequence[dict]) -> str:
    lines = [
        f"targets: syrk/symmetric_product/newton_schulz() host <= {HOST_TARGET_US:g} us; "
        f"newton_schulz() within {FUNCTION_TARGET_RATIO}x of the instance"
    ]
    for row in rows:
        found = row["contenders"]
        shape = "x".join(map(str, row["shape"]))
        lines.append(
            f"{shape:>10}: syrk host {found[SYRK_AUTO]['host_us']:.1f} us "
            f"({row['syrk_auto_resolves_to']}) vs a @ a.mT {found[SYRK_BASELINE]['host_us']:.1f} us; "
            f"symmetric_product host {found[PRODUCT_AUTO]['host_us']:.1f} us; "
            f"newton_schulz() host {found[NS_FUNCTION]['host_us']:.1f} us; "
            f"function/instance call {row['function_over_instance_call']:.2f}x"
        )
    return "\n".join(lines)


def host_profile_tables(rows: Sequence[dict], calls: int) -> str:
    """Per shape and contender, the functions with the most own host time per call."""
    return "\n".join(
        _host_profile.format_rows(
            found["host_profile"],
            f"{'x'.join(map(str, row['shape']))} {name}: host profile, per call "
            f"(cProfile over {calls} calls; unprofiled host {found['host_us']:.1f} us)",
        )
        for row in rows
        for name, found in row["contenders"].items()
    )


def parse_shape(text: str) -> tuple[int, int]:
    rows, _, cols = text.partition("x")
    return int(rows), int(cols or rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                        help="MxK shapes (default: 256² to 4096² and 1024x4096 on CUDA)")  # fmt: skip
    parser.add_argument("--host-repeats", type=int, default=200, help="timed single calls")
    parser.add_argument("--device-repeats", type=int, default=15, help="GPU-only regions")
    parser.add_argument("--warmup", type=int, default=5, help="calls after the first, untimed")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also profile N warmed calls per contender with cProfile (0: off)")  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available")  # fmt: skip
    _common.add_record_options(parser, "default: benchmarks/results/dispatch-<gpu>-<date>.json")
    args = parser.parse_args(argv)
    if args.host_profile < 0:
        parser.error(f"--host-profile {args.host_profile}: give a number of calls, or 0 for none")
    use_cuda = torch.cuda.is_available() if args.device is None else args.device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        print("bench_dispatch: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    # fp16 is what Newton-Schulz iterates in on CUDA; CPUs run fp32 (fp16 matmuls crawl there)
    dtype = torch.float16 if use_cuda else torch.float32
    shapes = args.shapes or (CUDA_SHAPES if use_cuda else CPU_SHAPES)
    date = _common.utc_now()
    label = _common.device_name(device)
    rows = []
    started = time.perf_counter()
    for M, K in shapes:
        print(f"bench_dispatch: {M}x{K} ...", flush=True)
        rows.append(measure_shape(M, K, device, dtype, args))
    names = list(rows[0]["contenders"])
    print(f"Host cost of warmed calls on {label} ({str(dtype).removeprefix('torch.')} operands)")
    for first in range(0, len(names), TABLE_COLUMNS):
        print(format_table(rows, names[first : first + TABLE_COLUMNS]))
    print(summary(rows))
    if args.host_profile > 0:
        print(host_profile_tables(rows, args.host_profile))
    record = {
        "benchmark": "dispatch",
        "date": _common.iso_seconds(date),
        "git_sha": _common.git_sha(args.git_sha),
        "device": label,
        "compute_capability": list(torch.cuda.get_device_capability(device)) if use_cuda else None,
        "versions": _common.versions(
            **{"dmuon-kernels": __version__},
            **_common.installed("quack-kernels", "nvidia-cutlass-dsl", "triton"),
        ),
        "backend_status": get_backend_status(),
        "environment": _common.dmuon_environment(),
        "inputs": {
            "shapes": [list(shape) for shape in shapes],
            "dtype": str(dtype).removeprefix("torch."),
            "host_repeats": args.host_repeats,
            "device_repeats": args.device_repeats,
            "warmup": args.warmup,
            "host_profile_calls": args.host_profile,
            "torch_threads": torch.get_num_threads(),
            "pid": os.getpid(),
        },
        "targets": {"host_us": HOST_TARGET_US, "function_over_instance": FUNCTION_TARGET_RATIO},
        "rows": rows,
        "wall_s": time.perf_counter() - started,
    }
    out = args.out or _common.result_path("dispatch", label, date)
    _common.write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
