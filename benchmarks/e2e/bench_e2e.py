"""End-to-end training step: dmuon against FSDP2 + fused AdamW and naive Muon on FSDP2.

Trains ``dmuon.testing``'s Llama-style decoder (embeddings; per layer RMSNorm, attention q/k/v/o with GQA,
rotary embedding and causal ``F.scaled_dot_product_attention``, RMSNorm, SwiGLU gate/up/down;
final norm; lm_head). The default config (d_model 2048, 16 layers, 16 heads, 8 kv heads, ffn
5632, vocab 32000) has about 1.0 B parameters; sequence 2048, micro-batch 4 per rank, bf16
compute, fp32 parameters. Every variant builds a fresh model from the same seed, in one run:

- ``fsdp2-adamw``: ``fully_shard`` per layer and root with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``torch.optim.AdamW(fused=True)``;
- ``dmuon-z3``: ``dmuon.dedicate_params`` on the ``*proj`` matrices (same dtypes), then the same
  ``fully_shard``, ``dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)``;
- ``dmuon-z2``: the same with ``reshard_after_forward=False`` (dmuon and ``fully_shard``);
- ``dmuon-z3-overlap`` / ``dmuon-z2-overlap`` (not run by default: name them in ``--variants``):
  the same with ``dmuon.Muon(..., overlap_step=True)``, the owner step started during backward
  (the optimizer time then measures only the commit and what was not started early); each
  records the optimizer's ``overlap_stats()`` so a run shows the speculation was committed;
- ``naive-muon``: FSDP2 as in ``fsdp2-adamw``, ``torch.optim.Muon`` on the 2-D ``*proj`` DTensor
  parameters (DTensor runs the Newton-Schulz matmuls with collectives) and fused AdamW on the
  rest. If it fails, its error is recorded as that variant's result and the run goes on.

A dmuon variant takes the opt-in update rules of ``docs/update-rules.md`` as ``+`` suffixes, any
combination: ``+bf16m`` (``momentum_dtype=torch.bfloat16``), ``+int8m`` (``torch.int8``),
``+normuon`` (``normuon=True``),
``+heads`` (``row_blocks``: q_proj, k_proj and v_proj orthogonalised per attention head),
``+offload`` (``offload_masters=True``: the fp32 masters in pinned CPU memory between steps; the
JSON then records ``offloaded_masters_gib``, the masters' bytes on this rank's host), e.g.
``--variants dmuon-z3,dmuon-z3+bf16m,dmuon-z3+normuon+heads,dmuon-z3+offload``.

Per variant: the median over ``--steps`` timed steps (after ``--warmup``) of the whole step
(zero_grad + forward + backward + step; CUDA events, one synchronisation per step; the slowest
rank per step), the optimizer step alone (CUDA events around ``step()``), peak memory per rank
(``max_memory_allocated``), the optimizer state per rank (the bytes of every state tensor, on
CPU too) and the losses (must be finite). On CPU, wall-clock times.

Usage (repository root; on the GPU machine put the package sources on PYTHONPATH)::

    python -m torch.distributed.run --nproc-per-node 1 benchmarks/e2e/bench_e2e.py
    python -m torch.distributed.run --nproc-per-node 8 benchmarks/e2e/bench_e2e.py --variants fsdp2-adamw,dmuon-z3
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/e2e/bench_e2e.py --device cpu --quick
    python -m torch.distributed.run --nproc-per-node 4 benchmarks/e2e/bench_e2e.py --backend gloo  # one GPU

Rank 0 prints a table and writes JSON (``--out``; default
``benchmarks/results/e2e-<gpu>-w<world>-<date>.json``, none with ``--quick`` unless given).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

_common.add_package_sources_if_missing()  # before dmuon is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import dmuon  # noqa: E402
from dmuon.testing import Llama, LlamaConfig, next_token_loss, proj_predicate  # noqa: E402

VARIANTS = (
    "fsdp2-adamw",
    "dmuon-z3",
    "dmuon-z2",
    "naive-muon",
    "dmuon-z3-overlap",
    "dmuon-z2-overlap",
)
# "+" suffixes of a dmuon variant -> what they change (docs/update-rules.md).
RULE_SUFFIXES = ("bf16m", "int8m", "normuon", "heads", "offload")
DEFAULT_VARIANTS = VARIANTS[:4]
STEP_TARGET = 1.03  # dmuon step time at most 1.03x FSDP2 + AdamW
OPTIMIZER_TARGET = 3.0  # dmuon's optimizer step at least 3x faster than naive Muon's
MUON_LR, ADAMW_LR = 0.02, 1e-3


# ---- the model: dmuon.testing's Llama-style decoder ---------------------------------------------

# Under the names the scripts built on this one import (bench_convergence, profile_host, ...).
ModelConfig = LlamaConfig
QUICK_CONFIG = ModelConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=160)
is_projection = proj_predicate
loss_of = next_token_loss


# ---- the variants -----------------------------------------------------------------------------


class Optimizers:
    """Several optimizers stepped as one (naive Muon on the matrices + AdamW on the rest)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def build(variant: str, args: argparse.Namespace, mesh, device: torch.device):
    """(model, optimizer, extra JSON fields) of one variant, from a fresh seeded model."""
    torch.manual_seed(0)
    with device:
        model = Llama(args.model, args.seq, args.checkpoint)
    dtype = args.param_dtype
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    base, *rules = variant.split("+")
    reshard = not base.startswith("dmuon-z2")
    extra: dict = {}
    if variant.startswith("dmuon"):
        head_dim = args.model.dim // args.model.heads
        dmuon.dedicate_params(
            model,
            mesh,
            predicate=is_projection,
            reshard_after_forward=reshard,
            param_policy={"defaults": {"param_dtype": dtype, "reduce_dtype": torch.float32}},
            row_blocks={"layers.*.attn.[qkv]_proj.weight": head_dim} if "heads" in rules else None,
        )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    if variant == "fsdp2-adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, fused=True)
    elif variant.startswith("dmuon"):
        momentum_dtypes = {"bf16m": torch.bfloat16, "int8m": torch.int8}
        momentum_dtype = next((momentum_dtypes[r] for r in rules if r in momentum_dtypes), None)
        optimizer = dmuon.Muon(
            model,
            lr=MUON_LR,
            adamw_lr=ADAMW_LR,
            overlap_step=base.endswith("-overlap"),
            normuon="normuon" in rules,
            momentum_dtype=momentum_dtype or torch.float32,
            offload_masters="offload" in rules,
        )
        if "offload" in rules:  # the Muon route's fp32 masters: their bytes live on the host
            extra["offloaded_masters_gib"] = (
                sum(
                    master.numel() * 4
                    for group in optimizer.param_groups
                    if group["route"] == "muon"
                    for master in group["params"]
                )
                / 2**30
            )
        newton_schulz = optimizer.newton_schulz
        extra["partition"] = dmuon.inspect.view(model).plan.describe()
        extra["newton_schulz"] = repr(newton_schulz)
        extra["ns_kernel"] = f"{newton_schulz.kernel} ({newton_schulz.kernel_reason})"
    else:
        named = list(model.named_parameters())
        matrices = [p for name, p in named if is_projection(name, p)]
        rest = [p for name, p in named if not is_projection(name, p)]
        extra["naive_muon_params"] = len(matrices)
        optimizer = Optimizers(
            torch.optim.Muon(
                matrices, lr=MUON_LR, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"
            ),
            torch.optim.AdamW(rest, lr=ADAMW_LR, fused=True),
        )
    return model, optimizer, extra


