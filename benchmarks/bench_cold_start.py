"""Cold start: how long a fresh process's first optimizer step takes, dmuon against AdamW.

Trains a 6-layer Qwen2 (d_model 512, built locally from a config) with the HuggingFace Trainer,
bf16, for ``--steps`` steps on random tokens, each variant in a fresh Python process:

- ``adamw``: ``Trainer`` with its default fused AdamW;
- ``dmuon-cold``: ``DMuonTrainer`` with ``dmuon.Muon``, every cache empty: ``DMUON_CACHE_DIR``
  (autotune verdicts, compiled CuTe kernels), ``QUACK_CACHE_DIR`` and ``TRITON_CACHE_DIR`` all
  point into a new folder;
- ``dmuon-warm``: the same again over the folders the cold run left, as a second job on the
  machine would start.

Per variant: the seconds from the start of ``train()`` to the end of the first step (forward,
backward and the first ``step()``: autotune and compiles land here), the median of the later
steps, the whole run, and how many autotune candidates, CuTe compiles and Newton-Schulz shape
preparations its rank-tagged lines report. The cold and warm first steps are compared with
AdamW's (the targets: at most 10 s and 2 s more).

Usage (repository root; on the GPU machine put the package sources on PYTHONPATH)::

    python benchmarks/bench_cold_start.py             # CUDA, writes JSON
    python benchmarks/bench_cold_start.py --device cpu --steps 3 --layers 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

VARIANTS = ("adamw", "dmuon-cold", "dmuon-warm")
COLD_TARGET_S, WARM_TARGET_S = 10.0, 2.0  # extra first-step seconds over AdamW's
RESULT_PREFIX = "cold-start-result "
# Rank-tagged lines that count the work a first step did.
WORK_MARKERS = {
    "autotune_candidates": "SYRK autotune candidate started",
    "cute_compiles": "compiling CuTe SYRK kernel",
}


def child(args: argparse.Namespace) -> None:
    """One training run in this process; prints one ``RESULT_PREFIX`` JSON line."""
    import torch
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.begin = 0.0

        def on_train_begin(self, *_args, **_kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, *_args, **_kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    device = torch.device(args.device)
    model = Qwen2ForCausalLM(config).to(device)
    rows = torch.randint(0, config.vocab_size, (args.batch * args.steps, args.seq))
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",
        report_to=[],
        save_strategy="no",
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        lr_scheduler_type="constant",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    clock = StepClock()
    if args.child == "adamw":
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    else:
        import dmuon
        from dmuon_hf import DMuonTrainer, default_predicate

        dmuon.dedicate_params(model, None, default_predicate(model))
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
        trainer = DMuonTrainer(
            model=model, args=training_args, train_dataset=dataset, optimizers=(optimizer, None)
        )
    trainer.add_callback(clock)
    start = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([clock.begin, *clock.ends], clock.ends)]
    result = {
        "first_step_s": steps[0],
        "later_step_median_s": statistics.median(steps[1:]) if len(steps) > 1 else None,
        "train_s": time.perf_counter() - start,
        "steps": len(steps),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_variant(variant: str, args: argparse.Namespace, caches: Path) -> dict:
    """``variant`` in a fresh process whose dmuon, quack and Triton caches live in ``caches``."""
    env = {
        **os.environ,
        "DMUON_CACHE_DIR": str(caches / "dmuon"),
        "QUACK_CACHE_DIR": str(caches / "quack"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
    }
    env.pop("DMUON_SYRK_AUTOTUNE_LOG", None)
    command = [sys.executable, __file__, "--child", variant.split("-")[0], *child_flags(args)]
    start = time.perf_counter()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - start
    if completed.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{completed.stderr[-6000:]}")
    line = next(s for s in completed.stdout.splitlines() if s.startswith(RESULT_PREFIX))
    result = json.loads(line.removeprefix(RESULT_PREFIX))
    result["process_s"] = process_s
    log = completed.stderr
    result.update({name: log.count(marker) for name, marker in WORK_MARKERS.items()})
    result["log_tail"] = [s for s in log.splitlines() if "[DMuon]" in s][-40:]
    return result


def child_flags(args: argparse.Namespace) -> list[str]:
    return [
        f"--device={args.device}",
        f"--steps={args.steps}",
        f"--layers={args.layers}",
        f"--seq={args.seq}",
        f"--batch={args.batch}",
        f"--output-dir={args.output_dir}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--child", choices=("adamw", "dmuon"), help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", default=None, help=argparse.SUPPRESS)
    _common.add_record_options(parser, "benchmarks/results/cold-start-<gpu>-<date>.json")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    import torch

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="dmuon-cold-start-") as scratch:
        args.output_dir = str(Path(scratch) / "trainer")
        caches = Path(scratch) / "caches"
        results = {variant: run_variant(variant, args, caches) for variant in VARIANTS}

    adamw_first = results["adamw"]["first_step_s"]
    print(
        f"\n{'variant':<12} {'first step s':>12} {'over AdamW s':>12} {'later ms':>9} "
        f"{'candidates':>10} {'compiles':>8}"
    )
    for variant, result in results.items():
        later = result["later_step_median_s"]
        print(
            f"{variant:<12} {result['first_step_s']:>12.2f} "
            f"{result['first_step_s'] - adamw_first:>12.2f} "
            f"{(later or 0) * 1e3:>9.1f} {result['autotune_candidates']:>10} "
            f"{result['cute_compiles']:>8}"
        )
    extra = {v: results[v]["first_step_s"] - adamw_first for v in ("dmuon-cold", "dmuon-warm")}
    print(
        f"cold: {extra['dmuon-cold']:.2f} s over AdamW (target <= {COLD_TARGET_S:g}); "
        f"warm: {extra['dmuon-warm']:.2f} s (target <= {WARM_TARGET_S:g})"
    )
    if args.device != "cuda" and args.out is None:
        return
    date = _common.utc_now()
    record = {
        "benchmark": "bench_cold_start",
        "device": _common.device_name(device),
        "versions": _common.versions(
            **_common.installed("transformers", "quack-kernels", "nvidia-cutlass-dsl")
        ),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "command": " ".join(sys.argv),
        "config": {
            "layers": args.layers,
            "d_model": 512,
            "seq": args.seq,
            "batch": args.batch,
            "steps": args.steps,
            "dtype": "bf16" if args.device == "cuda" else "fp32",
        },
        "targets_s_over_adamw": {"cold": COLD_TARGET_S, "warm": WARM_TARGET_S},
        "first_step_s_over_adamw": extra,
        "results": results,
    }
    out = args.out or _common.result_path("cold-start", record["device"], date)
    _common.write_json(out, record)


if __name__ == "__main__":
    main()
