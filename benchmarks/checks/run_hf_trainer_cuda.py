"""DMuonTrainer from TrainingArguments(fsdp=...) on CUDA: bf16, gradient checkpointing, exact resume,
and the first step against Trainer + AdamW on FSDP2.

A small Llama built from a config (no download; ``--layers``, ``--hidden``, ...) trains on fixed
random tokens in three fresh processes, one after the other (each under
``torch.distributed.run``, so that no Accelerate or CUDA state carries over):

1. ``adamw``: a stock ``transformers.Trainer`` with ``fsdp=True, fsdp_config={"fsdp_version": 2}``
   (Accelerate's FSDP2 path) and its default AdamW, ``2 * --steps`` steps;
2. ``dmuon``: ``DMuonTrainer`` with the same arguments and the plain model (it dedicates with
   ``default_predicate`` and shards per decoder layer), ``dmuon.Muon`` with deterministic
   Newton-Schulz (cuBLAS), ``2 * --steps`` steps with a checkpoint after ``--steps``;
3. ``resume``: ``DMuonTrainer`` on a fresh model, ``train(resume_from_checkpoint=...)`` from that
   checkpoint, to step ``2 * --steps``.

All three: ``bf16=True``, ``gradient_checkpointing=True``, eager attention and
``torch.use_deterministic_algorithms(True)``, so that the resumed steps can repeat the
uninterrupted ones bit for bit. Step times come from a callback that synchronises the device at
each step's start and end; the first step includes everything a first step does (for dmuon the
first broadcasts and Newton-Schulz calls).

Usage (GPU machine, repository root; ``torch.distributed.run`` is started by the script)::

    python benchmarks/checks/run_hf_trainer_cuda.py --out $OUT/hf-trainer-cuda.json
    python benchmarks/checks/run_hf_trainer_cuda.py --device cpu --nproc 2 --tiny   # CPU smoke test

Prints a table and writes JSON (default
``benchmarks/results/hf-trainer-cuda-<device>-w<nproc>-<date>.json``). Exit code 1 when the
resumed losses or final logits differ from the uninterrupted run, or a run failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

PHASES = ("adamw", "dmuon", "resume")


def _sources_on_path() -> None:
    for package in ("dmuon-kernels", "dmuon-core", "dmuon-hf"):
        source = str(_common.REPO_ROOT / "packages" / package / "src")
        if source not in sys.path:
            sys.path.insert(0, source)


def _model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",  # deterministic backward
    )


class _StepTimer:
    """A TrainerCallback (built lazily: transformers is imported inside the phase)."""

    def __new__(cls, device):
        from transformers import TrainerCallback

        class StepTimer(TrainerCallback):
            def __init__(self) -> None:
                self.times_ms: list[float] = []
                self._start = 0.0

            def on_step_begin(self, args, state, control, **kwargs):
                _common.synchronize(device)
                self._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                _common.synchronize(device)
                self.times_ms.append((time.perf_counter() - self._start) * 1e3)

        return StepTimer()


def run_phase(args) -> dict:
    """One phase on every rank of this torchrun job; rank 0's record."""
    _sources_on_path()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True, warn_only=True)  # the check below is the judge
    device = _common.start_process_group(
        "run_hf_trainer_cuda.py", args.device, args.backend, "--device cpu --nproc 2"
    )
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    import dmuon
    from dmuon_hf import DMuonTrainer

    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, args.vocab, (args.rows, args.seq), generator=generator)
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    torch.manual_seed(0)
    model = LlamaForCausalLM(_model_config(args))  # fp32 weights: bf16 compute under FSDP2
    parameters = sum(p.numel() for p in model.parameters())
    training = TrainingArguments(
        output_dir=args.work_dir,
        use_cpu=args.device == "cpu",
        report_to=[],
        bf16=True,
        gradient_checkpointing=True,
        fsdp=True,
        fsdp_config={"fsdp_version": 2},
        max_steps=2 * args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if args.phase != "adamw" else "no",
        save_steps=args.steps,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    timer = _StepTimer(device)
    if args.phase == "adamw":
        trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=[timer])
    else:
        muon = (dmuon.Muon, {"lr": 0.02, "adamw_lr": 1e-4,
                             "ns_backend": dmuon.NewtonSchulz(deterministic=True)})  # fmt: skip
        trainer = DMuonTrainer(
            model=model,
            args=training,
            train_dataset=dataset,
            optimizer_cls_and_kwargs=muon,
            callbacks=[timer],
        )
    resume = (
        os.path.join(args.work_dir, f"checkpoint-{args.steps}") if args.phase == "resume" else None
    )
    trainer.train(resume_from_checkpoint=resume)
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    grad_norms = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    probe = tokens[:2].to(device)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=probe).logits.float().cpu()
    record = {
        "phase": args.phase,
        "world_size": world,
        "parameters": parameters,
        "accelerate_distributed_type": str(trainer.accelerator.distributed_type),
        "losses": losses,
        "grad_norms": grad_norms,
        "step_ms": timer.times_ms,
        "first_step_ms": timer.times_ms[0] if timer.times_ms else None,
        "median_later_step_ms": statistics.median(timer.times_ms[1:])
        if len(timer.times_ms) > 1
        else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "logits_sum": logits.double().sum().item(),
        "logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
    }
    if args.phase != "adamw":
        record["dedicated"] = len(dmuon.inspect.view(trainer.model).params)
        record["ns_backend"] = dmuon.get_ns_backend()
    dist.destroy_process_group()
    return record


