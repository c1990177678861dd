"""Checkpoint save + load: dmuon against FSDP2 + AdamW, sharded DCP, the same model, one run.

Builds the Llama of ``bench_e2e.py`` (same config and options) for two variants, trains it
``--train-steps`` steps so every optimizer state exists, then ``--repeats`` times:

- save: ``get_state_dict`` (``dmuon.checkpoint`` for dmuon, ``torch.distributed.checkpoint.
  state_dict`` for FSDP2 + AdamW) and ``torch.distributed.checkpoint.save`` into a fresh folder;
- load: ``get_state_dict`` of the live model, ``torch.distributed.checkpoint.load`` and
  ``set_state_dict``.

Each phase is timed on the host around a device synchronisation (the slowest rank counts); the
folder is removed between repeats. dmuon's ``dmuon.checkpoint.save`` (atomic commit) is timed
once more on its own, and so is the export of the full model to the CPU of rank 0
(``full_state_dict=True, cpu_offload=True``). After the last load the weights are checked against the saved ones.

Usage (repository root; on the GPU machine put the package sources on PYTHONPATH)::

    python -m torch.distributed.run --nproc-per-node 1 benchmarks/e2e/bench_checkpoint.py
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/e2e/bench_checkpoint.py --device cpu --quick

Rank 0 prints a table and writes JSON (``--out``; default
``benchmarks/results/checkpoint-<gpu>-w<world>-<date>.json``, none with ``--quick``).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

_common.add_package_sources_if_missing()  # before dmuon is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.distributed.checkpoint.state_dict as torch_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import dmuon  # noqa: E402
import dmuon.checkpoint as dckpt  # noqa: E402
from benchmarks.e2e import bench_e2e  # noqa: E402

VARIANTS = ("fsdp2-adamw", "dmuon-z3")
TARGET_RATIO = 1.2  # dmuon's save + load at most 1.2x FSDP2 + AdamW's


def state_dict_api(variant: str):
    return dckpt if variant.startswith("dmuon") else torch_state_dict


def timed(device: torch.device, action) -> float:
    """Seconds of ``action()``, the slowest rank's."""
    _common.synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    action()
    _common.synchronize(device)
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def save(api, model, optimizer, path: Path) -> None:
    model_sd, optim_sd = api.get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load(api, model, optimizer, path: Path) -> None:
    model_sd, optim_sd = api.get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    api.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def atomic_save(model, optimizer, path: Path) -> None:
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)


def export(api, model) -> None:
    options = torch_state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = api.get_model_state_dict(model, options=options)
    if dist.get_rank() == 0 and not full:
        raise RuntimeError("the full state dict is empty on rank 0")


def measure(variant: str, args, mesh, device, tokens, folder: Path) -> dict:
    model, optimizer, _ = bench_e2e.build(variant, args, mesh, device)
    for _ in range(args.train_steps):
        optimizer.zero_grad(set_to_none=True)
        bench_e2e.loss_of(model, tokens).backward()
        optimizer.step()
    api = state_dict_api(variant)
    path = folder / variant
    saves, loads = [], []
    for _ in range(args.repeats):
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        saves.append(timed(device, functools.partial(save, api, model, optimizer, path)))
        loads.append(timed(device, functools.partial(load, api, model, optimizer, path)))
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    export_s = timed(device, functools.partial(export, api, model))
    # Extra device memory of the export against the largest single full tensor of the model.
    export_extra_gib = (
        (torch.cuda.max_memory_allocated(device) - allocated) / 2**30
        if device.type == "cuda"
        else None
    )
    with torch.device("meta"):
        shapes = bench_e2e.Llama(args.model, 1, False).parameters()
        largest_gib = max(p.numel() * 4 for p in shapes) / 2**30  # fp32 parameters
    bytes_written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    result = {
        "save_s": saves,
        "load_s": loads,
        "save_s_median": statistics.median(saves),
        "load_s_median": statistics.median(loads),
        "checkpoint_gib": bytes_written / 2**30,
        "export_full_cpu_s": export_s,
        "export_extra_device_gib": export_extra_gib,
        "largest_tensor_gib": largest_gib,
    }
    if variant.startswith("dmuon"):
        atomic = functools.partial(atomic_save, model, optimizer, folder / "atomic")
        result["atomic_save_s"] = timed(device, atomic)
        result["roundtrip_equal"] = roundtrip_equal(model, optimizer, path, device)
    return result


