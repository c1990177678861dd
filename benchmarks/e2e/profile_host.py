"""Where the host time of a training iteration goes: dmuon against FSDP2 + fused AdamW.

One process (world size 1, NCCL on CUDA), ``bench_e2e``'s Llama-style decoder in a GPT-2-small
shape by default (12 layers, d_model 768, ffn 2112, seq 256, micro-batch 2, bf16 compute,
no activation checkpointing). Per variant, medians over ``--steps`` iterations after
``--warmup``:

- host: wall time from the first call of the phase to its return, without synchronising (how long
  the CPU is busy issuing work); forward+backward and ``step()`` separately;
- device: CUDA events around the same phases (the iteration, once synchronised);
- peak memory (``max_memory_allocated``).

Then ``cProfile`` over ``--profile-steps`` dmuon iterations, with the functions that take the
most host time in forward+backward and in ``step()`` (own time, and the dmuon functions by
cumulative time), so that each hook's share is visible.

Usage (GPU machine, repository root)::

    python -m torch.distributed.run --nproc-per-node 1 benchmarks/e2e/profile_host.py
    python -m torch.distributed.run --nproc-per-node 1 benchmarks/e2e/profile_host.py --device cpu --quick

Rank 0 prints the tables and writes JSON (``--out``; default
``benchmarks/results/host-profile-<device>-<date>.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

_common.add_package_sources_if_missing()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import dmuon  # noqa: E402
from benchmarks.e2e.bench_e2e import QUICK_CONFIG, ModelConfig, build, loss_of  # noqa: E402

VARIANTS = ("fsdp2-adamw", "dmuon-z3")
GPT2_SMALL = ModelConfig(vocab=50257, dim=768, layers=12, heads=12, kv_heads=12, ffn=2112)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iterations(model, optimizer, tokens, device, warmup: int, steps: int) -> dict:
    """Host and device milliseconds of forward+backward and of the step, per iteration."""
    host_fb, host_step, device_fb, device_step = [], [], [], []
    cuda = device.type == "cuda"
    for index in range(warmup + steps):
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, tokens).backward()
        forward_backward = time.perf_counter()
        if cuda:
            events[1].record()
        optimizer.step()
        stepped = time.perf_counter()
        if cuda:
            events[2].record()
        sync(device)
        if index >= warmup:
            host_fb.append((forward_backward - started) * 1e3)
            host_step.append((stepped - forward_backward) * 1e3)
            if cuda:
                device_fb.append(events[0].elapsed_time(events[1]))
                device_step.append(events[1].elapsed_time(events[2]))
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    return {
        "host_forward_backward_ms": median(host_fb),
        "host_step_ms": median(host_step),
        "device_forward_backward_ms": median(device_fb),
        "device_step_ms": median(device_step),
    }


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one storage count once)."""
    seen = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def memory_table(model, optimizer, variant: str) -> dict[str, float]:
    """GiB held after a step, by kind of buffer."""
    gib = 2**30
    table = {}
    if variant.startswith("dmuon"):
        view = dmuon.inspect.view(model)
        masters = [p.master for p in view.params.values() if p.master is not None]
        table["dmuon fp32 masters"] = tensor_bytes(masters) / gib
        segments = [s for b in view.boundaries for s in b.segments if s.is_local]
        table["dmuon resident segments (compute dtype)"] = (
            sum(s.value_bytes for s in segments if s.dtype != torch.float32) / gib
        )
        table["dmuon master grads"] = tensor_bytes(m.grad for m in masters) / gib
        owned = {id(m) for m in masters}
        state = [t for p, s in optimizer.state.items() if id(p) in owned for t in s.values()]
        table["dmuon optimizer state (momentum)"] = tensor_bytes(state) / gib
    others = [
        p for p in model.parameters() if p.numel() > 0 and not getattr(p, "_dmuon_dedicated", False)
    ]
    table["FSDP2 sharded params"] = tensor_bytes(others) / gib
    table["FSDP2 grads"] = tensor_bytes(p.grad for p in others) / gib
    other_ids = {id(p) for p in others}
    state = [t for p, s in optimizer.state.items() if id(p) in other_ids for t in s.values()]
    table["AdamW state"] = tensor_bytes(t for t in state if t.dim() > 0) / gib
    return table