class Timer:
    """Milliseconds between start() and stop(): CUDA events on CUDA, the wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.begin.record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.stopped = time.perf_counter()

    def ms(self) -> float:
        """Valid once the device is synchronised."""
        if self.cuda:
            return self.begin.elapsed_time(self.end)
        return (self.stopped - self.started) * 1e3


def measure(variant: str, args, mesh, device: torch.device, tokens: torch.Tensor) -> dict:
    """This rank's per-step times, losses and peak memory for one variant."""
    # What earlier variants left allocated (caches) counts in this variant's peak.
    allocated_before = (
        torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    )
    model, optimizer, extra = build(variant, args, mesh, device)
    step_ms, optimizer_ms, losses = [], [], []
    for index in range(args.warmup + args.steps):
        step_timer, optimizer_timer = Timer(device), Timer(device)
        step_timer.start()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer_timer.start()
        optimizer.step()
        optimizer_timer.stop()
        step_timer.stop()
        _common.synchronize(device)
        losses.append(loss.item())
        if index >= args.warmup:
            step_ms.append(step_timer.ms())
            optimizer_ms.append(optimizer_timer.ms())
    if variant.startswith("dmuon"):
        dmuon.wait_all_replicate_broadcasts(model)
    if variant.split("+")[0].endswith("-overlap"):
        extra["overlap_stats"] = asdict(optimizer.overlap_stats())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "step_ms": step_ms,
        "optimizer_ms": optimizer_ms,
        "losses": losses,
        "peak_gib": peak,
        "optimizer_state_gib": optimizer_state_bytes(optimizer) / 2**30,
        "allocated_before_gib": allocated_before,
        **extra,
    }


