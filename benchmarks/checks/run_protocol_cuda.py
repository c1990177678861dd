"""The ownership protocol on CUDA tensors, checked against a single-process reference.

Trains the tiny decoder of ``dmuon.testing`` (the CPU protocol tests' model) with
``dedicate_params`` -> ``fully_shard`` per layer and root -> ``dmuon.Muon`` (fp32
Newton-Schulz: ``kernel="cublas"``, ``dtype=torch.float32``) for ``--steps`` steps, and on every
rank the same model in one process on the full batch with the tests' plain reference optimizer
(``dmuon.testing.ReferenceMuonAdamW``). After each step it compares every parameter a rank can see (its owned
fp32 masters and the full FSDP2 parameters) with the reference and keeps the worst relative error
over all ranks.

Configurations, by world size:

- ``1d-z3``: 1-D mesh, reshard after forward (every world size);
- ``1d-z2``: 1-D mesh, weights kept through backward (world size >= 2), and whether it equals
  ``1d-z3`` bit for bit;
- ``hsdp-async`` / ``hsdp-sync``: a ("replicate", "shard") mesh of 2 x (world/2) (even world
  size >= 2), publishing asynchronously / synchronously, and whether they agree bit for bit.

Usage (GPU machine, repository root, packages importable; several gloo ranks share one GPU)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/checks/run_protocol_cuda.py --backend gloo
    python -m torch.distributed.run --nproc-per-node 4 benchmarks/checks/run_protocol_cuda.py --backend gloo
    python -m torch.distributed.run --nproc-per-node 1 benchmarks/checks/run_protocol_cuda.py --backend nccl
    ... --device cpu    # the same on CPU (a smoke test of this script)

Rank 0 prints a table and writes JSON (``--out``, default
``benchmarks/results/protocol-<device>-<backend>-w<world>-<date>.json``). The exit code is 1
when a configuration exceeds ``--tolerance`` or a bit-for-bit check fails.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

# Where the packages are not installed, their sources.
_common.add_package_sources_if_missing()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402

import dmuon  # noqa: E402
from dmuon.testing import (  # noqa: E402
    ReferenceMuonAdamW,
    TinyDecoder,
    batches,
    dedicate_and_shard,
    loss_fn,
    proj_predicate,
    rank_rows,
)
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz  # noqa: E402

REFERENCE = "dmuon.testing.ReferenceMuonAdamW"

LR = 0.02
WEIGHT_DECAY = 0.01
# fp32 Newton-Schulz: dmuon and the reference differ only by the order of float additions
# (the batch is split over ranks, gradients are summed by collectives); tests/distributed uses
# the same bound on CPU.
DEFAULT_TOLERANCE = 1e-5


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    name: str
    replicas: int = 1
    reshard_after_forward: bool = True
    replicate_async: bool = True


def configurations(world: int) -> list[RunConfig]:
    configs = [RunConfig(name="1d-z3")]
    if world >= 2:
        configs.append(RunConfig(name="1d-z2", reshard_after_forward=False))
    if world >= 2 and world % 2 == 0:
        configs.append(RunConfig(name="hsdp-async", replicas=2, replicate_async=True))
        configs.append(RunConfig(name="hsdp-sync", replicas=2, replicate_async=False))
    return configs


# ---- one training run -----------------------------------------------------------------------------


def new_newton_schulz() -> NewtonSchulz:
    return NewtonSchulz(backend="gram", kernel="cublas", dtype=torch.float32)


def build(config: RunConfig, device: torch.device):
    torch.manual_seed(0)
    model = TinyDecoder().to(device)
    dedicate_and_shard(model, device.type, config.replicas, config.reshard_after_forward)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=new_newton_schulz(),
        replicate_async=config.replicate_async,
    )
    return model, optimizer


def build_reference(device: torch.device):
    torch.manual_seed(0)
    reference = TinyDecoder().to(device)
    orthogonalize = functools.partial(
        newton_schulz, backend="gram", kernel="cublas", dtype=torch.float32
    )
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        proj_predicate,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=orthogonalize,
    )
    return reference, optimizer


def visible_weights(model) -> dict[str, tuple[torch.Tensor, tuple[slice, ...]]]:
    """What this rank holds, with the region of the full weight it covers: its owned dedicated
    masters (whole) and its local shard of every FSDP2 parameter.

    Shards are compared in place rather than gathered with ``full_tensor()``: DTensor's
    functional all-gather crashes on gloo with CUDA tensors (torch 2.11), and comparing the
    local shards checks the same numbers without it.
    """
    dedicated = dmuon.inspect.view(model).params
    weights = {
        name: (p.master.detach().clone(), (slice(None),))
        for name, p in dedicated.items()
        if p.master is not None
    }
    for name, param in model.named_parameters():
        if name in dedicated:
            continue
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        region = tuple(slice(start, start + size) for start, size in zip(offset, shape))
        weights[name] = (param.to_local().detach().clone(), region)
    return weights


def max_relative_error(weights, reference) -> float:
    expected = dict(reference.named_parameters())
    errors = []
    for name, (value, region) in weights.items():
        target = expected[name][region]
        if target.numel() == 0:
            continue
        errors.append(((value - target).norm() / target.norm().clamp_min(1e-30)).item())
    return max(errors)


def all_ranks(value: float, op: dist.ReduceOp, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.item()


def train(config: RunConfig, steps: int, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(config, device)
    reference, reference_optimizer = build_reference(device)
    started = time.perf_counter()
    local_losses, losses, reference_losses, max_errors = [], [], [], []
    for batch in batches(steps, world):
        batch = batch.to(device)
        loss = loss_fn(model, rank_rows(batch, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        local_losses.append(loss.item())
        losses.append(all_ranks(loss.item(), dist.ReduceOp.SUM, device) / world)
        reference_loss = loss_fn(reference, batch)
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        reference_losses.append(reference_loss.item())
        error = max_relative_error(visible_weights(model), reference)
        max_errors.append(all_ranks(error, dist.ReduceOp.MAX, device))
    dmuon.wait_all_replicate_broadcasts(model)
    return {
        **asdict(config),
        "mesh": f"{config.replicas} x {world // config.replicas}",
        "max_relative_error_per_step": max_errors,
        "loss_per_step": losses,
        "reference_loss_per_step": reference_losses,
        "seconds": time.perf_counter() - started,
        "partition": dmuon.inspect.view(model).plan.describe(),
        # rank-local, for the bit-for-bit comparisons; not written to JSON
        "_local_losses": local_losses,
        "_weights": visible_weights(model),
    }


def bit_identical(first: dict, second: dict, device: torch.device) -> bool:
    """The same local losses and weights on this rank, on every rank."""
    same = first["_local_losses"] == second["_local_losses"] and first["_weights"].keys() == (
        second["_weights"].keys()
    )
    same = same and all(
        torch.equal(value, second["_weights"][name][0])
        for name, (value, _) in first["_weights"].items()
    )
    return all_ranks(float(same), dist.ReduceOp.MIN, device) == 1.0


# ---- main -------------------------------------------------------------------------------------------


def setup(args: argparse.Namespace) -> torch.device:
    device = _common.start_process_group(
        "run_protocol_cuda", args.device, args.backend, "--device cpu"
    )
    if device.type == "cuda":
        # fp32 means fp32: no TF32 in the model's matmuls or in Newton-Schulz.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument(
        "--configs", nargs="*", default=None, help="subset of 1d-z3 1d-z2 hsdp-async hsdp-sync"
    )
    _common.add_record_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = configurations(world)
    if args.configs is not None:
        unknown = set(args.configs) - {c.name for c in configs}
        if unknown:
            raise SystemExit(
                f"run_protocol_cuda: configurations {sorted(unknown)} do not exist at world size "
                f"{world}; available: {[c.name for c in configs]}"
            )
        configs = [c for c in configs if c.name in args.configs]

    runs = {config.name: train(config, args.steps, device) for config in configs}
    equalities = {}
    if "1d-z3" in runs and "1d-z2" in runs:
        equalities["z2_equals_z3"] = bit_identical(runs["1d-z3"], runs["1d-z2"], device)
    if "hsdp-async" in runs and "hsdp-sync" in runs:
        equalities["sync_equals_async"] = bit_identical(
            runs["hsdp-async"], runs["hsdp-sync"], device
        )

    device_label = _common.device_name(device)
    failures = [
        name
        for name, run in runs.items()
        if run["max_relative_error_per_step"]
        and not max(run["max_relative_error_per_step"]) < args.tolerance
    ] + [name for name, equal in equalities.items() if not equal]
    if rank == 0:
        print(
            f"run_protocol_cuda: {device_label}, backend {args.backend}, world size {world}, "
            f"torch {torch.__version__}; NS {new_newton_schulz()!r}; reference: {REFERENCE}"
        )
        print(
            f"{'config':<11} {'mesh':>6} {'steps':>5} {'max rel err':>12} {'last step':>10} "
            f"{'loss first':>10} {'loss last':>10} {'ref last':>9} {'seconds':>8}"
        )
        for name, run in runs.items():
            errors = run["max_relative_error_per_step"] or [math.nan]
            reference_last = (run["reference_loss_per_step"] or [math.nan])[-1]
            print(
                f"{name:<11} {run['mesh']:>6} {len(run['loss_per_step']):>5} "
                f"{max(errors):>12.3e} {errors[-1]:>10.3e} {run['loss_per_step'][0]:>10.4f} "
                f"{run['loss_per_step'][-1]:>10.4f} {reference_last:>9.4f} "
                f"{run['seconds']:>8.2f}"
            )
        for name, equal in equalities.items():
            print(f"{name}: {'bit-identical' if equal else 'DIFFERENT'}")
        verdict = "FAIL: " + ", ".join(failures) if failures else "ok"
        print(f"tolerance {args.tolerance:.1e}: {verdict}")

        date = _common.utc_now()
        record = run_record(
            "run_protocol_cuda", device, args, runs, equalities, failures, date,
            backend=args.backend, tf32=False if device.type == "cuda" else None,
        )  # fmt: skip
        out = args.out or _common.result_path(
            "protocol", device_label, date, args.backend, f"w{world}"
        )
        _common.write_json(out, record)
    exit_without_teardown(failures)


def run_record(
    benchmark: str,
    device: torch.device,
    args: argparse.Namespace,
    runs: dict[str, dict],
    equalities: dict[str, bool],
    failures: list[str],
    date,
    **fields,
) -> dict:
    """The JSON record of a run against the reference (``fields``: what the script adds)."""
    return {
        "benchmark": benchmark,
        "device": _common.device_name(device),
        "device_type": device.type,
        **fields,
        "world_size": dist.get_world_size(),
        **_common.versions(dmuon=dmuon.__version__),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "steps": args.steps,
        "newton_schulz": repr(new_newton_schulz()),
        "reference": REFERENCE,
        "tolerance": args.tolerance,
        "configs": {
            name: {key: value for key, value in run.items() if not key.startswith("_")}
            for name, run in runs.items()
        },
        "bit_identical": equalities,
        "failures": failures,
    }


def exit_without_teardown(failures: list[str]) -> None:
    """Exit 1 on failures, else 0, skipping the interpreter's shutdown.

    With torch 2.13 on gloo a process sometimes aborts during interpreter shutdown, after
    destroy_process_group() ("terminate called without an active exception"), plain FSDP2
    included. Everything is written and flushed by now: skip that teardown.
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failures else 0)


if __name__ == "__main__":
    sys.exit(main())