def memory_phases(model, optimizer, tokens, device) -> dict[str, float]:
    """Allocated GiB before, and peaks during, forward+backward and the step."""
    gib = 2**30
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    phases = {"allocated before forward": torch.cuda.memory_allocated(device) / gib}
    torch.cuda.reset_peak_memory_stats(device)
    loss_of(model, tokens).backward()
    sync(device)
    phases["peak in forward+backward"] = torch.cuda.max_memory_allocated(device) / gib
    phases["allocated after backward"] = torch.cuda.memory_allocated(device) / gib
    torch.cuda.reset_peak_memory_stats(device)
    optimizer.step()
    sync(device)
    phases["peak in step"] = torch.cuda.max_memory_allocated(device) / gib
    phases["allocated after step"] = torch.cuda.memory_allocated(device) / gib
    return phases


def profile_phases(model, optimizer, tokens, device, steps: int, top: int) -> dict[str, str]:
    """cProfile tables of forward+backward and of step() over ``steps`` iterations."""
    profiles = {"forward_backward": cProfile.Profile(), "step": cProfile.Profile()}
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        profiles["forward_backward"].enable()
        loss_of(model, tokens).backward()
        profiles["forward_backward"].disable()
        profiles["step"].enable()
        optimizer.step()
        profiles["step"].disable()
        sync(device)
    tables = {}
    for phase, profile in profiles.items():
        for order, restriction in (("tottime", top), ("cumulative", "dmuon")):
            stream = io.StringIO()
            stats = pstats.Stats(profile, stream=stream).sort_stats(order)
            stats.print_stats(restriction, top) if order == "cumulative" else stats.print_stats(top)
            tables[f"{phase}/{order}"] = stream.getvalue()
    return tables


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--llama-1b",
        action="store_true",
        help="bench_e2e's default 1.0 B Llama (seq 2048, micro-batch 4, checkpointing) instead",
    )
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    _common.add_record_options(parser)
    args = parser.parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = _common.start_process_group("profile_host", args.device, backend, "--device cpu")
    # bench_e2e.build reads these from its own argument namespace.
    args.model = QUICK_CONFIG if args.quick else ModelConfig() if args.llama_1b else GPT2_SMALL
    args.seq = 32 if args.quick else 2048 if args.llama_1b else args.seq
    args.micro_batch = 4 if args.llama_1b else args.micro_batch
    args.checkpoint = args.llama_1b
    args.param_dtype = torch.bfloat16
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))
    tokens = torch.randint(0, args.model.vocab, (args.micro_batch, args.seq + 1)).to(device)
    results, tables = {}, {}
    for variant in VARIANTS:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model, optimizer, _ = build(variant, args, mesh, device)
        first = memory_phases(model, optimizer, tokens, device) if device.type == "cuda" else {}
        results[variant] = time_iterations(
            model, optimizer, tokens, device, args.warmup, args.steps
        )
        if device.type == "cuda":
            results[variant]["peak_gib"] = max(
                torch.cuda.max_memory_allocated(device) / 2**30, *first.values()
            )
            results[variant]["first_iteration_memory_gib"] = first
            results[variant]["memory_phases_gib"] = memory_phases(model, optimizer, tokens, device)
            results[variant]["memory_after_step_gib"] = memory_table(model, optimizer, variant)
        if variant.startswith("dmuon"):
            tables = profile_phases(model, optimizer, tokens, device, args.profile_steps, args.top)
            dmuon.wait_all_replicate_broadcasts(model)
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    label = _common.device_name(device)
    print(f"profile_host: {label}, torch {torch.__version__}, model {args.model}, seq {args.seq}")
    print(
        f"{'variant':<12} {'host f+b':>9} {'host step':>9} {'dev f+b':>9} {'dev step':>9} {'peak GiB':>9}"
    )
    for variant, r in results.items():
        cells = [r["host_forward_backward_ms"], r["host_step_ms"], r["device_forward_backward_ms"]]
        cells += [r["device_step_ms"], r.get("peak_gib")]
        print(
            f"{variant:<12} "
            + " ".join(f"{c:>9.2f}" if c is not None else f"{'-':>9}" for c in cells)
        )
    for variant, r in results.items():
        for title in ("first_iteration_memory_gib", "memory_phases_gib", "memory_after_step_gib"):
            for name, value in r.get(title, {}).items():
                print(f"{variant:<12} {title[:5]:<5} {name:<42} {value:8.3f} GiB")
    for name, table in tables.items():
        print(f"\n==== dmuon {name} ====\n{table}")
    date = _common.utc_now()
    record = {
        "benchmark": "profile_host",
        "device": label,
        **_common.versions(dmuon=dmuon.__version__),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "inputs": {"model": str(args.model), "seq": args.seq, "micro_batch": args.micro_batch},
        "results": results,
        "profiles": tables,
    }
    _common.write_json(args.out or _common.result_path("host-profile", label, date), record)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