def _phase_command(args, phase: str, out: Path) -> list[str]:
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                 ("device", "backend", "steps", "layers", "hidden", "ffn", "heads", "vocab", "seq",
                  "batch", "rows", "work_dir")]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.nproc}", __file__, f"--phase={phase}", f"--phase-out={out}",
            *forwarded]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--backend", default=None, help="nccl on cuda, gloo on cpu by default")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="checkpoint after this many steps")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank and step")
    parser.add_argument(
        "--rows", type=int, default=None, help="dataset rows (default: 4 epochs' worth)"
    )
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model for a smoke test")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--phase", choices=PHASES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--phase-out", type=Path, default=None, help=argparse.SUPPRESS)
    _common.add_record_options(parser)
    args = parser.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.tiny:
        args.layers, args.hidden, args.ffn, args.heads, args.vocab, args.seq = (
            2,
            64,
            128,
            4,
            128,
            32,
        )
        args.batch = min(args.batch, 2)
    args.rows = args.rows or 2 * args.steps * args.batch * args.nproc

    if args.phase is not None:  # inside torchrun
        try:
            record = run_phase(args)
        except Exception:
            record = {"phase": args.phase, "error": traceback.format_exc()}
            print(record["error"], file=sys.stderr)
        if int(os.environ.get("RANK", "0")) == 0:
            args.phase_out.write_text(json.dumps(record, default=str))
        return 0

    work_dir = args.work_dir or tempfile.mkdtemp(prefix="dmuon-hf-trainer-cuda-")
    args.work_dir = work_dir
    records = {}
    for phase in PHASES:
        out = Path(work_dir) / f"{phase}.json"
        started = time.perf_counter()
        completed = subprocess.run(_phase_command(args, phase, out), check=False)
        records[phase] = json.loads(out.read_text()) if out.exists() else {
            "phase": phase, "error": f"exit code {completed.returncode}, no record"}  # fmt: skip
        records[phase]["wall_s"] = time.perf_counter() - started
    return _report(args, records)


def _report(args, records: dict) -> int:
    import torch

    dmuon_run, resumed, adamw = records["dmuon"], records["resume"], records["adamw"]
    failures = [
        f"{name}: {r['error'].splitlines()[-1]}" for name, r in records.items() if "error" in r
    ]
    resumed_steps = [str(s) for s in range(args.steps + 1, 2 * args.steps + 1)]
    checks = {}
    if "error" not in dmuon_run and "error" not in resumed:
        checks["resumed_losses_equal"] = all(
            resumed["losses"].get(s) == dmuon_run["losses"].get(s) for s in resumed_steps
        )
        checks["resumed_grad_norms_equal"] = all(
            resumed["grad_norms"].get(s) == dmuon_run["grad_norms"].get(s) for s in resumed_steps
        )
        checks["resumed_final_logits_equal"] = (
            resumed["logits_sha256"] == dmuon_run["logits_sha256"]
        )
    print(f"{'run':<8} {'first step ms':>14} {'median later ms':>16} {'final loss':>11}")
    for name, r in records.items():
        if "error" in r:
            print(f"{name:<8} failed: {r['error'].splitlines()[-1]}")
            continue
        last = r["losses"][max(r["losses"], key=int)]
        print(
            f"{name:<8} {r['first_step_ms']:>14.1f} {r['median_later_step_ms']:>16.1f} {last:>11.4f}"
        )
    comparison = {}
    if "error" not in dmuon_run and "error" not in adamw:
        comparison = {
            "first_step_dmuon_over_adamw": dmuon_run["first_step_ms"] / adamw["first_step_ms"],
            "median_later_step_dmuon_over_adamw": (
                dmuon_run["median_later_step_ms"] / adamw["median_later_step_ms"]
            ),
        }
        print(", ".join(f"{key} {value:.3f}" for key, value in comparison.items()))
    for name, ok in checks.items():
        print(f"{name}: {'ok' if ok else 'DIFFERENT'}")
    device = torch.device(args.device)
    label = (
        _common.device_name(device)
        if args.device == "cuda" and torch.cuda.is_available()
        else "cpu"
    )
    date = _common.utc_now()
    record = {
        "benchmark": "hf-trainer-cuda",
        "device": label,
        "nproc": args.nproc,
        "backend": args.backend,
        "model": {
            k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "vocab", "seq")
        },
        "batch_per_rank": args.batch,
        "steps_before_checkpoint": args.steps,
        "settings": "bf16, gradient_checkpointing, fsdp_version 2, eager attention, deterministic algorithms",
        "runs": records,
        "checks": checks,
        "comparison": comparison,
        "failures": failures,
        **_common.installed("transformers", "accelerate"),
        **_common.versions(),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
    }
    out = args.out or _common.result_path("hf-trainer-cuda", label, date, f"w{args.nproc}")
    _common.write_json(out, record)
    return 0 if checks and all(checks.values()) and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