def roundtrip_equal(model, optimizer, path: Path, device: torch.device) -> bool:
    """The loaded weights equal the saved ones (a fresh state dict read back from ``path``)."""
    saved, _ = dckpt.get_state_dict(model, optimizer)
    expected = {key: value.clone() for key, value in saved.items()}
    dcp.load({"model": saved}, checkpoint_id=path)
    same = all(torch.equal(saved[key], expected[key]) for key in expected)
    flag = torch.tensor([int(same)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints are written")
    parser.add_argument("--out", type=Path, default=None)
    own, rest = parser.parse_known_args(argv)
    e2e = bench_e2e.parse_args(["--device", own.device, *(["--quick"] if own.quick else []), *rest])
    for key, value in vars(own).items():
        setattr(e2e, key, value)
    return e2e


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = _common.start_process_group(
        "bench_checkpoint", args.device, backend, "--device cpu --quick"
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    tokens = torch.randint(0, args.model.vocab, (args.micro_batch, args.seq + 1)).to(device)
    folder = Path(tempfile.mkdtemp(prefix="dmuon-bench-ckpt-", dir=args.dir))
    folder_name = [str(folder)]
    dist.broadcast_object_list(folder_name, src=0)  # every rank writes into rank 0's folder
    folder = Path(folder_name[0])
    results = {}
    for variant in VARIANTS:
        results[variant] = measure(variant, args, mesh, device, tokens, folder)
        bench_e2e.free_memory(device)  # the variant's model and optimizer are gone
        if rank == 0:
            r = results[variant]
            print(
                f"  {variant}: save {r['save_s_median']:.2f} s, load {r['load_s_median']:.2f} s, "
                f"{r['checkpoint_gib']:.2f} GiB; export's extra device memory "
                f"{r['export_extra_device_gib']} GiB (largest tensor {r['largest_tensor_gib']:.3f})",
                flush=True,
            )
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        base, ours = results["fsdp2-adamw"], results["dmuon-z3"]
        ratio = (ours["save_s_median"] + ours["load_s_median"]) / (
            base["save_s_median"] + base["load_s_median"]
        )
        label = _common.device_name(device)
        print(f"\nbench_checkpoint: {label} x {world}, torch {torch.__version__}")
        print(f"{'variant':<14}{'save s':>9}{'load s':>9}{'GiB':>8}{'export s':>10}")
        for variant, r in results.items():
            print(
                f"{variant:<14}{r['save_s_median']:>9.2f}{r['load_s_median']:>9.2f}"
                f"{r['checkpoint_gib']:>8.2f}{r['export_full_cpu_s']:>10.2f}"
            )
        print(
            f"dmuon / FSDP2+AdamW save+load: {ratio:.2f}x (target <= {TARGET_RATIO}x: "
            f"{'met' if ratio <= TARGET_RATIO else 'MISSED'}); round trip equal: "
            f"{ours['roundtrip_equal']}"
        )
        date = _common.utc_now()
        record = {
            "benchmark": "bench_checkpoint",
            "inputs": {
                "model": asdict(args.model),
                "repeats": args.repeats,
                "train_steps": args.train_steps,
                "param_dtype": str(args.param_dtype),
            },
            "device": label,
            "world_size": world,
            "backend": dist.get_backend(),
            **_common.versions(dmuon=dmuon.__version__),
            "git_sha": _common.git_sha(),
            "date": _common.iso_seconds(date),
            "timing": "host seconds around each phase after a device synchronisation and a "
            "barrier; slowest rank; median over repeats",
            "results": results,
            "ratio_save_load": ratio,
            "target_ratio": TARGET_RATIO,
        }
        out = args.out
        if out is None and not args.quick:
            out = _common.result_path("checkpoint", label, date, f"w{world}")
        if out is not None:
            _common.write_json(out, record)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
