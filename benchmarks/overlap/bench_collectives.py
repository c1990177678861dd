"""Collective times on this machine: broadcast, reduce, all-gather, reduce-scatter, all-reduce.

The figures ``dmuon-tools simulate`` assumes for its links (``docs/simulator.md``): for each
collective kind and buffer size, the median time of one collective over ``--iters`` runs after
``--warmup``, the slowest rank of each run. Each run starts behind a barrier and ends with a
synchronisation, timed on the host (``time.perf_counter``), so the time includes one launch and
one synchronisation: a few microseconds, negligible next to the sizes that set the bandwidth.
The buffer size ``B`` is the one ``dmuon_tools.costs.collective_ms`` takes: the broadcast or
reduced tensor, the gathered output, the scattered input. Per kind, the ring model's latency and
bandwidth (``t = (n - 1) alpha + f B / bw``, ``f`` = (n-1)/n for all-gather and reduce-scatter,
2 (n-1)/n for all-reduce, 1 for broadcast and reduce) are fitted by least squares and recorded;
``dmuon-tools calibrate`` compares every measured time with the machine's prediction.

Usage (repository root; on the GPU machine put the package sources on PYTHONPATH)::

    python -m torch.distributed.run --nproc-per-node 8 benchmarks/overlap/bench_collectives.py
    python -m torch.distributed.run --nproc-per-node 4 benchmarks/overlap/bench_collectives.py --backend gloo
    python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 \\
        benchmarks/overlap/bench_collectives.py                     # across nodes: the network link
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/overlap/bench_collectives.py --device cpu --quick

Rank 0 prints a table and writes JSON (``--out``; default
``benchmarks/results/collectives-<gpu>-<backend>-w<world>-<date>.json``, none with ``--quick``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
import torch.distributed as dist

from benchmarks import _common

KINDS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce")
SIZES_MIB = (1, 4, 16, 64, 256)
QUICK_SIZES_MIB = (0.0625, 1)
# Share of B one rank's busiest link carries, per kind (the ring model of dmuon_tools.costs).
BANDWIDTH_FACTOR = {
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
}
LATENCY_STEPS = {
    "broadcast": lambda n: n - 1,
    "reduce": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_reduce": lambda n: 2 * (n - 1),
}


def run_once(kind: str, buffer: torch.Tensor, piece: torch.Tensor) -> None:
    """One collective of ``kind`` on ``buffer`` (B bytes) and ``piece`` (B / world bytes)."""
    if kind == "broadcast":
        dist.broadcast(buffer, src=0)
    elif kind == "reduce":
        dist.reduce(buffer, dst=0, op=dist.ReduceOp.SUM)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(buffer, piece)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(piece, buffer, op=dist.ReduceOp.SUM)
    else:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)


def measure(kind: str, num_bytes: int, args, device: torch.device) -> list[float]:
    """This rank's milliseconds of each timed run."""
    world = dist.get_world_size()
    numel = max(world, num_bytes // 4 // world * world)  # fp32, divisible by the world size
    buffer = torch.ones(numel, dtype=torch.float32, device=device)
    piece = torch.ones(numel // world, dtype=torch.float32, device=device)
    times = []
    for index in range(args.warmup + args.iters):
        dist.barrier()
        _common.synchronize(device)
        started = time.perf_counter()
        run_once(kind, buffer, piece)
        _common.synchronize(device)
        if index >= args.warmup:
            times.append((time.perf_counter() - started) * 1e3)
    return times


def fit(rows: list[dict], world: int) -> dict[str, dict[str, float | None]]:
    """Per kind, latency (us per ring step) and bandwidth (GB/s) of the ring model, by least
    squares on ``t = a x + b y`` with ``x`` the ring steps and ``y`` the bytes on the busiest
    link; None where the sizes cannot separate them."""
    fits = {}
    for kind in KINDS:
        points = [
            (LATENCY_STEPS[kind](world), BANDWIDTH_FACTOR[kind](world) * r["bytes"], r["median_ms"])
            for r in rows
            if r["kind"] == kind and "error" not in r
        ]
        if world == 1 or len(points) < 2:
            fits[kind] = {"latency_us": None, "bandwidth_gbps": None}
            continue
        # One regressor for latency is constant across sizes: fit t = c + y / bw.
        ys = [y for _, y, _ in points]
        ts = [t for _, _, t in points]
        mean_y, mean_t = statistics.fmean(ys), statistics.fmean(ts)
        variance = sum((y - mean_y) ** 2 for y in ys)
        slope = sum((y - mean_y) * (t - mean_t) for y, t in zip(ys, ts)) / variance
        intercept = mean_t - slope * mean_y
        steps = points[0][0]
        fits[kind] = {
            "latency_us": max(intercept, 0.0) / steps * 1e3 if steps else None,
            "bandwidth_gbps": (1.0 / slope) / 1e6 if slope > 0 else None,  # bytes/ms -> GB/s
        }
    return fits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default nccl on CUDA; gloo runs several ranks on CUDA tensors of one GPU",
    )
    parser.add_argument("--quick", action="store_true", help="two small sizes, few runs")
    parser.add_argument("--iters", type=int, default=None, help="timed runs; default 20 (3)")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (1 with --quick)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="comma list of " + ", ".join(KINDS)
    )
    _common.add_record_options(
        parser, "default: benchmarks/results/collectives-<gpu>-<backend>-w<world>-<date>.json"
    )
    args = parser.parse_args(argv)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    device = _common.start_process_group(
        "bench_collectives", args.device, backend, "--device cpu --quick"
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    sizes = QUICK_SIZES_MIB if args.quick else SIZES_MIB
    rows = []
    for kind in args.kinds:
        for size_mib in sizes:
            num_bytes = int(size_mib * 2**20)
            try:
                local: list[float] | str = measure(kind, num_bytes, args, device)
            except RuntimeError as error:  # a kind this backend lacks fails on every rank
                local = f"{type(error).__name__}: {error}"
            gathered: list = [None] * world
            dist.all_gather_object(gathered, local)
            failed = sorted({str(r) for r in gathered if isinstance(r, str)})
            if failed:
                rows.append({"kind": kind, "bytes": num_bytes, "error": failed[0]})
                if rank == 0:
                    print(f"  {kind:<15} {size_mib:>8g} MiB  FAILED: {failed[0][:100]}")
                continue
            slowest = [max(per_rank) for per_rank in zip(*gathered)]
            rows.append(
                {
                    "kind": kind,
                    "bytes": num_bytes,
                    "median_ms": statistics.median(slowest),
                    "min_ms": min(slowest),
                    "times_ms": slowest,
                }
            )
            if rank == 0:
                median = rows[-1]["median_ms"]
                print(f"  {kind:<15} {size_mib:>8g} MiB  {median:>9.3f} ms", flush=True)
    fits = fit(rows, world)
    if rank == 0:
        device_label = _common.device_name(device)
        nodes = max(1, world // local_world)
        print(
            f"bench_collectives: {device_label}, {backend}, world {world} ({nodes} nodes, "
            f"{local_world} ranks a node, {gpus} GPUs a node), torch {torch.__version__}"
        )
        for kind, result in fits.items():
            if kind in args.kinds:
                print(f"  fit {kind:<15} latency {result['latency_us']} us, bandwidth "
                      f"{result['bandwidth_gbps']} GB/s")  # fmt: skip
        date = _common.utc_now()
        record = {
            "benchmark": "bench_collectives",
            "device": device_label,
            "backend": backend,
            "world_size": world,
            "nodes": nodes,
            "ranks_per_node": local_world,
            "gpus_per_node": gpus,
            **_common.versions(),
            "git_sha": _common.git_sha(args.git_sha),
            "date": _common.iso_seconds(date),
            "timing": "host wall time between a barrier+synchronize and the synchronize after one "
            "collective; slowest rank per run; median over runs",
            "inputs": {"iters": args.iters, "warmup": args.warmup, "dtype": "float32"},
            "results": rows,
            "fit": fits,
        }
        out = args.out
        if out is None and not args.quick:
            out = _common.result_path("collectives", device_label, date, backend, f"w{world}")
        if out is not None:
            _common.write_json(out, record)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
