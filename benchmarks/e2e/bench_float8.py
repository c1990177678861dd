"""float8 training with dedicated weights: dmuon + torchao float8 against FSDP2 + AdamW + float8.

One GPU (world size 1, ``torch.distributed`` initialised: NCCL on CUDA, gloo on the CPU), one
model, the same data and seed for every arm: ``dmuon.testing``'s Llama (RMSNorm, rotary
attention with GQA, SwiGLU) at d_model 2048, 4 layers, 16 heads, 8 kv heads, ffn 5632,
vocabulary 32000 (about 320 M parameters), sequence 2048, batch 4, bf16 compute
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; dmuon's ``param_policy`` the
same), ``fully_shard`` per layer and on the root for every arm. The arms (``--arms``, any subset
in this order):

- ``fsdp2-adamw``: ``torch.optim.AdamW`` (fused on CUDA), betas (0.9, 0.95), weight decay 0.1 on
  the matrices, lr ``--adamw-lr``;
- ``fsdp2-adamw-float8-tensorwise`` / ``-rowwise``: the same after
  ``torchao.float8.convert_to_float8_training`` of every ``*proj`` linear (not ``lm_head``, as
  torchtitan's converter), with that recipe; tensorwise as torchtitan runs it with FSDP2:
  ``enable_fsdp_float8_all_gather=True`` and ``precompute_float8_dynamic_scale_for_fsdp`` after
  each step (rowwise cannot gather in float8);
- ``dmuon``: ``dmuon.dedicate_params`` on the ``*proj`` matrices, then the same ``fully_shard``,
  ``dmuon.Muon(model, lr=--muon-lr, adamw_lr=--adamw-lr)``;
- ``dmuon-float8-tensorwise`` / ``-rowwise``: the same float8 conversion *before*
  ``dedicate_params`` ([Note: float8 training on dedicated weights] in ``dmuon.float8``): the
  owner keeps the fp32 masters, the dedicated weight is broadcast in bf16 and cast to float8 by
  torchao in each forward.

Every arm: linear warm-up over the first 10 % of the steps, then cosine decay to 10 % of the
peak (``LambdaLR``). Recorded per arm: the training loss of every step (the curve), the mean of
the last 10 % of them, the loss on ``EVAL_ROWS`` held-out rows after the last step, the median
step time over the steps after ``--warmup`` (zero_grad + forward + backward + step [+ the float8
scale precompute]; CUDA events, one synchronisation per step; wall clock on the CPU), tokens per
second at that median, and peak memory (``max_memory_allocated``, reset before the arm's model is
built). An arm that fails is recorded with its error, the run goes on and exits with 1.

The data, unless ``--data``: deterministic synthetic tokens with structure, the same for every
arm. Each row of seq + 1 tokens is a first-order Markov chain over the vocabulary (every token
has ``SUCCESSORS`` successors drawn once, with Zipf-like probabilities, the same for every token)
for its first half, and a copy of the first half after it: a model learns the chain (bigram
statistics) and, with attention, the copy. The loss floor (the chain's entropy on the first half,
0 on the copy) is recorded as ``loss_floor``. ``--data FILE``: the Shakespeare bytes of
``bench_convergence --prepare`` instead (vocabulary 256; windows of the training text in a seeded
order, held-out rows from its validation plays).

``--compile``: ``torch.compile`` each layer after ``fully_shard`` (torchao's float8 casts are
separate kernels in eager mode; torchtitan compiles float8 runs). It is off by default: the
default run measures eager mode, where float8's casts cost what they cost.

Usage (repository root; on the GPU machine ``source .gpu/setup.sh`` first, for torchao)::

    python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/e2e/bench_float8.py
    python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/e2e/bench_float8.py \\
        --compile --out $OUT/float8-compiled.json
    python benchmarks/e2e/bench_float8.py --device cpu --quick   # the CPU smoke run (tiny model)

Without torchrun the script makes itself a world of one. The CPU smoke run (``--quick``: the
tiny ``QUICK_CONFIG`` model in fp32, seq 64, 12 steps) runs torchao's float8 casts and matmuls on
the CPU, as ``tests/distributed/test_float8.py`` does. The default GPU run is about 6 x 200 steps
of about 0.1 s on an H100.

JSON (``--out``; default ``benchmarks/results/float8-<device>-<date>.json``, none with
``--quick`` unless given): the GPU name, torch / CUDA / torchao / dmuon versions, git sha, date,
model, data and per arm the curve and figures above. A table is printed last. The plot (loss
curves and step times, next to the JSON as ``<stem>.png``)::

    python benchmarks/e2e/bench_float8.py --plot benchmarks/results/float8-....json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
import traceback
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
from benchmarks.e2e.bench_convergence import Windows, load, lr_factor  # noqa: E402
from benchmarks.e2e.bench_e2e import QUICK_CONFIG, Timer  # noqa: E402
from dmuon.testing import Llama, LlamaConfig, next_token_loss, proj_predicate  # noqa: E402

BENCHMARK = "float8"
ARMS = (
    "fsdp2-adamw",
    "fsdp2-adamw-float8-tensorwise",
    "fsdp2-adamw-float8-rowwise",
    "dmuon",
    "dmuon-float8-tensorwise",
    "dmuon-float8-rowwise",
)
RECIPES = ("tensorwise", "rowwise")
MODEL = LlamaConfig(vocab=32000, dim=2048, layers=4, heads=16, kv_heads=8, ffn=5632)
SEQ, BATCH, STEPS, WARMUP = 2048, 4, 200, 20
QUICK_SEQ, QUICK_BATCH, QUICK_STEPS, QUICK_WARMUP = 64, 4, 12, 4
ADAMW_LR, MUON_LR = 1e-3, 0.02
ADAMW_BETAS, ADAMW_WEIGHT_DECAY = (0.9, 0.95), 0.1
WARMUP_FRACTION, FINAL_LR_FRACTION = 0.1, 0.1
SUCCESSORS = 8  # per token of the synthetic chain
EVAL_ROWS, QUICK_EVAL_ROWS = 16, 4
DATA_SEED, EVAL_SEED, MODEL_SEED = 1, 2, 0


# ---- the data ---------------------------------------------------------------------------------


def successor_weights() -> torch.Tensor:
    """The chain's probabilities of a token's ``SUCCESSORS`` successors: Zipf-like, 1/(k+1)."""
    weights = 1.0 / torch.arange(1, SUCCESSORS + 1, dtype=torch.float64)
    return weights / weights.sum()


def chain_rows(vocab: int, rows: int, seq: int, seed: int) -> torch.Tensor:
    """(rows, seq + 1) token ids: a Markov chain over the first half, copied after it.

    The successor table is drawn from ``DATA_SEED`` (one chain for every split); ``seed`` draws
    the rows' walks. On the CPU, so every device gets the same tokens."""
    table = torch.randint(
        0, vocab, (vocab, SUCCESSORS), generator=torch.Generator().manual_seed(DATA_SEED)
    )
    generator = torch.Generator().manual_seed(seed)
    half = (seq + 2) // 2
    walk = torch.empty(rows, half, dtype=torch.long)
    walk[:, 0] = torch.randint(0, vocab, (rows,), generator=generator)
    choices = torch.multinomial(
        successor_weights().float(), rows * (half - 1), replacement=True, generator=generator
    ).view(rows, half - 1)
    for position in range(1, half):
        walk[:, position] = table[walk[:, position - 1], choices[:, position - 1]]
    return torch.cat((walk, walk), dim=1)[:, : seq + 1]