def optimizer_state_bytes(optimizer) -> int:
    """The bytes of every tensor in this rank's optimizer state (DTensors: the local shard)."""
    total = 0
    for one in getattr(optimizer, "optimizers", (optimizer,)):
        for state in one.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    total += local.numel() * local.element_size()
    return total


def run_variant(variant: str, args, mesh, device: torch.device, tokens) -> dict:
    """Measure on every rank, then combine on all: slowest rank per step, median over steps."""
    free_memory(device)
    # A failing variant is recorded and the run goes on (naive Muon on DTensors may be refused;
    # an out-of-memory in one variant should not lose the others' numbers). A failure on some
    # ranks only can still hang the others in a collective: that is left to the launcher.
    try:
        local = measure(variant, args, mesh, device, tokens)
    except Exception as error:
        local = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    free_memory(device)
    ranks: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(ranks, local)
    errors = sorted({r["error"] for r in ranks if "error" in r})
    if errors:
        return {"error": errors[0], "errors": errors, "traceback": ranks[0].get("traceback")}
    step_ms = [max(per_rank) for per_rank in zip(*(r["step_ms"] for r in ranks))]
    optimizer_ms = [max(per_rank) for per_rank in zip(*(r["optimizer_ms"] for r in ranks))]
    losses = [r["losses"] for r in ranks]
    per_rank_keys = (
        "step_ms",
        "optimizer_ms",
        "losses",
        "peak_gib",
        "allocated_before_gib",
        "optimizer_state_gib",
    )
    result = {key: value for key, value in ranks[0].items() if key not in per_rank_keys}
    result.update(
        step_ms_median=statistics.median(step_ms),
        optimizer_ms_median=statistics.median(optimizer_ms),
        step_ms=step_ms,
        optimizer_ms=optimizer_ms,
        peak_gib_per_rank=[r["peak_gib"] for r in ranks],
        optimizer_state_gib_per_rank=[r["optimizer_state_gib"] for r in ranks],
        allocated_before_gib_per_rank=[r["allocated_before_gib"] for r in ranks],
        losses_per_rank=losses,
        losses_finite=all(math.isfinite(x) for per_rank in losses for x in per_rank),
    )
    return result


def training_tokens(args: argparse.Namespace, device: torch.device, rank: int = 0) -> torch.Tensor:
    """This rank's (micro-batch, seq + 1) token ids, the same in every run."""
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    return torch.randint(
        0, args.model.vocab, (args.micro_batch, args.seq + 1), generator=generator
    ).to(device)


def profile_record(benchmark: str, args: argparse.Namespace, device, git_sha) -> dict:
    """The head of a profiling script's JSON about this model: what ran, where, on what."""
    return {
        "benchmark": benchmark,
        "device": _common.device_name(device),
        **_common.versions(dmuon=dmuon.__version__),
        "git_sha": _common.git_sha(git_sha),
        "date": _common.iso_seconds(_common.utc_now()),
        "model": vars(args.model),
        "seq": args.seq,
        "micro_batch": args.micro_batch,
    }


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---- report -----------------------------------------------------------------------------------


