"""What the FSDP2 run adds to dmuon's optimizer step: ``bench_e2e``'s 0.89 B Llama at world size 1,
its ``step()`` profiled inside the FSDP2 run and with the same matrices alone.

Two contexts, each a fresh seeded model trained on the same tokens:

- ``fsdp2``: ``bench_e2e``'s ``dmuon-z3`` (``dedicate_params`` on the ``*proj`` matrices, then
  ``fully_shard`` per layer and root, NCCL, world size 1): what ``bench_e2e`` times;
- ``alone``: the same model and dmuon settings without FSDP2 (``dedicate_params(model, None)``,
  the forward under bf16 autocast): the non-dedicated parameters are plain tensors on the AdamW
  route, the dedicated ones the same matrices with the same Newton-Schulz.

Per context, after ``--warmup`` iterations: ``--steps`` iterations whose ``step()`` starts on an
idle device (synchronised after backward) and is timed with CUDA events and on the host (entry
to return), then one more profiled ``step()``: device time per kernel, summed per kernel class
against the Newton-Schulz FLOP floor of the dedicated matrices (``benchmarks/step/_step_anatomy.py``).
The difference of the two class tables is where the FSDP2 run's extra step time goes.

Usage (GPU machine, repository root)::

    python -m torch.distributed.run --standalone --nproc-per-node 1 \\
        benchmarks/step/profile_opt_step.py --out $OUT/profile-opt-step.json
"""

from __future__ import annotations

import argparse
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
from benchmarks.e2e import bench_e2e  # noqa: E402
from benchmarks.step import _step_anatomy, bench_step  # noqa: E402

CONTEXTS = ("fsdp2", "alone")


def build_alone(args: argparse.Namespace, device: torch.device):
    """``bench_e2e``'s dmuon model and optimizer without FSDP2: every parameter local."""
    torch.manual_seed(0)
    with device:
        model = bench_e2e.Llama(args.model, args.seq, args.checkpoint)
    dtype = args.param_dtype
    dmuon.dedicate_params(
        model,
        None,
        predicate=bench_e2e.is_projection,
        param_policy={"defaults": {"param_dtype": dtype, "reduce_dtype": torch.float32}},
    )
    return model, dmuon.Muon(model, lr=bench_e2e.MUON_LR, adamw_lr=bench_e2e.ADAMW_LR)


def profile_context(context: str, args, mesh, device, tokens, trace: str | None = None) -> dict:
    if context == "fsdp2":
        model, optimizer, _ = bench_e2e.build("dmuon-z3", args, mesh, device)
    else:
        model, optimizer = build_alone(args, device)
    shapes = [
        tuple(view.master.shape)
        for view in dmuon.inspect.view(model).params.values()
        if view.master is not None
    ]

    # Without FSDP2's mixed-precision policy, autocast gives the rest of the model the bf16
    # compute the dedicated weights have; the step's work is the same in both contexts.
    autocast = torch.autocast("cuda", dtype=args.param_dtype, enabled=context == "alone")

    def backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = bench_e2e.loss_of(model, tokens)
        loss.backward()
        torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        backward()
        optimizer.step()
    event_ms, host_ms = [], []
    for _ in range(args.steps):
        backward()
        timer = bench_e2e.Timer(device)
        started = time.perf_counter()
        timer.start()
        optimizer.step()
        host_ms.append((time.perf_counter() - started) * 1e3)
        timer.stop()
        torch.cuda.synchronize(device)
        event_ms.append(timer.ms())
    backward()
    rows = bench_step.kernel_table(optimizer.step, device, trace)
    dmuon.wait_all_replicate_broadcasts(model)
    return {
        "step_ms_median": statistics.median(event_ms),
        "step_host_ms_median": statistics.median(host_ms),
        "step_ms": event_ms,
        "dedicated_matrices": len(shapes),
        "device_kernels": rows[: bench_step.KERNEL_ROWS_KEPT],
        "anatomy": _step_anatomy.anatomy(rows, shapes, bench_step.PEAK_TFLOPS),
    }


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per context")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--trace", default=None, metavar="PREFIX",
        help="write each context's profiled step as a Chrome trace, PREFIX-<context>.json.gz",
    )  # fmt: skip
    _common.add_record_options(parser, "default: benchmarks/results/profile-opt-step-<date>.json")
    options = parser.parse_args(argv)
    args = bench_e2e.parse_args(["--steps", str(options.steps), "--warmup", str(options.warmup)])
    device = _common.start_process_group("profile_opt_step", "cuda", "nccl", "(none: CUDA only)")
    if dist.get_world_size() != 1:
        raise SystemExit("profile_opt_step: run it with --nproc-per-node 1 (world size 1).")
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("shard",))
    tokens = bench_e2e.training_tokens(args, device)
    results = {}
    for context in CONTEXTS:
        trace = f"{options.trace}-{context}.json.gz" if options.trace else None
        results[context] = profile_context(context, args, mesh, device, tokens, trace)
        bench_e2e.free_memory(device)
    record = {
        **bench_e2e.profile_record("profile_opt_step", args, device, options.git_sha),
        "peak_tflops": bench_step.PEAK_TFLOPS,
        "results": results,
    }
    out = options.out or _common.result_path(
        "profile-opt-step", record["device"], _common.utc_now()
    )
    _common.write_json(Path(out), record)
    for context in CONTEXTS:
        result = results[context]
        print(
            f"{context}: step {result['step_ms_median']:.2f} ms (CUDA events, idle device before), "
            f"host {result['step_host_ms_median']:.2f} ms"
        )
        print(_step_anatomy.format_anatomy(f"  {context} by kernel class", result["anatomy"]))
    fsdp2, alone = (results[c]["anatomy"] for c in CONTEXTS)
    print("fsdp2 minus alone, device ms per class:")
    for name in _step_anatomy.CLASSES:
        print(f"  {name:<34} {fsdp2[name]['device_ms'] - alone[name]['device_ms']:+8.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