def chain_loss_floor(seq: int) -> float:
    """The mean loss of a model that knows the chain and copies: the chain's entropy on the
    predicted positions of the first half, 0 on the copy."""
    weights = successor_weights()
    entropy = float(-(weights * weights.log()).sum())
    half = (seq + 2) // 2
    return entropy * (half - 1) / seq


class Data:
    """Every step's (batch, seq + 1) tokens and the held-out rows, on the device."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        rows = args.steps * args.batch
        eval_rows = QUICK_EVAL_ROWS if args.quick else EVAL_ROWS
        if args.data is None:
            self.train = chain_rows(args.model.vocab, rows, args.seq, seed=10).to(device)
            self.eval = chain_rows(args.model.vocab, eval_rows, args.seq, seed=EVAL_SEED)
            self.eval = self.eval.to(device)
            self.meta = {
                "kind": "markov-chain-then-copy",
                "successors": SUCCESSORS,
                "loss_floor": chain_loss_floor(args.seq),
            }
        else:
            train_bytes, val_bytes, meta = load(args.data)
            train, val = (
                Windows(train_bytes, args.seq, device),
                Windows(val_bytes, args.seq, device),
            )
            order = torch.randperm(train.count, generator=torch.Generator().manual_seed(DATA_SEED))
            if rows > train.count:
                raise SystemExit(
                    f"{BENCHMARK}: --steps {args.steps} x --batch {args.batch} = {rows} windows, "
                    f"but {args.data} has {train.count} at seq {args.seq}; lower --steps."
                )
            self.train = train.take(order[:rows].to(device))
            spaced = torch.linspace(0, val.count - 1, eval_rows).long()
            self.eval = val.take(spaced.to(device))
            self.meta = {"kind": "shakespeare-bytes", "file": str(args.data), **meta}
        self.batch = args.batch

    def step(self, index: int) -> torch.Tensor:
        return self.train[index * self.batch : (index + 1) * self.batch]


# ---- the arms ---------------------------------------------------------------------------------


def recipe_of(arm: str) -> str | None:
    return arm.rsplit("-", 1)[1] if "-float8-" in arm else None


def float8_config(arm: str):
    """torchao's config of a float8 arm: the recipe's; FSDP2's tensorwise with the float8
    all-gather, as torchtitan sets it."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe_of(arm))
    if arm == "fsdp2-adamw-float8-tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def build(arm: str, args: argparse.Namespace, mesh, device: torch.device):
    """(model, optimizer, after_step, extra JSON fields) of one arm, from the seeded model."""
    torch.manual_seed(MODEL_SEED)
    with device:
        model = Llama(args.model, args.seq, checkpoint_layers=False)
    extra: dict = {}
    after_step = None
    if recipe_of(arm) is not None:
        from torchao.float8 import convert_to_float8_training

        config = float8_config(arm)
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda module, fqn: "proj" in fqn
        )
        extra["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        extra["float8_all_gather"] = config.enable_fsdp_float8_all_gather
        if config.enable_fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            def after_step() -> None:
                precompute_float8_dynamic_scale_for_fsdp(model)

    mixed = args.param_dtype != torch.float32
    mp_policy = MixedPrecisionPolicy(
        param_dtype=args.param_dtype if mixed else None,
        reduce_dtype=torch.float32 if mixed else None,
    )
    if arm.startswith("dmuon"):
        dmuon.dedicate_params(
            model,
            mesh,
            predicate=proj_predicate,
            param_policy=(
                {"defaults": {"param_dtype": args.param_dtype, "reduce_dtype": torch.float32}}
                if mixed
                else None
            ),
        )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if args.compile:
        for layer in model.layers:
            layer.compile()
    if arm.startswith("dmuon"):
        optimizer = dmuon.Muon(model, lr=args.muon_lr, adamw_lr=args.adamw_lr)
        extra["newton_schulz"] = repr(optimizer.newton_schulz)
        extra["dedicated_modules"] = sorted(
            {
                type(model.get_submodule(name.rpartition(".")[0])).__name__
                for name in dmuon.inspect.view(model).params
            }
        )
    else:
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": ADAMW_WEIGHT_DECAY},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=args.adamw_lr,
            betas=ADAMW_BETAS,
            fused=device.type == "cuda",
        )
    return model, optimizer, after_step, extra