def targets(results: dict, world: int) -> list[dict]:
    """The two goals, evaluated for each dmuon variant present."""
    evaluations = []
    baseline = results.get("fsdp2-adamw", {}).get("step_ms_median")
    naive = results.get("naive-muon", {})
    for name in (
        v for v in results if v.startswith("dmuon") and "+" not in v and "error" not in results[v]
    ):
        result = results[name]
        if baseline is not None:
            ratio = result["step_ms_median"] / baseline
            evaluations.append(
                dict(
                    target=f"{name} step <= {STEP_TARGET}x fsdp2-adamw",
                    value=f"{ratio:.3f}x",
                    met=ratio <= STEP_TARGET,
                )
            )
        if "optimizer_ms_median" in naive:
            speedup = naive["optimizer_ms_median"] / result["optimizer_ms_median"]
            evaluations.append(
                dict(
                    target=f"{name} optimizer step >= {OPTIMIZER_TARGET}x faster than naive-muon",
                    value=f"{speedup:.2f}x",
                    met=speedup >= OPTIMIZER_TARGET,
                )
            )
        elif "error" in naive:
            evaluations.append(
                dict(
                    target=f"{name} optimizer step >= {OPTIMIZER_TARGET}x faster than naive-muon",
                    value="naive-muon failed: " + naive["error"].splitlines()[0][:120],
                    met=None,
                )
            )
    if world == 1:
        for evaluation in evaluations:
            evaluation["note"] = "not meaningful at world size 1: no communication"
    return evaluations


def print_report(header: str, results: dict, evaluations: list[dict]) -> None:
    print(header)
    width = max(12, *(len(name) for name in results))
    print(
        f"{'variant':<{width}} {'step ms':>9} {'vs fsdp2':>9} {'opt ms':>9} {'naive/opt':>10} "
        f"{'peak GiB':>9} {'state MiB':>10} {'loss first->last':>18}"
    )
    baseline = results.get("fsdp2-adamw", {}).get("step_ms_median")
    naive = results.get("naive-muon", {}).get("optimizer_ms_median")
    for name, result in results.items():
        if "error" in result:
            print(f"{name:<{width}} FAILED: {result['error']}")
            continue
        step, opt = result["step_ms_median"], result["optimizer_ms_median"]
        vs_fsdp2 = f"{step / baseline:.3f}x" if baseline else "-"
        vs_naive = f"{naive / opt:.2f}x" if naive and name.startswith("dmuon") else "-"
        peaks = [p for p in result["peak_gib_per_rank"] if p is not None]
        peak = f"{max(peaks):.2f}" if peaks else "-"
        state = f"{max(result['optimizer_state_gib_per_rank']) * 1024:.1f}"  # the fullest rank
        losses = result["losses_per_rank"][0]
        finite = "" if result["losses_finite"] else " NOT FINITE"
        print(
            f"{name:<{width}} {step:>9.2f} {vs_fsdp2:>9} {opt:>9.2f} {vs_naive:>10} {peak:>9} "
            f"{state:>10} {losses[0]:>8.4f}->{losses[-1]:<8.4f}{finite}"
        )
    for evaluation in evaluations:
        verdict = {True: "met", False: "not met", None: "not evaluable"}[evaluation["met"]]
        note = f" ({evaluation['note']})" if "note" in evaluation else ""
        print(f"target: {evaluation['target']}: {evaluation['value']} -> {verdict}{note}")
    for name, result in results.items():
        if "traceback" in result:
            print(f"{name} failed on rank 0 with:\n{result['traceback']}")
        if "partition" in result:
            print(f"{name}: {result['partition']}; NS kernel {result['ns_kernel']}")


