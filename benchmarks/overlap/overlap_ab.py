"""The overlapped owner step against the plain one, paired, on bench_e2e's 0.89 B Llama (or its
``--quick`` model) at any world size.

Both models live on the device at once (the same seed, the same tokens), and their iterations
(zero_grad + forward + backward + step, synchronised after each; the slowest rank's time)
alternate in ABBA order, so that the machine's drift and the order within a round fall on both
alike. Reported: each variant's median iteration, the median of the per-round differences
(overlapped minus plain) with a 95% bootstrap interval, and their ratio. bench_e2e runs the
variants one after the other, where a few milliseconds of drift between them is as large as the
difference measured at world size 1.

Usage (repository root)::

    python -m torch.distributed.run --standalone --nproc-per-node 1 \\
        benchmarks/overlap/overlap_ab.py --rounds 40 --out $OUT/overlap-ab.json
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/overlap/overlap_ab.py \\
        --device cpu --quick --rounds 2   # a smoke test on gloo
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

_common.add_package_sources_if_missing()  # before dmuon is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import dmuon  # noqa: E402
from benchmarks.e2e import bench_e2e  # noqa: E402
from dmuon.inspect import SPECULATION_CHUNKS  # noqa: E402

PLAIN, OVERLAPPED = "dmuon-z3", "dmuon-z3-overlap"
BOOTSTRAP_SAMPLES = 10_000


def iteration_ms(model, optimizer, tokens, device) -> float:
    """One iteration's milliseconds on the slowest rank."""
    timer = bench_e2e.Timer(device)
    timer.start()
    optimizer.zero_grad(set_to_none=True)
    bench_e2e.loss_of(model, tokens).backward()
    optimizer.step()
    timer.stop()
    _common.synchronize(device)
    slowest = torch.tensor([timer.ms()], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def median_interval(values: list[float], seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_SAMPLES)
    )
    return medians[int(0.025 * BOOTSTRAP_SAMPLES)], medians[int(0.975 * BOOTSTRAP_SAMPLES) - 1]


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="ABBA rounds (2 iterations each)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="bench_e2e's tiny model")
    _common.add_record_options(parser, "default: benchmarks/results/overlap-ab-<date>.json")
    options = parser.parse_args(argv)
    args = bench_e2e.parse_args(
        ["--device", options.device, "--warmup", str(options.warmup)]
        + (["--quick"] if options.quick else [])
    )
    backend = "nccl" if options.device == "cuda" else "gloo"
    device = _common.start_process_group("overlap_ab", options.device, backend, "--device cpu")
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    tokens = bench_e2e.training_tokens(args, device, dist.get_rank())
    runs = {
        variant: bench_e2e.build(variant, args, mesh, device)[:2] for variant in (PLAIN, OVERLAPPED)
    }
    for model, optimizer in runs.values():
        for _ in range(options.warmup):
            iteration_ms(model, optimizer, tokens, device)
    times: dict[str, list[float]] = {PLAIN: [], OVERLAPPED: []}
    for index in range(options.rounds):
        order = (PLAIN, OVERLAPPED) if index % 2 == 0 else (OVERLAPPED, PLAIN)
        for variant in (*order, *reversed(order)):
            times[variant].append(iteration_ms(*runs[variant], tokens, device))
    # Each round's two iterations of a variant, averaged: one paired difference per round.
    per_round = {
        v: [(t[2 * i] + t[2 * i + 1]) / 2 for i in range(options.rounds)] for v, t in times.items()
    }
    differences = [o - p for o, p in zip(per_round[OVERLAPPED], per_round[PLAIN])]
    low, high = median_interval(differences)
    plain_median = statistics.median(times[PLAIN])
    summary = {
        "plain_median_ms": plain_median,
        "overlapped_median_ms": statistics.median(times[OVERLAPPED]),
        "difference_median_ms": statistics.median(differences),
        "difference_95_interval_ms": [low, high],
        "ratio": statistics.median(times[OVERLAPPED]) / plain_median,
        "overlap_stats": dataclasses.asdict(runs[OVERLAPPED][1].overlap_stats()),
    }
    for model, _ in runs.values():
        dmuon.wait_all_replicate_broadcasts(model)
    record = {
        **bench_e2e.profile_record("overlap_ab", args, device, options.git_sha),
        "world_size": world,
        "backend": backend,
        "checkpoint": args.checkpoint,
        "param_dtype": str(args.param_dtype),
        "rounds": options.rounds,
        "speculation_chunks": SPECULATION_CHUNKS,
        "order": "ABBA, alternating which variant leads",
        "summary": summary,
        "iteration_ms": times,
    }
    out = options.out or _common.result_path(
        "overlap-ab", record["device"], _common.utc_now(), f"w{world}"
    )
    if dist.get_rank() == 0:  # every rank holds the same slowest-rank times
        _common.write_json(Path(out), record)
        print(
            f"world size {world} ({backend}): plain {summary['plain_median_ms']:.2f} ms, "
            f"overlapped {summary['overlapped_median_ms']:.2f} ms (x{summary['ratio']:.4f}); "
            f"per-round difference median {summary['difference_median_ms']:+.2f} ms, 95% "
            f"interval [{low:+.2f}, {high:+.2f}] over {options.rounds} rounds; "
            f"{summary['overlap_stats']}"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
