"""One-GPU optimizer step benchmark: fused AdamW, torch.optim.Muon and dmuon.Muon on one stack.

The stack is 4 layers of Llama-3-8B-shaped projection matrices (per layer q 4096x4096,
k 1024x4096, v 1024x4096, o 4096x4096, gate 14336x4096, up 14336x4096, down 4096x14336):
28 matrices, 0.87 B parameters, fp32 weights. Every optimizer gets the same random gradients
(set once; ``step()`` does not clear them) and is timed on ``step()`` alone:

- ``torch.optim.AdamW(fused=True)``;
- ``torch.optim.Muon`` with its defaults except ``adjust_lr_fn="match_rms_adamw"``;
- ``dmuon.Muon`` at world size 1 (``dedicate_params(model, None, ...)``, no torch.distributed),
  with its default Newton-Schulz (gram, kernel auto), the same with the update applied from the
  written-out Newton-Schulz output (``DMUON_UPDATE_EPILOGUE=0``; by default the last product
  writes it: [Note: the update epilogue] in ``dmuon_kernels.update_epilogue``), and with
  ``NewtonSchulz(kernel="cublas")``.
  Gradients go straight onto the fp32 masters, as the end of backward leaves them.

Each step is bounded by ``torch.cuda.synchronize()`` on both sides; the table reports the median
wall time over the timed steps after the warm-up steps (the first warm-up step of dmuon with
kernel auto includes the per-shape SYRK autotune). CUDA-event times are recorded in the JSON,
and so is each step's host time (from entering ``step()`` to its return, the device idle before,
nothing synchronised inside) and its device-only time (``median_ms``: a spin kernel ahead of the
step lets the host enqueue all of it first), so the synchronised time minus the device-only one is
the device idleness the host causes.

``--host-profile`` then runs one more warmed ``step()`` of each optimizer under cProfile and
records its host time (entry to return, profiled) and the 15 functions with the most own and
the most cumulative time (``benchmarks/_host_profile.py``), printed after the summary.

Usage (on the GPU machine, from the repository root, packages on PYTHONPATH)::

    python benchmarks/step/bench_step.py                       # JSON: benchmarks/results/step-<gpu>-<date>.json
    python benchmarks/step/bench_step.py --git-sha <sha> --out results.json
    python benchmarks/step/bench_step.py --quick               # tiny shapes on CPU: a smoke test
    python benchmarks/step/bench_step.py --host-profile        # and where step()'s host time goes

The FLOP floor is the Gram Newton-Schulz cost of the stack (6·n²·m + 14·n³ per n x m matrix,
n <= m) at 740 TFLOP/s, the H200's measured dense fp16/bf16 GEMM rate (about 55 ms).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
from torch import nn

from benchmarks import (
    _common,
    _host_profile,
)
from benchmarks.step import _step_anatomy
from dmuon_kernels._env import UPDATE_EPILOGUE_ENV
from dmuon_kernels.syrk.timing import median_ms

LLAMA3_8B_LAYER: dict[str, tuple[int, int]] = {  # name -> (out_features, in_features)
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}
QUICK_SHAPE_DIVISOR = 32  # --quick: every dimension / 32 (q 128x128, gate 448x128, ...)
NUM_LAYERS = 4
PEAK_TFLOPS = 740.0  # H200 dense fp16/bf16 GEMM, measured (shared/gpu/README.md)
REFERENCE_FLOOR_MS = 55.0  # the Gram NS floor quoted for this stack
HOST_PROFILE_TOP = 15  # functions kept per order (own, cumulative) by --host-profile
KERNEL_ROWS_KEPT = 30  # --profile: the largest kernels printed and recorded


class ProjectionStack(nn.Module):
    """``layers.N.<name>.weight`` for every projection: what partition and boundaries expect."""

    def __init__(self, layer_shapes: dict[str, tuple[int, int]], num_layers: int, device) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(num_layers):
            layer = nn.Module()
            for name, (out_features, in_features) in layer_shapes.items():
                setattr(
                    layer, name, nn.Linear(in_features, out_features, bias=False, device=device)
                )
            self.layers.append(layer)


def random_gradients(shapes: list[tuple[int, int]], device, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, device=device, generator=generator) for shape in shapes]


# ---- timing -------------------------------------------------------------------------------------


def time_steps(step: Callable[[], object], device: torch.device, warmup: int, iters: int) -> dict:
    """Wall time of each ``step()``, bounded by device synchronisation; plus CUDA-event times and
    the host time until ``step()`` returns."""
    for _ in range(warmup):
        step()
    _common.synchronize(device)
    wall_ms, event_ms, host_ms = [], [], []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _common.synchronize(device)
        started = time.perf_counter()
        if device.type == "cuda":
            start.record()
        step()
        returned = time.perf_counter()
        if device.type == "cuda":
            end.record()
        _common.synchronize(device)
        wall_ms.append((time.perf_counter() - started) * 1e3)
        host_ms.append((returned - started) * 1e3)
        if device.type == "cuda":
            event_ms.append(start.elapsed_time(end))
    # The same step with the host kept out (a spin kernel ahead of it lets the host enqueue the
    # whole step first): what is left of the synchronised time is device idleness the host causes.
    device_only = None
    if device.type == "cuda":
        device_only = median_ms({"step": step}, device, repeats=5, warmup=1)["step"]
    return {
        "median_ms": statistics.median(wall_ms),
        "min_ms": min(wall_ms),
        "max_ms": max(wall_ms),
        "event_median_ms": statistics.median(event_ms) if event_ms else None,
        "device_only_ms": device_only,
        "host_median_ms": statistics.median(host_ms),
        "wall_ms": wall_ms,
        "event_ms": event_ms,
        "host_ms": host_ms,
    }


def host_profile(step: Callable[[], object], device: torch.device) -> dict:
    """One more warmed ``step()`` under cProfile, the device idle before it: its host time (entry
    to return, cProfile's overhead included) and the functions with the most own and the most
    cumulative time in it."""
    stats, host_ms = _host_profile.profile_calls(step, device, calls=1)
    return {
        "profiled_host_ms": host_ms[0],
        "top_own": _host_profile.top_functions(stats, 1, _host_profile.OWN_TIME, HOST_PROFILE_TOP),
        "top_cumulative": _host_profile.top_functions(
            stats, 1, _host_profile.CUMULATIVE_TIME, HOST_PROFILE_TOP
        ),
    }


# ---- the optimizers -----------------------------------------------------------------------------


def plain_parameters(shapes, device) -> list[nn.Parameter]:
    return [
        nn.Parameter(torch.nn.init.kaiming_uniform_(torch.empty(shape, device=device)))
        for shape in shapes
    ]


def bench_torch_optimizer(
    make_optimizer, shapes, device, warmup: int, iters: int, profile_host: bool = False
) -> dict:
    params = plain_parameters(shapes, device)
    for param, grad in zip(params, random_gradients(shapes, device)):
        param.grad = grad
    optimizer = make_optimizer(params)
    result = time_steps(optimizer.step, device, warmup, iters)
    if profile_host:
        result["host_profile"] = host_profile(optimizer.step, device)
    del optimizer, params
    return result


def bench_dmuon(
    ns_backend,
    layer_shapes,
    num_layers,
    device,
    warmup: int,
    iters: int,
    profile=None,
    profile_host: bool = False,
    update_epilogue: bool = True,
) -> dict:
    """``profile``: None, or the Chrome-trace path ("" for none) of a profiled extra step;
    ``profile_host``: cProfile one extra step; ``update_epilogue``: False runs the step with
    ``DMUON_UPDATE_EPILOGUE=0`` (the Newton-Schulz output written out, then applied)."""
    with mock.patch.dict(os.environ, {UPDATE_EPILOGUE_ENV: "1" if update_epilogue else "0"}):
        import dmuon

        model = ProjectionStack(layer_shapes, num_layers, device)
        dmuon.dedicate_params(model, None, predicate=lambda name, p: p.ndim == 2)
        optimizer = dmuon.Muon(model, ns_backend=ns_backend)
        views = dmuon.inspect.view(model).params.values()
        masters = [p.master for p in views if p.master is not None]
        shapes = [tuple(master.shape) for master in masters]
        for master, grad in zip(masters, random_gradients(shapes, device)):
            master.grad = grad
        result = time_steps(optimizer.step, device, warmup, iters)
        if profile_host:
            result["host_profile"] = host_profile(optimizer.step, device)
        if profile is not None:
            rows = kernel_table(optimizer.step, device, profile or None)
            result["device_kernels"] = rows[:KERNEL_ROWS_KEPT]
            result["anatomy"] = _step_anatomy.anatomy(rows, shapes, PEAK_TFLOPS)
            print(_step_anatomy.format_anatomy("  one step by kernel class", result["anatomy"]))
        newton_schulz = optimizer.newton_schulz
        result["newton_schulz"] = repr(newton_schulz)
        result["kernel"] = newton_schulz.kernel
        result["kernel_reason"] = newton_schulz.kernel_reason
        del optimizer, model, masters
        return result


def kernel_table(
    step: Callable[[], object], device: torch.device, trace: str | None = None
) -> list[dict]:
    """Device time per kernel name over one profiled ``step()``, the largest first (the first
    ``KERNEL_ROWS_KEPT`` printed). ``trace``: also write the Chrome trace there (the device's idle
    gaps show in it)."""
    from torch.profiler import ProfilerActivity, profile

    _common.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _common.synchronize(device)
    rows = [
        {"kernel": event.key, "calls": event.count, "device_ms": event.device_time_total / 1e3}
        for event in prof.key_averages()
        if event.device_time_total > 0
        and event.device_type.name == "CUDA"
        and not getattr(event, "is_user_annotation", False)  # the step's own range
    ]
    if trace:
        prof.export_chrome_trace(trace)
    rows.sort(key=lambda row: -row["device_ms"])
    total = sum(row["device_ms"] for row in rows)
    print(f"  device kernels of one step: {total:.2f} ms in {sum(r['calls'] for r in rows)} calls")
    for row in rows[:KERNEL_ROWS_KEPT]:
        print(f"    {row['device_ms']:8.3f} ms {row['calls']:5d}x  {row['kernel'][:110]}")
    return rows


def host_table(results: dict[str, dict]) -> str:
    """Per optimizer: the synchronised step time against the host's share of it."""
    lines = [
        f"{'host time of step()':<34} {'synced ms':>10} {'device-only':>12} {'host ms':>9} "
        f"{'host/synced':>12} {'profiled ms':>12}"
    ]
    for label, result in results.items():
        profiled = result.get("host_profile", {}).get("profiled_host_ms")
        device_only = result.get("device_only_ms")
        lines.append(
            f"{label:<34} {result['median_ms']:>10.2f} "
            + (f"{device_only:>12.2f}" if device_only is not None else f"{'-':>12}")
            + f" {result['host_median_ms']:>9.2f} "
            f"{result['host_median_ms'] / result['median_ms']:>12.2f} "
            + (f"{profiled:>12.2f}" if profiled is not None else f"{'-':>12}")
        )
    return "\n".join(lines)


def host_profile_tables(results: dict[str, dict]) -> str:
    """Per optimizer, the functions of its profiled step by own and by cumulative time."""
    return "\n".join(
        _host_profile.format_rows(
            result["host_profile"][key],
            f"{label}: one step's host profile by {order} time (cProfile; "
            f"{result['host_profile']['profiled_host_ms']:.2f} ms profiled, "
            f"{result['host_median_ms']:.2f} ms unprofiled)",
        )
        for label, result in results.items()
        for key, order in (("top_own", "own"), ("top_cumulative", "cumulative"))
    )


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU (smoke test)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--profile",
        nargs="?",
        const="",
        default=None,
        metavar="TRACE",
        help="device time per kernel of one dmuon (auto) step; TRACE: write its Chrome trace",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="cProfile one more warmed step of each optimizer: where its host time goes",
    )
    _common.add_record_options(
        parser, "JSON path (default benchmarks/results/step-<gpu>-<date>.json; none with --quick)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    args = parse_args(argv)
    import dmuon
    from dmuon_kernels import NewtonSchulz, get_backend_status

    if args.quick:
        device = torch.device("cpu")
        layer_shapes = {
            name: (rows // QUICK_SHAPE_DIVISOR, cols // QUICK_SHAPE_DIVISOR)
            for name, (rows, cols) in LLAMA3_8B_LAYER.items()
        }
    else:
        if not torch.cuda.is_available():
            print("bench_step: no CUDA device; run with --quick for the CPU smoke test.")
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        layer_shapes = LLAMA3_8B_LAYER
    torch.manual_seed(0)
    shapes = [shape for _ in range(NUM_LAYERS) for shape in layer_shapes.values()]
    num_params = sum(rows * cols for rows, cols in shapes)
    floor_ms = sum(dmuon.inspect.ns_cost(shape) for shape in shapes) / (PEAK_TFLOPS * 1e12) * 1e3
    name = _common.device_name(device)
    print(
        f"bench_step: {len(shapes)} matrices, {num_params / 1e9:.3f} B params (fp32) on {name}; "
        f"torch {torch.__version__}, dmuon {dmuon.__version__}; "
        f"median of {args.iters} steps after {args.warmup} warm-up"
    )

    dmuon_run = functools.partial(
        bench_dmuon,
        layer_shapes=layer_shapes,
        num_layers=NUM_LAYERS,
        device=device,
        warmup=args.warmup,
        iters=args.iters,
        profile_host=args.host_profile,
    )
    runs: list[tuple[str, Callable[[], dict]]] = [
        (
            "fused AdamW",
            lambda: bench_torch_optimizer(
                lambda params: torch.optim.AdamW(params, fused=True),
                shapes,
                device,
                args.warmup,
                args.iters,
                profile_host=args.host_profile,
            ),
        ),
        (
            "torch.optim.Muon",
            lambda: bench_torch_optimizer(
                lambda params: torch.optim.Muon(params, adjust_lr_fn="match_rms_adamw"),
                shapes,
                device,
                args.warmup,
                args.iters,
                profile_host=args.host_profile,
            ),
        ),
        ("dmuon.Muon (gram, kernel auto)", lambda: dmuon_run("gram", profile=args.profile)),
        (
            "dmuon.Muon (auto, written out)",
            # its kernel table, not a second trace
            lambda: dmuon_run(
                "gram", profile=None if args.profile is None else "", update_epilogue=False
            ),
        ),
        ("dmuon.Muon (gram, kernel cublas)", lambda: dmuon_run(NewtonSchulz(kernel="cublas"))),
    ]
    results: dict[str, dict] = {}
    for label, run in runs:
        results[label] = run()
        free_memory(device)
        print(f"  {label}: {results[label]['median_ms']:.2f} ms", flush=True)

    adamw = results["fused AdamW"]["median_ms"]
    torch_muon = results["torch.optim.Muon"]["median_ms"]
    print()
    print(
        f"{'optimizer step':<34} {'median ms':>10} {'min ms':>9} {'vs torch Muon':>14} "
        f"{'vs fused AdamW':>15}"
    )
    for label, result in results.items():
        print(
            f"{label:<34} {result['median_ms']:>10.2f} {result['min_ms']:>9.2f} "
            f"{result['median_ms'] / torch_muon:>13.2f}x {result['median_ms'] / adamw:>14.2f}x"
        )
    print()
    print(
        f"FLOP floor (Gram NS, 6n²m + 14n³ per matrix, at {PEAK_TFLOPS:.0f} TFLOP/s): "
        f"{floor_ms:.1f} ms"
    )
    for label, result in results.items():
        if label.startswith("dmuon"):
            kernel = result["kernel"]
            print(
                f"  {label}: {result['median_ms'] - floor_ms:+.1f} ms over the floor "
                f"({result['median_ms'] / floor_ms:.2f}x); NS kernel that ran: {kernel} "
                f"({result['kernel_reason']})"
            )
    if args.quick:
        print("(--quick: tiny shapes on CPU; the floor and ratios mean nothing here)")
    print()
    print(host_table(results))
    if args.host_profile:
        print(host_profile_tables(results))

    date = _common.utc_now()
    record = {
        "benchmark": "bench_step",
        "quick": args.quick,
        "device": name,
        **_common.versions(dmuon=dmuon.__version__),
        "python": sys.version.split()[0],
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "num_layers": NUM_LAYERS,
        "layer_shapes": {key: list(value) for key, value in layer_shapes.items()},
        "num_params": num_params,
        "warmup": args.warmup,
        "iters": args.iters,
        "timing": "wall time per step() between torch.cuda.synchronize() calls; median",
        "host_timing": "host_ms: entering step() to its return, the device idle before",
        "host_profile": args.host_profile,
        "flop_floor_ms": floor_ms,
        "flop_floor_peak_tflops": PEAK_TFLOPS,
        "reference_floor_ms": REFERENCE_FLOOR_MS,
        "env": _common.dmuon_environment(),
        "backend_status": get_backend_status(),
        "results": results,
    }
    out = args.out
    if out is None and not args.quick:
        out = _common.result_path("step", name, date)
    if out is not None:
        _common.write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
