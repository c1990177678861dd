"""The overlapped owner step's timeline at world size 1: where the host and the device spend
each phase of an iteration, plain and overlapped, on bench_e2e's 0.89 B Llama.

Per variant, medians over ``--steps`` iterations after ``--warmup``:

- host ms of each phase (forward, backward, step): the wall clock from the phase's first call to
  its return, never synchronising inside an iteration;
- device ms of each phase: CUDA events recorded on the compute stream at the same points (the
  backward's event follows the side stream's work, which the end of backward waits for);
- with ``overlap_step``, the host ms spent inside the speculation (``landed``) per iteration.

Then one iteration under torch.profiler (CPU and CUDA): the host calls that block on the device
(stream, event or device synchronisation, blocking copies, frees) with the Python frames above
them, and the device's idle time within each phase's span of kernels. This says whether the
overlapped step is slower at world size 1 because the device has no idle time to give (the
speculation's kernels queue behind backward's), because the host blocks, or because the
speculation's launches lengthen a host-bound backward. Last, ``PROFILED_ITERATIONS`` under
cProfile: the forward phase, the step, and with ``overlap_step`` the speculation, by function.

Phases are compared across builds of a model here, and a build's forward host time alone varied
by 20 ms on the H200 (``overlap-timeline-h200-w1-2026-12-04-b1832c9*.json``): compare backward
and step, or measure the difference with ``overlap_ab.py``.

Usage (GPU machine, repository root)::

    python -m torch.distributed.run --standalone --nproc-per-node 1 \\
        benchmarks/overlap/overlap_timeline.py --out $OUT/overlap-timeline.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import pstats
import statistics
import sys
import time
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import (
    _common,
    _host_profile,
)

_common.add_package_sources_if_missing()  # before dmuon is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import dmuon  # noqa: E402
from benchmarks.e2e import bench_e2e  # noqa: E402
from benchmarks.overlap.profile_overlap import DEVICE_CATEGORIES, VARIANTS, trace_events, union_us  # noqa: E402

PHASES = ("forward", "backward", "step")
PROFILED_ITERATIONS = 3  # under cProfile, the speculation only
# Runtime calls that make the host wait for the device, besides every "...Synchronize" (the
# asynchronous copy, cudaMemcpyAsync, is not one of them).
BLOCKING = ("cudaMemcpy", "cudaFree", "cuMemFree", "cudaMalloc")


def blocks_host(call: str) -> bool:
    return "Synchronize" in call or call.split("_")[0] in BLOCKING


class SpeculationClock:
    """Host seconds inside an optimizer's speculation (``OverlappedStep.landed``), and a
    cProfile of it while ``profiling``."""

    def __init__(self, optimizer) -> None:
        self.seconds = 0.0
        self.profiling = False
        self.profiler = cProfile.Profile()
        overlap = getattr(optimizer, "_overlap", None)
        if overlap is not None:
            landed = overlap.landed

            def timed(*args, **kwargs):
                began = time.perf_counter()
                if self.profiling:
                    self.profiler.enable()
                try:
                    return landed(*args, **kwargs)
                finally:
                    if self.profiling:
                        self.profiler.disable()
                    self.seconds += time.perf_counter() - began

            overlap.landed = timed


def iteration(model, optimizer, tokens, device) -> tuple[list[float], list[torch.cuda.Event]]:
    """One iteration: host seconds at each phase's end, and CUDA events at the same points."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
    marks = [time.perf_counter()]
    events[0].record()
    optimizer.zero_grad(set_to_none=True)
    loss = bench_e2e.loss_of(model, tokens)
    marks.append(time.perf_counter())
    events[1].record()
    loss.backward()
    marks.append(time.perf_counter())
    events[2].record()
    optimizer.step()
    marks.append(time.perf_counter())
    events[3].record()
    return marks, events


def timed_variant(variant: str, args, mesh, device, tokens) -> dict:
    """Phase medians, the traced iteration and the speculation's profile of one variant."""
    model, optimizer, _ = bench_e2e.build(variant, args, mesh, device)
    clock = SpeculationClock(optimizer)
    host = collections.defaultdict(list)
    for index in range(args.warmup + args.steps):
        before = clock.seconds
        marks, events = iteration(model, optimizer, tokens, device)
        torch.cuda.synchronize(device)
        if index < args.warmup:
            continue
        for phase, start, stop in zip(PHASES, marks, marks[1:]):
            host[f"host {phase}"].append((stop - start) * 1e3)
            host[f"device {phase}"].append(
                events[PHASES.index(phase)].elapsed_time(events[PHASES.index(phase) + 1])
            )
        host["host speculation"].append((clock.seconds - before) * 1e3)
        host["iteration"].append(events[0].elapsed_time(events[-1]))
    medians = {name: statistics.median(values) for name, values in host.items()}
    medians.update(traced_iteration(model, optimizer, tokens, device))
    medians.update(phase_profiles(model, optimizer, tokens, device))
    if clock.seconds:
        clock.profiling = True
        for _ in range(PROFILED_ITERATIONS):
            iteration(model, optimizer, tokens, device)
            torch.cuda.synchronize(device)
        stats = pstats.Stats(clock.profiler)
        medians["speculation_profile"] = {
            order: _host_profile.top_functions(stats, PROFILED_ITERATIONS, order, top=25)
            for order in (_host_profile.OWN_TIME, _host_profile.CUMULATIVE_TIME)
        }
    if variant.split("+")[0].endswith("-overlap"):
        medians["overlap_stats"] = dataclasses.asdict(optimizer.overlap_stats())
    dmuon.wait_all_replicate_broadcasts(model)
    return medians


