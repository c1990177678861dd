"""The element-wise passes of dmuon's owner step alone: the fused Triton kernels against torch.

The Muon matrices of bench_e2e's 0.89 B Llama (16 layers of q/o 2048x2048, k/v 1024x2048,
gate/up 5632x2048, down 2048x5632: 755 M fp32 elements) in the optimizer's batches (same shape,
at most 256 MiB of fp32 inputs, a matrix over 4 M elements alone), with fp32 gradients, momentum
buffers and masters. One timed step is, per batch, ``muon_normalized_inputs_`` (momentum,
Nesterov, the division by the norm and the cast into an fp16 Newton-Schulz buffer) and then
``muon_apply_updates_`` with that buffer standing in for the Newton-Schulz output (decay and
scaled update): the element-wise work of a step without the iteration. Variants: the Triton
kernels (the default) and the torch path (``DMUON_FUSED_TRITON=0``: multi-tensor ``_foreach_``
ops). Each step is timed with CUDA events (median over ``--repeats`` after ``--warmup``), with the
byte model of the fused kernels beside it (18 bytes per element for the input with Nesterov, 10
for the update) as an effective bandwidth.

Usage (repository root; on the GPU machine put the package sources on PYTHONPATH)::

    python benchmarks/step/bench_fused_step.py          # CUDA; JSON: benchmarks/results/fused-step-<gpu>-<date>.json
    python benchmarks/step/bench_fused_step.py --quick  # tiny shapes on CPU: a smoke test (no JSON unless --out)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from benchmarks import _common
from dmuon_kernels import __version__
from dmuon_kernels.fused import muon_apply_updates_, muon_normalized_inputs_

LAYERS = 16
LAYER_SHAPES = [(2048, 2048), (1024, 2048), (1024, 2048), (2048, 2048)]
LAYER_SHAPES += [(5632, 2048), (5632, 2048), (2048, 5632)]
QUICK_LAYER_SHAPES = [(64, 64), (32, 64), (160, 64), (64, 160)]
BATCH_BYTES, BATCHED_NUMEL = 256 * 2**20, 2**22  # as dmuon.muon_update
BYTES_PER_ELEMENT = 18 + 10  # input pass pair (Nesterov) + update pass
MOMENTUM, LR, WEIGHT_DECAY = 0.95, 0.02, 0.1
VARIANTS = {"triton": "1", "torch": "0"}  # DMUON_FUSED_TRITON


def batches(shapes: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Same-shape runs under BATCH_BYTES of fp32, a matrix over BATCHED_NUMEL alone."""
    result = []
    for shape in sorted(set(shapes)):
        count, numel = shapes.count(shape), shape[0] * shape[1]
        per_batch = 1 if numel > BATCHED_NUMEL else max(1, BATCH_BYTES // (4 * numel))
        result += [[shape] * min(per_batch, count - s) for s in range(0, count, per_batch)]
    return result


def build(runs, device):
    """Per batch: gradients, momenta, masters, and the fp16 Newton-Schulz buffer (rows <= cols)."""
    generator = torch.Generator(device=device).manual_seed(0)
    built = []
    for run in runs:
        rows, cols = run[0]
        grads = [torch.randn(rows, cols, device=device, generator=generator) for _ in run]
        momenta = [torch.randn(rows, cols, device=device, generator=generator) for _ in run]
        masters = [torch.randn(rows, cols, device=device, generator=generator) for _ in run]
        buffer = torch.empty(len(run), min(rows, cols), max(rows, cols), device=device).half()
        built.append((grads, momenta, masters, buffer, rows > cols))
    return built


def step(built) -> None:
    for grads, momenta, masters, buffer, tall in built:
        first = [False] * len(grads)
        muon_normalized_inputs_(grads, momenta, first, MOMENTUM, True, buffer)
        updates = list(buffer.mT) if tall else list(buffer)
        muon_apply_updates_(masters, updates, LR, WEIGHT_DECAY, 0.2 * 2048**0.5)


def time_steps(built, device, *, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        step(built)
    _common.synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(built)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step(built)
            times.append(1e3 * (time.perf_counter() - begin))
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU (smoke test)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    _common.add_record_options(
        parser, "JSON path (default benchmarks/results/fused-step-<gpu>-<date>.json)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        device, layer_shapes, layers = torch.device("cpu"), QUICK_LAYER_SHAPES, 2
    elif torch.cuda.is_available():
        device, layer_shapes, layers = torch.device("cuda"), LAYER_SHAPES, LAYERS
    else:
        print("bench_fused_step: no CUDA device; run with --quick on the CPU", file=sys.stderr)
        return 2
    date, label = _common.utc_now(), _common.device_name(device)
    runs = batches(layer_shapes * layers)
    elements = sum(rows * cols for run in runs for rows, cols in run)
    built = build(runs, device)
    results = {}
    previous = os.environ.get("DMUON_FUSED_TRITON")
    try:
        for name, switch in VARIANTS.items():
            os.environ["DMUON_FUSED_TRITON"] = switch
            times = time_steps(built, device, warmup=args.warmup, repeats=args.repeats)
            median = statistics.median(times)
            results[name] = {
                "median_ms": median,
                "times_ms": times,
                "model_gb_per_s": BYTES_PER_ELEMENT * elements / median / 1e6,
            }
    finally:
        if previous is None:
            os.environ.pop("DMUON_FUSED_TRITON", None)
        else:
            os.environ["DMUON_FUSED_TRITON"] = previous
    print(
        f"element-wise Muon step passes on {label}: {elements / 1e6:.0f} M fp32 elements in "
        f"{len(runs)} batches (Nesterov, weight decay {WEIGHT_DECAY}); median of {args.repeats}"
    )
    for name, entry in results.items():
        print(
            f"  {name:<7} {entry['median_ms']:8.3f} ms   "
            f"({BYTES_PER_ELEMENT} B/element model: {entry['model_gb_per_s']:.0f} GB/s)"
        )
    out = (
        args.out
        if args.out is not None
        else (None if args.quick else _common.result_path("fused-step", label, date))
    )
    if out is not None:
        record = {
            "benchmark": "fused_step",
            "date": _common.iso_seconds(date),
            "git_sha": _common.git_sha(args.git_sha),
            "device": label,
            **_common.versions(dmuon_kernels=__version__),
            "environment": _common.dmuon_environment(),
            "inputs": {
                "layer_shapes": [list(s) for s in layer_shapes],
                "layers": layers,
                "batches": [[len(run), *run[0]] for run in runs],
                "elements": elements,
                "bytes_per_element_model": BYTES_PER_ELEMENT,
                "warmup": args.warmup,
                "repeats": args.repeats,
            },
            "results": results,
        }
        _common.write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
