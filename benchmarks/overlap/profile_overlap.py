"""Where the overlapped owner step's time goes at world size 1: bench_e2e's 0.89 B Llama stepped
with ``dmuon-z3`` and with ``dmuon-z3-overlap`` under torch.profiler, summarised per CUDA stream.

For each variant, over the profiled steps: the step's time (CUDA events), each stream's busy time
(the union of its kernels' and copies' intervals), the time two or more streams ran at once, the
total kernel time, and the kernels whose total time changed most between the two variants. The
overlapped step measured slower than the plain one at world size 1 on the H200 (9-11% at first,
then 1-2%; 1-2% faster since two chunks and no end-of-backward wait), where it has no
communication to hide behind; this says whether a difference is more work (extra kernels or
copies), slower kernels (the two streams contending) or idle gaps.

Usage (GPU machine, repository root)::

    python -m torch.distributed.run --standalone --nproc-per-node 1 \\
        benchmarks/overlap/profile_overlap.py --out $OUT/profile-overlap.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
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

VARIANTS = ("dmuon-z3", "dmuon-z3-overlap")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profiled_steps(variant: str, args, mesh, device, tokens) -> tuple[list[float], list[dict]]:
    """(step ms per profiled step, the device events of the trace) after ``args.warmup`` steps."""
    model, optimizer, _ = bench_e2e.build(variant, args, mesh, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        bench_e2e.loss_of(model, tokens).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize(device)
    step_ms = []
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(args.steps):
            timer = bench_e2e.Timer(device)
            timer.start()
            step()
            timer.stop()
            torch.cuda.synchronize(device)
            step_ms.append(timer.ms())
    dmuon.wait_all_replicate_broadcasts(model)
    device_events = [
        e for e in trace_events(profile) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]
    return step_ms, device_events


def trace_events(profile: torch.profiler.profile) -> list[dict]:
    """A finished torch.profiler run's Chrome-trace events."""
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(trace))
        return json.loads(trace.read_text())["traceEvents"]


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def concurrent_us(by_stream: dict[int, list[tuple[float, float]]]) -> float:
    """Time during which at least two streams ran something (a sweep over all boundaries)."""
    boundaries = []
    for intervals in by_stream.values():
        for start, end in intervals:
            boundaries += [(start, 1), (end, -1)]
    boundaries.sort()
    total, running, previous = 0.0, 0, None
    for time, change in boundaries:
        if running >= 2 and previous is not None:
            total += time - previous
        running += change
        previous = time
    return total


def summarise(step_ms: list[float], events: list[dict]) -> dict:
    by_stream: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    by_kernel: collections.Counter[str] = collections.Counter()
    by_category: collections.Counter[str] = collections.Counter()
    for event in events:
        start, duration = float(event["ts"]), float(event["dur"])
        by_stream[int(event["args"].get("stream", -1))].append((start, start + duration))
        by_category[event["cat"]] += duration
        if event["cat"] == "kernel":
            by_kernel[event["name"][:120]] += duration
    steps = len(step_ms)
    return {
        "step_ms": step_ms,
        "step_ms_median": statistics.median(step_ms),
        "per_step_ms": {
            "busy_by_stream": {
                str(stream): union_us(intervals) / 1e3 / steps
                for stream, intervals in sorted(by_stream.items())
            },
            "two_or_more_streams_at_once": concurrent_us(by_stream) / 1e3 / steps,
            "device_busy": union_us([i for v in by_stream.values() for i in v]) / 1e3 / steps,
            "by_category": {k: v / 1e3 / steps for k, v in sorted(by_category.items())},
        },
        "kernels_per_step_ms": {k: v / 1e3 / steps for k, v in by_kernel.most_common()},
        "events_per_step": len(events) / steps,
    }


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    _common.add_record_options(parser, "default: benchmarks/results/profile-overlap-<date>.json")
    options = parser.parse_args(argv)
    args = bench_e2e.parse_args(["--steps", str(options.steps), "--warmup", str(options.warmup)])
    device = _common.start_process_group("profile_overlap", "cuda", "nccl", "(none: CUDA only)")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("shard",))
    tokens = bench_e2e.training_tokens(args, device)
    results = {}
    for variant in VARIANTS:
        results[variant] = summarise(*profiled_steps(variant, args, mesh, device, tokens))
        bench_e2e.free_memory(device)  # the variant's model is gone with its frame
    plain, overlapped = (results[v]["kernels_per_step_ms"] for v in VARIANTS)
    changes = {k: overlapped.get(k, 0.0) - plain.get(k, 0.0) for k in set(plain) | set(overlapped)}
    largest = sorted(changes, key=lambda k: -abs(changes[k]))[:15]
    record = {
        **bench_e2e.profile_record("profile_overlap", args, device, options.git_sha),
        "results": results,
        "largest_kernel_changes_per_step_ms": {k: changes[k] for k in largest},
    }
    out = options.out or _common.result_path("profile-overlap", record["device"], _common.utc_now())
    _common.write_json(Path(out), record)
    print(f"{'per step, ms':36s}" + "".join(f"{v:>20s}" for v in VARIANTS))
    rows = [("step (CUDA events, median)", lambda r: r["step_ms_median"])]
    rows.append(("device busy (any stream)", lambda r: r["per_step_ms"]["device_busy"]))
    rows.append(("2+ streams at once", lambda r: r["per_step_ms"]["two_or_more_streams_at_once"]))
    for category in DEVICE_CATEGORIES:
        rows.append((category, lambda r, c=category: r["per_step_ms"]["by_category"].get(c, 0.0)))
    for label, value in rows:
        print(f"{label:36s}" + "".join(f"{value(results[v]):20.2f}" for v in VARIANTS))
    for variant in VARIANTS:
        busy = results[variant]["per_step_ms"]["busy_by_stream"]
        print(f"{variant} busy by stream: " + ", ".join(f"{s}: {t:.2f}" for s, t in busy.items()))
    print("largest kernel-time changes, overlapped minus plain (ms per step):")
    for name in largest:
        print(f"  {changes[name]:+8.3f}  {name[:100]}")
    print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
