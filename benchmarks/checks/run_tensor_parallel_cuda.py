"""Tensor-parallel dmuon on CUDA tensors, checked against a single-process reference.

The tiny decoder of ``dmuon.testing`` is parallelized with torch's plans on the "tp" dim of a
("dp", "tp") mesh (ColwiseParallel q/gate/up projections, RowwiseParallel o/down projections),
its projections are dedicated over "dp" and the rest goes to FSDP2 (2-D with TP); it trains
``--steps`` steps with fp32 Newton-Schulz, and after each step every weight a rank holds (its
owned masters' TP chunks, its local FSDP2 shards) is compared in place with the same region of
the reference model trained in one process on the full batch (``run_protocol_cuda``'s reference
and comparison: DTensor's functional all-gather cannot run on gloo with CUDA tensors).

Configurations, by world size: ``tp2`` (1 x 2) on 2 ranks; ``dp2-tp2`` (Z3) and ``dp2-tp2-z2``
on 4 ranks, and whether Z2 equals Z3 bit for bit.

Usage (GPU machine, repository root; gloo ranks share one GPU)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/checks/run_tensor_parallel_cuda.py
    python -m torch.distributed.run --nproc-per-node 4 benchmarks/checks/run_tensor_parallel_cuda.py
    ... --device cpu    # the same on CPU (a smoke test of this script)

Rank 0 prints a table and writes JSON (``--out``, default
``benchmarks/results/tensor-parallel-<device>-gloo-w<world>-<date>.json``). The exit code is 1
when a configuration exceeds ``--tolerance`` or the bit-for-bit check fails.
"""

from __future__ import annotations

import argparse
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
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import dmuon  # noqa: E402
from benchmarks.checks.run_protocol_cuda import (  # noqa: E402
    DEFAULT_TOLERANCE,
    REFERENCE,
    all_ranks,
    bit_identical,
    build_reference,
    exit_without_teardown,
    max_relative_error,
    new_newton_schulz,
    run_record,
    visible_weights,
)
from dmuon.testing import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows  # noqa: E402

LR = 0.02
WEIGHT_DECAY = 0.01

# No all-gather in forward (gate_proj, 1 x n, is rowwise: its input is sliced locally and its
# output all-reduced): gloo's functional all-gather of CUDA tensors is what crashes.
PLAN = {
    "layers.*.q_proj": ColwiseParallel(),
    "layers.*.o_proj": RowwiseParallel(),
    "layers.*.gate_proj": RowwiseParallel(input_layouts=Replicate()),
    "layers.*.up_proj": ColwiseParallel(),
    "layers.*.down_proj": RowwiseParallel(),
}


def configurations(world: int) -> dict[str, dict]:
    if world == 2:
        return {"tp2": {"dp": 1, "tp": 2, "reshard_after_forward": True}}
    if world == 4:
        return {
            "dp2-tp2": {"dp": 2, "tp": 2, "reshard_after_forward": True},
            "dp2-tp2-z2": {"dp": 2, "tp": 2, "reshard_after_forward": False},
        }
    raise SystemExit(f"run_tensor_parallel_cuda: run on 2 or 4 ranks, not {world}")


def dedicated_regions(model) -> dict[str, tuple[torch.Tensor, tuple[slice, ...]]]:
    """Owned masters (TP chunks: their region of the full weight) replace the full-weight
    entries of ``visible_weights``; FSDP2's local shards stay as they are."""
    weights = visible_weights(model)
    for name, p in dmuon.inspect.view(model).params.items():
        if p.master is not None:
            weights[name] = (p.master.detach().clone(), p.master_region)
    return weights


def train(name: str, config: dict, steps: int, device: torch.device) -> dict:
    mesh = init_device_mesh(device.type, (config["dp"], config["tp"]), mesh_dim_names=("dp", "tp"))
    dp_rank, dp = mesh["dp"].get_local_rank(), config["dp"]
    torch.manual_seed(0)
    model = TinyDecoder().to(device)
    parallelize_module(model, mesh["tp"], PLAN)
    dmuon.dedicate_params(
        model, mesh["dp"], proj_predicate, reshard_after_forward=config["reshard_after_forward"]
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=config["reshard_after_forward"])
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=config["reshard_after_forward"])
    optimizer = dmuon.Muon(model, lr=LR, weight_decay=WEIGHT_DECAY, ns_backend=new_newton_schulz())
    reference, reference_optimizer = build_reference(device)
    started = time.perf_counter()
    local_losses, reference_losses, max_errors = [], [], []
    for batch in batches(steps, dp):
        batch = batch.to(device)
        loss = loss_fn(model, rank_rows(batch, dp_rank, dp))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        local_losses.append(loss.item())
        reference_loss = loss_fn(reference, batch)
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        reference_losses.append(reference_loss.item())
        error = max_relative_error(dedicated_regions(model), reference)
        max_errors.append(all_ranks(error, dist.ReduceOp.MAX, device))
    return {
        **config,
        "mesh": f"dp {config['dp']} x tp {config['tp']}",
        "max_relative_error_per_step": max_errors,
        "reference_loss_per_step": reference_losses,
        "seconds": time.perf_counter() - started,
        "partition": dmuon.inspect.view(model).plan.describe(),
        "_local_losses": local_losses,
        "_weights": dedicated_regions(model),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    _common.add_record_options(parser)
    args = parser.parse_args(argv)
    device = _common.start_process_group(
        "run_tensor_parallel_cuda", args.device, "gloo", "--device cpu"
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
        torch.backends.cudnn.allow_tf32 = False
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {
        name: train(name, config, args.steps, device)
        for name, config in configurations(world).items()
    }
    equalities = {}
    if "dp2-tp2" in runs:
        equalities["z2_equals_z3"] = bit_identical(runs["dp2-tp2"], runs["dp2-tp2-z2"], device)
    failures = [
        name
        for name, run in runs.items()
        if not max(run["max_relative_error_per_step"]) < args.tolerance
    ] + [name for name, equal in equalities.items() if not equal]
    if rank == 0:
        label = _common.device_name(device)
        print(
            f"run_tensor_parallel_cuda: {label}, gloo, world size {world}, torch "
            f"{torch.__version__}; NS {new_newton_schulz()!r}; reference: {REFERENCE}"
        )
        print(f"{'config':<11} {'mesh':>12} {'steps':>5} {'max rel err':>12} {'seconds':>8}")
        for name, run in runs.items():
            errors = run["max_relative_error_per_step"]
            print(
                f"{name:<11} {run['mesh']:>12} {len(errors):>5} {max(errors):>12.3e} "
                f"{run['seconds']:>8.2f}"
            )
        for name, equal in equalities.items():
            print(f"{name}: {'bit-identical' if equal else 'DIFFERENT'}")
        print(
            f"tolerance {args.tolerance:.1e}: {'FAIL: ' + ', '.join(failures) if failures else 'ok'}"
        )
        date = _common.utc_now()
        record = run_record(
            "run_tensor_parallel_cuda", device, args, runs, equalities, failures, date,
            backend="gloo",
            plan={pattern: type(style).__name__ for pattern, style in PLAN.items()},
        )  # fmt: skip
        out = args.out or _common.result_path("tensor-parallel", label, date, "gloo", f"w{world}")
        _common.write_json(out, record)
    exit_without_teardown(failures)


if __name__ == "__main__":
    sys.exit(main())