def phase_profiles(model, optimizer, tokens, device) -> dict[str, list[dict]]:
    """The forward phase (zero_grad and the loss) and the step under cProfile, top functions by
    own time each (the step's includes its wait for the device at the non-finite check)."""
    profilers = {"forward_profile": cProfile.Profile(), "step_profile": cProfile.Profile()}
    for _ in range(PROFILED_ITERATIONS):
        profilers["forward_profile"].enable()
        optimizer.zero_grad(set_to_none=True)
        loss = bench_e2e.loss_of(model, tokens)
        profilers["forward_profile"].disable()
        loss.backward()
        profilers["step_profile"].enable()
        optimizer.step()
        profilers["step_profile"].disable()
        torch.cuda.synchronize(device)
    return {
        name: _host_profile.top_functions(
            pstats.Stats(profiler), PROFILED_ITERATIONS, _host_profile.OWN_TIME, top=25
        )
        for name, profiler in profilers.items()
    }


def traced_iteration(model, optimizer, tokens, device) -> dict:
    """One iteration under torch.profiler: blocking host calls and the device's idle time."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as profile:
        for phase, run in (
            ("forward", lambda: bench_e2e.loss_of(model, tokens)),
            ("backward", None),
            ("step", optimizer.step),
        ):
            with torch.profiler.record_function(f"phase:{phase}"):
                if phase == "forward":
                    optimizer.zero_grad(set_to_none=True)
                    loss = run()
                elif phase == "backward":
                    loss.backward()
                else:
                    run()
        torch.cuda.synchronize(device)
    return summarise_trace(trace_events(profile))


def summarise_trace(events: list[dict]) -> dict:
    spans = [e for e in events if e.get("ph") == "X"]
    phases = {
        e["name"].removeprefix("phase:"): (e["ts"], e["ts"] + e["dur"])
        for e in spans
        if e.get("name", "").startswith("phase:") and e.get("cat") == "user_annotation"
    }
    launches = {  # correlation id -> host timestamp of the launch
        e["args"]["correlation"]: e["ts"]
        for e in spans
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    device = [e for e in spans if e.get("cat") in DEVICE_CATEGORIES]
    idle = {}
    for phase, (start, stop) in phases.items():
        mine = [
            (e["ts"], e["ts"] + e["dur"])
            for e in device
            if start <= launches.get(e["args"].get("correlation"), -1) < stop
        ]
        if mine:
            first, last = min(s for s, _ in mine), max(t for _, t in mine)
            busy = union_us(mine)
            idle[phase] = {
                "device_span_ms": (last - first) / 1e3,
                "device_busy_ms": busy / 1e3,
                "device_idle_ms": (last - first - busy) / 1e3,
                "kernels": len(mine),
            }
    python = [  # outermost first
        e
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"]))
        if e.get("cat") == "python_function"
        and any(part in e["name"] for part in ("dmuon", "torch/distributed", "bench"))
    ]
    blocking = collections.Counter()
    blocking_ms = collections.Counter()
    for e in spans:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or not blocks_host(e["name"]):
            continue
        frames = [
            p["name"]
            for p in python
            if p["ts"] <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"]
        ]
        phase = next((n for n, (s, t) in phases.items() if s <= e["ts"] < t), "?")
        where = f"{phase} | {e['name']} | " + " < ".join(frames[-3:][::-1])
        blocking[where] += 1
        blocking_ms[where] += e["dur"] / 1e3
    return {
        "traced_phases": idle,
        "blocking_calls": [
            {"where": w, "calls": n, "ms": blocking_ms[w]} for w, n in blocking.most_common(25)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    _common.add_record_options(parser, "default: benchmarks/results/overlap-timeline-<date>.json")
    options = parser.parse_args(argv)
    args = bench_e2e.parse_args(["--steps", str(options.steps), "--warmup", str(options.warmup)])
    device = _common.start_process_group("overlap_timeline", "cuda", "nccl", "(none: CUDA only)")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("shard",))
    tokens = bench_e2e.training_tokens(args, device)
    variants = options.variants.split(",")
    if len(set(variants)) != len(variants):
        parser.error(f"--variants names each variant once; got {options.variants}")
    results = {}
    for variant in variants:
        results[variant] = timed_variant(variant, args, mesh, device, tokens)
        bench_e2e.free_memory(device)
    record = {
        **bench_e2e.profile_record("overlap_timeline", args, device, options.git_sha),
        "results": results,
    }
    out = options.out or _common.result_path(
        "overlap-timeline", record["device"], _common.utc_now()
    )
    _common.write_json(Path(out), record)
    names = [n for n in results[variants[0]] if isinstance(results[variants[0]][n], float)]
    print(f"{'median ms':28s}" + "".join(f"{v:>22s}" for v in variants))
    for name in names:
        print(f"{name:28s}" + "".join(f"{results[v].get(name, 0.0):22.2f}" for v in variants))
    for variant in variants:
        print(f"== {variant}")
        for phase, row in results[variant]["traced_phases"].items():
            print(f"  traced {phase}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        for row in results[variant]["blocking_calls"][:12]:
            print(f"  blocking {row['calls']:4d} x {row['ms']:8.2f} ms  {row['where'][:200]}")
        for phase in ("forward", "step"):
            rows = results[variant][f"{phase}_profile"][:15]
            print(_host_profile.format_rows(rows, f"  {phase}, per iteration"))
        for order, rows in results[variant].get("speculation_profile", {}).items():
            print(_host_profile.format_rows(rows[:14], f"  speculation, per iteration, by {order}"))
        if "overlap_stats" in results[variant]:
            print(f"  overlap stats {results[variant]['overlap_stats']}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