def evaluate(model, data: Data) -> float:
    with torch.no_grad():
        return sum(
            next_token_loss(model, data.eval[start : start + data.batch]).item()
            * len(data.eval[start : start + data.batch])
            for start in range(0, len(data.eval), data.batch)
        ) / len(data.eval)


def run_arm(arm: str, args, mesh, device: torch.device, data: Data) -> dict:
    """One arm's curve, step times and peak memory; its error instead if it fails."""
    free_memory(device)
    started = time.perf_counter()
    try:
        model, optimizer, after_step, extra = build(arm, args, mesh, device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, args.steps, WARMUP_FRACTION, FINAL_LR_FRACTION)
        )
        losses, step_ms = [], []
        for index in range(args.steps):
            timer = Timer(device)
            timer.start()
            optimizer.zero_grad(set_to_none=True)
            loss = next_token_loss(model, data.step(index))
            loss.backward()
            optimizer.step()
            if after_step is not None:
                after_step()
            timer.stop()
            scheduler.step()
            _common.synchronize(device)
            losses.append(loss.item())
            if index >= args.warmup:
                step_ms.append(timer.ms())
        eval_loss = evaluate(model, data)
    except Exception as error:
        print(f"{arm}: failed: {type(error).__name__}: {error}", flush=True)
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    median = statistics.median(step_ms)
    tail = losses[-max(1, len(losses) // 10) :]
    result = {
        "losses": losses,
        "losses_finite": all(math.isfinite(x) for x in losses),
        "final_loss_mean": sum(tail) / len(tail),
        "eval_loss": eval_loss,
        "step_ms": step_ms,
        "step_ms_median": median,
        "tokens_per_second": args.batch * args.seq / (median / 1e3),
        "peak_gib": peak,
        "wall_seconds": time.perf_counter() - started,
        **extra,
    }
    print(
        f"{arm}: step {median:.1f} ms, loss {losses[0]:.3f} -> {result['final_loss_mean']:.3f}, "
        f"eval {eval_loss:.3f}" + (f", peak {peak:.1f} GiB" if peak is not None else ""),
        flush=True,
    )
    del model, optimizer, scheduler
    free_memory(device)
    return result


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---- report -----------------------------------------------------------------------------------


def print_table(results: dict, floor: float | None) -> None:
    baseline = results.get("fsdp2-adamw", {}).get("step_ms_median")
    print()
    print(
        f"{'arm':32} {'step ms':>8} {'x fsdp2':>8} {'tok/s':>9} {'peak GiB':>9} "
        f"{'loss end':>9} {'eval':>7}"
    )
    for arm, result in results.items():
        if "error" in result:
            print(f"{arm:32} failed: {result['error'][:80]}")
            continue
        ratio = f"{result['step_ms_median'] / baseline:.3f}" if baseline else "-"
        peak = f"{result['peak_gib']:.2f}" if result["peak_gib"] is not None else "-"
        print(
            f"{arm:32} {result['step_ms_median']:8.1f} {ratio:>8} "
            f"{result['tokens_per_second']:9.0f} {peak:>9} {result['final_loss_mean']:9.4f} "
            f"{result['eval_loss']:7.4f}"
        )
    if floor is not None:
        print(f"(the synthetic data's loss floor: {floor:.4f})")


PLOT_SMOOTHING = 10  # steps in the plot's running mean of the training loss


def plot(results: Path, png: Path | None) -> Path:
    """The training loss of every arm against the step (a running mean over ``PLOT_SMOOTHING``
    steps; dmuon solid, FSDP2 + AdamW dashed, one colour per precision) and the median step
    times as bars."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(results.read_text())
    arms = {arm: r for arm, r in record["arms"].items() if "error" not in r}
    colors = {"bf16": "tab:blue", "tensorwise": "tab:orange", "rowwise": "tab:green"}
    figure, (curves, bars) = plt.subplots(
        1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [2, 1]}
    )
    for arm, result in arms.items():
        losses = result["losses"]
        window = min(PLOT_SMOOTHING, len(losses))
        smoothed = [
            sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
            for i in range(len(losses))
        ]
        precision = recipe_of(arm) or "bf16"
        curves.plot(
            range(1, len(losses) + 1),
            smoothed,
            color=colors[precision],
            linestyle="-" if arm.startswith("dmuon") else "--",
            linewidth=1.5,
            label=arm,
        )
    floor = record["data"].get("loss_floor")
    if floor is not None:
        curves.axhline(floor, color="gray", linestyle=":", linewidth=1, label="loss floor")
    curves.set_xlabel("step")
    curves.set_ylabel(f"training loss (running mean of {PLOT_SMOOTHING} steps)")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    names = list(arms)
    bars.barh(
        names,
        [arms[arm]["step_ms_median"] for arm in names],
        color=[colors[recipe_of(arm) or "bf16"] for arm in names],
    )
    bars.invert_yaxis()
    bars.set_xlabel("median step time (ms)")
    bars.tick_params(axis="y", labelsize=7)
    model = record["model"]
    figure.suptitle(
        f"float8 with dedicated weights: {record['num_params'] / 1e6:.1f} M params (d "
        f"{model['dim']}, {model['layers']} layers), seq {record['seq']} x batch "
        f"{record['batch']}, {record['device']}, torch {record['torch']}, torchao "
        f"{record['torchao']}" + (", compiled layers" if record["compile"] else ""),
        fontsize=9,
    )
    figure.tight_layout()
    png = png or results.with_suffix(".png")
    figure.savefig(png, dpi=110)
    print(f"wrote {png}")
    return png


# ---- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="the tiny CPU smoke configuration")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"any of {', '.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="steps not timed")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None, help=f"default {MODEL.layers}")
    parser.add_argument("--adamw-lr", type=float, default=ADAMW_LR)
    parser.add_argument("--muon-lr", type=float, default=MUON_LR)
    parser.add_argument("--compile", action="store_true", help="torch.compile each layer")
    parser.add_argument("--data", type=Path, default=None, help="bench_convergence's .npz")
    parser.add_argument(
        "--plot", type=Path, default=None, help="a result JSON: draw it, run nothing"
    )
    parser.add_argument("--png", type=Path, default=None, help="--plot's image (default: .png)")
    _common.add_record_options(
        parser, "default: benchmarks/results/float8-<device>-<date>.json (none with --quick)"
    )
    args = parser.parse_args(argv)
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in args.arms if arm not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    model = QUICK_CONFIG if args.quick else MODEL
    if args.data is not None:
        model = dataclasses.replace(model, vocab=256)
    if args.layers is not None:
        model = dataclasses.replace(model, layers=args.layers)
    args.model = model
    for name, full, quick in (
        ("steps", STEPS, QUICK_STEPS),
        ("warmup", WARMUP, QUICK_WARMUP),
        ("seq", SEQ, QUICK_SEQ),
        ("batch", BATCH, QUICK_BATCH),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    # bf16 compute on the GPU as float8 training runs; fp32 on the CPU (as the CPU tests).
    args.param_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return args


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    args = parse_args(argv)
    if args.plot is not None:
        plot(args.plot, args.png)
        return 0
    _common.single_process_environment()
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = _common.start_process_group(BENCHMARK, args.device, backend, "--device cpu --quick")
    if dist.get_world_size() != 1:
        raise SystemExit(
            f"{BENCHMARK}: world size {dist.get_world_size()}; this benchmark compares the arms "
            "on one device: run it with --nproc-per-node 1."
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        print(f"{BENCHMARK}: float8 GEMMs need SM89 or later; the float8 arms will fail.")
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))
    data = Data(args, device)
    device_label = _common.device_name(device)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in Llama(args.model, 1, False).parameters())
    print(
        f"{BENCHMARK}: {device_label}, torch {torch.__version__}, torchao "
        f"{_common.installed('torchao')['torchao']}, dmuon {dmuon.__version__}; Llama "
        f"{num_params / 1e6:.1f} M params ({dataclasses.asdict(args.model)}), seq {args.seq}, "
        f"batch {args.batch}, {args.steps} steps, {args.param_dtype} compute"
        + (", compiled layers" if args.compile else ""),
        flush=True,
    )
    results = {arm: run_arm(arm, args, mesh, device, data) for arm in args.arms}
    date = _common.utc_now()
    record = {
        "benchmark": BENCHMARK,
        "device": device_label,
        **_common.versions(dmuon=dmuon.__version__, **_common.installed("torchao")),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "environment": _common.dmuon_environment(),
        "model": dataclasses.asdict(args.model),
        "num_params": num_params,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "timed_after": args.warmup,
        "param_dtype": str(args.param_dtype),
        "compile": args.compile,
        "adamw_lr": args.adamw_lr,
        "muon_lr": args.muon_lr,
        "data": data.meta,
        "arms": results,
    }
    out = args.out
    if out is None and not args.quick:
        qualifiers = ["compiled"] if args.compile else []
        out = _common.result_path(BENCHMARK, device_label, date, *qualifiers)
    if out is not None:
        _common.write_json(out, record)
    print_table(results, data.meta.get("loss_floor"))
    dist.destroy_process_group()
    return 1 if any("error" in result for result in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