# ---- setup and main ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model, seq 64 (smoke test)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None, help="d_model (ffn scales with it)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (64 with --quick)")
    parser.add_argument("--micro-batch", type=int, default=None, help="per rank; default 4 (2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps; default 10 (3)")
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma list of " + ", ".join(VARIANTS) + f" (default {','.join(DEFAULT_VARIANTS)})",
    )
    parser.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="non-reentrant activation checkpointing per layer (default on)",
    )
    parser.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default nccl on CUDA; gloo runs several ranks on CUDA tensors of one GPU",
    )
    _common.add_record_options(parser, "default: benchmarks/results/e2e-<gpu>-w<world>-<date>.json")
    args = parser.parse_args(argv)
    quick = args.quick
    model = QUICK_CONFIG if quick else ModelConfig()
    dim = args.dim or model.dim
    args.model = ModelConfig(
        vocab=model.vocab,
        dim=dim,
        layers=args.layers or model.layers,
        heads=model.heads,
        kv_heads=model.kv_heads,
        ffn=model.ffn * dim // model.dim,
    )
    args.seq = args.seq or (64 if quick else 2048)
    args.micro_batch = args.micro_batch or (2 if quick else 4)
    args.steps = args.steps if args.steps is not None else (3 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    args.param_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.param_dtype]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(
        v
        for v in args.variants
        if v.split("+")[0] not in VARIANTS
        or ("+" in v and not v.startswith("dmuon"))
        or not set(v.split("+")[1:]) <= set(RULE_SUFFIXES)
    )
    if unknown:
        parser.error(
            f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}, a dmuon variant "
            f"with '+' suffixes from {', '.join(RULE_SUFFIXES)} (dmuon-z3+bf16m+normuon)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    args = parse_args(argv)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    device = _common.start_process_group("bench_e2e", args.device, backend, "--device cpu --quick")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    tokens = training_tokens(args, device, rank)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in Llama(args.model, 1, False).parameters())
    device_label = _common.device_name(device)
    header = (
        f"bench_e2e: {device_label} x {world} ({dist.get_backend()}), torch {torch.__version__}; "
        f"Llama {num_params / 1e6:,.1f} M params ({asdict(args.model)}), seq {args.seq}, "
        f"micro-batch {args.micro_batch}/rank, compute {args.param_dtype}, fp32 params; "
        f"activation checkpointing {'ON' if args.checkpoint else 'off'}; "
        f"median of {args.steps} steps after {args.warmup} warm-up (slowest rank per step)"
    )
    if rank == 0:
        print(header, flush=True)

    results = {}
    for variant in args.variants:
        started = time.perf_counter()
        results[variant] = run_variant(variant, args, mesh, device, tokens)
        results[variant]["seconds"] = time.perf_counter() - started
        if rank == 0:
            summary = results[variant].get("error") or (
                f"step {results[variant]['step_ms_median']:.2f} ms, "
                f"optimizer {results[variant]['optimizer_ms_median']:.2f} ms"
            )
            print(f"  {variant}: {summary} ({results[variant]['seconds']:.1f} s)", flush=True)

    evaluations = targets(results, world)
    if rank == 0:
        print()
        print_report(header, results, evaluations)
        date = _common.utc_now()
        record = {
            "benchmark": "bench_e2e",
            "inputs": {
                "model": asdict(args.model),
                "num_params": num_params,
                "seq": args.seq,
                "micro_batch": args.micro_batch,
                "steps": args.steps,
                "warmup": args.warmup,
                "checkpoint": args.checkpoint,
                "param_dtype": str(args.param_dtype),
                "variants": args.variants,
                "quick": args.quick,
                "muon_lr": MUON_LR,
                "adamw_lr": ADAMW_LR,
            },
            "device": device_label,
            "world_size": world,
            "backend": dist.get_backend(),
            **_common.versions(dmuon=dmuon.__version__),
            "ns_backend": dmuon.get_ns_backend(),
            "git_sha": _common.git_sha(args.git_sha),
            "date": _common.iso_seconds(date),
            "timing": "per step: CUDA events around zero_grad+forward+backward+step (wall clock "
            "on CPU), one synchronisation per step; max over ranks, then median over steps",
            "env": _common.dmuon_environment(),
            "targets": evaluations,
            "results": results,
        }
        out = args.out
        if out is None and not args.quick:
            out = _common.result_path("e2e", device_label, date, f"w{world}")
        if out is not None:
            _common.write_json(out, record)
    dist.destroy_process_group()
    # Exit 1 when a variant other than naive Muon failed or produced a non-finite loss.
    failed = [v for v, r in results.items() if v != "naive-muon" and not r.get("losses_finite")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
