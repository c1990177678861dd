"""Cold start: how long a fresh process's first training step takes, dmuon against AdamW, and
where that time goes.

Trains each model with the HuggingFace Trainer (bf16, built locally from a config, random
tokens) for ``--steps`` steps, each variant in a fresh Python process:

- ``adamw``: ``Trainer`` with its default fused AdamW;
- ``dmuon-cold``: ``DMuonTrainer`` with ``dmuon.Muon``, every cache empty: ``DMUON_CACHE_DIR``
  (autotune verdicts, compiled CuTe kernels, and under it nvidia-cutlass-dsl's cache),
  ``QUACK_CACHE_DIR`` and ``TRITON_CACHE_DIR`` all point into a new folder per model;
- ``dmuon-warm``: the same again over the folders the cold run left, as a second job on the
  machine would start;
- ``dmuon-wait``: ``dmuon-cold`` with ``DMUON_KERNEL_COMPILE=wait`` (the kernels compile inside
  the first step, as before the background compile) over caches of its own, empty.

``dmuon-cold`` and ``dmuon-warm`` run the default background compile: their steps run cuBLAS
until the step every rank switches on (``kernel_switch``: that step, the seconds from the job's
start, and the median step after it). Such a run trains until the switch and then ``--steps``
steps more (``--max-steps`` at most); the others train ``--steps`` steps.

Models (``--models``, default all three; ``--tiny`` shrinks each to a CPU-sized smoke test):

- ``qwen2``: Qwen2, 8 layers, d_model 1024, ffn 2816, 16 heads, 4 kv heads (dense);
- ``llama-0.89b``: ``bench_e2e.py``'s Llama shape as a HF Llama (d_model 2048, 16 layers,
  16 heads, 8 kv heads, ffn 5632, vocab 32000; dense);
- ``qwen3-moe``: Qwen3-MoE, 6 layers, d_model 1024, 16 experts of 704 (top 2), fused (E, m, n)
  expert stacks that dmuon dedicates as E matrices each.

Per variant: the seconds from the start of ``train()`` to the end of the first step (forward,
backward and the first ``step()``, synchronised: autotune and compiles land here), split into
forward+backward and the optimizer step (step hooks, synchronised); the median of the later
steps; the whole run; how many autotune candidates, compiles and quack kernels its rank-tagged
lines report; the compiled specialisations of each Triton kernel its Triton cache holds after
the process (``triton_cache_kernels``); and a timeline of the first step:

- ``phases``: the first-use work ``dmuon_kernels`` timed (``dmuon_kernels._log.timed_phase``:
  library imports, autotune candidates, compiles and loads, lock waits, CUDA-graph captures),
  each with its start (seconds after the step began), duration and nesting depth, and their
  totals per kind (``before_first_step``: the same for what ran before ``train()``, such as the
  imports a ``NewtonSchulz``'s construction does);
- ``sampled_s``: where the main thread was, sampled every few milliseconds over the whole first
  step, by category: first-use work anywhere in the stack (imports, Triton, quack, CuTe DSL,
  autotune measurement, captures), else the innermost running code (Newton-Schulz, the
  optimizer step, dmuon's hooks and collectives, forward, backward, other). Each sample counts
  the wall time since the previous one, so a call that holds the GIL for seconds is counted in
  full under the frame that made it, and the categories add up to the first step (the
  backward's autograd threads are not sampled: their time shows as the main thread waiting in
  backward).

The cold and warm first steps are compared with AdamW's (the target: at most 1 s more for each).

Usage (repository root; on the GPU machine put the package sources on PYTHONPATH)::

    python benchmarks/e2e/bench_cold_start.py --out "$OUT/cold-start.json"   # CUDA, all models
    python benchmarks/e2e/bench_cold_start.py --models qwen3-moe --steps 4
    python benchmarks/e2e/bench_cold_start.py --device cpu --tiny --steps 3   # smoke test
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

VARIANTS = ("adamw", "dmuon-cold", "dmuon-warm", "dmuon-wait")
MODELS = ("qwen2", "llama-0.89b", "qwen3-moe")
# Extra first-step seconds over AdamW's: with the background compile a cold machine's first
# step waits for no compile either, so both targets are 1 s.
COLD_TARGET_S, WARM_TARGET_S = 1.0, 1.0
RESULT_PREFIX = "cold-start-result "
SAMPLE_INTERVAL_S = 0.005
# Rank-tagged lines that count the work a first step did.
WORK_MARKERS = {
    "autotune_candidates": "SYRK autotune candidate started",
    "cute_compiles": "] compiling CuTe SYRK kernel",
    "quack_kernels_ready": "] quack gemm",
    "graph_captures": "] captured a CUDA graph",
}
# Where the main thread is. First-use work, by the first rule whose marker appears in any frame
# of the stack (file names, or "file:function"), so that a compile inside an autotune candidate
# counts as the compile and an import inside anything as the import:
FIRST_USE_CATEGORIES = (
    ("CUDA-graph capture", ("dmuon_kernels/graphs.py:_capture",)),
    ("import", ("<frozen importlib",)),
    ("Triton (compile, launch)", ("/triton/", "_fused_triton.py:_await_compiles_ahead")),
    ("quack (compile, load, launch)", ("/quack/",)),
    ("CuTe DSL (compile, load)", ("/cutlass/", "/syrk/_cute_", "/syrk/kernel_cache.py")),
    ("SYRK autotune (measuring)", ("/syrk/autotune.py",)),
)
# Otherwise by the innermost frame with one of these markers: the code that is running.
RUNNING_CATEGORIES = (
    ("Newton-Schulz and SYRK (running)", ("/dmuon_kernels/",)),
    ("optimizer step (other)", ("/torch/optim/", "/dmuon/optim", "/dmuon/muon")),
    ("dmuon hooks and collectives", ("/dmuon/", "/dmuon_hf/")),
    ("forward", ("/transformers/models/", "/torch/nn/")),
    ("backward", ("/torch/autograd/", "/torch/_tensor.py:backward", "accelerator.py:backward")),
)
OTHER_CATEGORY = "other (Trainer, data, the rest)"


# ---- the models ---------------------------------------------------------------------------------


def model_config(name: str, tiny: bool, seq: int):
    """(transformers config, predicate name) of ``name``; ``tiny`` keeps the family, not the
    size."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    if name == "qwen2":
        size = (
            dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, vocab_size=256)
            if tiny
            else dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8)
        )
        return Qwen2Config(
            num_attention_heads=16 if not tiny else 4,
            num_key_value_heads=4 if not tiny else 2,
            max_position_embeddings=seq,
            **{"vocab_size": 32000, **size},
        )
    if name == "llama-0.89b":
        size = (
            dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, vocab_size=256)
            if tiny
            else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16)
        )
        return LlamaConfig(
            num_attention_heads=16 if not tiny else 4,
            num_key_value_heads=8 if not tiny else 2,
            max_position_embeddings=seq,
            tie_word_embeddings=False,
            **{"vocab_size": 32000, **size},
        )
    if name == "qwen3-moe":
        size = (
            dict(
                hidden_size=64,
                intermediate_size=176,
                moe_intermediate_size=48,
                num_hidden_layers=2,
                num_experts=4,
                vocab_size=256,
                head_dim=16,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
            if tiny
            else dict(
                hidden_size=1024,
                intermediate_size=2816,
                moe_intermediate_size=704,
                num_hidden_layers=6,
                num_experts=16,
                head_dim=64,
                num_attention_heads=16,
                num_key_value_heads=4,
            )
        )
        return Qwen3MoeConfig(
            num_experts_per_tok=2,
            max_position_embeddings=seq,
            **{"vocab_size": 32000, **size},
        )
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def build_model(name: str, config):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM

    classes = {
        "qwen2": Qwen2ForCausalLM,
        "llama-0.89b": LlamaForCausalLM,
        "qwen3-moe": Qwen3MoeForCausalLM,
    }
    return classes[name](config)


def moe_predicate(name: str, param) -> bool:
    """The attention projections and the fused (E, m, n) expert stacks; the router
    (``mlp.gate``) stays on AdamW."""
    return ("proj" in name and param.ndim == 2) or param.ndim == 3


# ---- the first-step timeline --------------------------------------------------------------------


def classify(frame) -> str:
    """The category of the stack that ends at ``frame`` (see FIRST_USE_CATEGORIES and
    RUNNING_CATEGORIES)."""
    places = []
    while frame is not None:
        code = frame.f_code
        places.append(f"{code.co_filename.replace(os.sep, '/')}:{code.co_name}")
        frame = frame.f_back
    for category, markers in FIRST_USE_CATEGORIES:
        if any(marker in place for place in places for marker in markers):
            return category
    for place in places:  # innermost first
        for category, markers in RUNNING_CATEGORIES:
            if any(marker in place for marker in markers):
                return category
    return OTHER_CATEGORY


class StackSampler:
    """Samples where one thread is, from a second thread, between ``start()`` and ``stop()``:
    seconds per category, each sample weighted by the wall time since the previous one."""

    def __init__(self, thread_id: int, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.thread_id = thread_id
        self.interval_s = interval_s
        self.seconds: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._last = time.perf_counter()
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return dict(self.seconds.most_common())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            self.seconds[classify(frame)] += now - self._last
            self._last = now


def phase_timeline(begin: float, end: float, origin: float | None = None) -> dict:
    """The phases ``dmuon_kernels`` recorded between ``begin`` and ``end`` (perf_counter), with
    their totals per kind; starts in seconds after ``origin`` (default ``begin``)."""
    origin = begin if origin is None else origin
    from dmuon_kernels import _log

    phases = [p for p in _log.recorded_phases() if begin <= p.start < end]
    totals: collections.Counter[str] = collections.Counter()
    for phase in phases:
        totals[phase.kind] += phase.seconds
    return {
        "phases": [
            {
                "kind": p.kind,
                "what": p.what,
                "start_s": round(p.start - origin, 4),
                "seconds": round(p.seconds, 4),
                "depth": p.depth,
            }
            for p in phases
        ],
        "phase_seconds_by_kind": {kind: round(s, 4) for kind, s in totals.most_common()},
        "top_level_phase_seconds": round(sum(p.seconds for p in phases if p.depth == 0), 4),
    }


# ---- one run in a child process ------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """One training run in this process; prints one ``RESULT_PREFIX`` JSON line."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    device = torch.device(args.device)

    def synchronize() -> None:
        _common.synchronize(device)

    class FirstStepClock(TrainerCallback):
        """Step ends (synchronised), the first step sampled, the optimizer steps timed."""

        def __init__(self) -> None:
            self.begin = 0.0
            self.ends: list[float] = []
            self.optimizer_s: list[float] = []
            self.sampler = StackSampler(threading.get_ident())
            self.sampled: dict[str, float] = {}

        def on_train_begin(self, _args, _state, _control, optimizer=None, **_kwargs):
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
            if inner is not None:
                self._time_steps(inner)
            synchronize()
            self.begin = time.perf_counter()
            self.sampler.start()

        def _time_steps(self, inner) -> None:
            started: list[float] = []

            def before(*_):
                synchronize()
                started.append(time.perf_counter())

            def after(*_):
                synchronize()
                self.optimizer_s.append(time.perf_counter() - started.pop())

            inner.register_step_pre_hook(before)
            inner.register_step_post_hook(after)

        def on_step_end(self, *_args, **_kwargs):
            synchronize()
            self.ends.append(time.perf_counter())
            if len(self.ends) == 1:
                self.sampled = self.sampler.stop()

    class StopAfterSwitch(TrainerCallback):
        """A background compile's run: ``--steps`` more steps once every rank switched."""

        def on_step_end(self, _args, state, control, **_kwargs):
            switch = compiles.switch_step
            if switch is not None and state.global_step >= switch + args.steps:
                control.should_training_stop = True

    torch.manual_seed(0)
    config = model_config(args.model, args.tiny, args.seq)
    model = build_model(args.model, config).to(device)
    if args.child != "adamw":
        import dmuon
        from dmuon_hf import DMuonTrainer, default_predicate
        from dmuon_kernels.background_compile import background_compile

        predicate = moe_predicate if args.model == "qwen3-moe" else default_predicate(model)
        dmuon.dedicate_params(model, None, predicate)
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
        compiles = background_compile()
    # A run with a compile job trains until it switched, and --steps after (--max-steps at most).
    background = args.child != "adamw" and compiles.active
    max_steps = max(args.max_steps, args.steps) if background else args.steps
    rows = torch.randint(0, config.vocab_size, (args.batch * max_steps, args.seq))
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",
        report_to=[],
        save_strategy="no",
        max_steps=max_steps,
        per_device_train_batch_size=args.batch,
        lr_scheduler_type="constant",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    clock = FirstStepClock()
    if args.child == "adamw":
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    else:
        trainer = DMuonTrainer(
            model=model, args=training_args, train_dataset=dataset, optimizers=(optimizer, None)
        )
        if background:
            trainer.add_callback(StopAfterSwitch())
    trainer.add_callback(clock)
    start = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([clock.begin, *clock.ends], clock.ends)]
    first_step_s = steps[0]
    result = {
        "first_step_s": first_step_s,
        "first_step_optimizer_s": clock.optimizer_s[0] if clock.optimizer_s else None,
        "later_step_median_s": statistics.median(steps[1:]) if len(steps) > 1 else None,
        "later_optimizer_median_s": (
            statistics.median(clock.optimizer_s[1:]) if len(clock.optimizer_s) > 1 else None
        ),
        "train_s": time.perf_counter() - start,
        "steps": len(steps),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sampled_s": {k: round(v, 4) for k, v in clock.sampled.items()},
    }
    if result["first_step_optimizer_s"] is not None:
        result["first_step_forward_backward_s"] = first_step_s - result["first_step_optimizer_s"]
    if args.child != "adamw":
        result.update(phase_timeline(clock.begin, clock.ends[0]))
        # e.g. the library imports a NewtonSchulz's construction does: before the first step
        result["before_first_step"] = phase_timeline(0.0, clock.begin, origin=clock.begin)
        result["ns_kernel"] = repr(optimizer.newton_schulz)
        switch = compiles.switch_step
        result["step_s"] = steps
        result["kernel_switch"] = {
            "switch_step": switch,
            "seconds_to_switch": compiles.seconds_to_switch,
            "pending_at_end": compiles.active,
            "after_switch_step_median_s": (
                statistics.median(steps[switch:]) if switch and len(steps) > switch else None
            ),
        }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_variant(variant: str, model: str, args: argparse.Namespace, caches: Path) -> dict:
    """``variant`` of ``model`` in a fresh process whose dmuon, quack and Triton caches live in
    ``caches``."""
    if variant == "dmuon-wait":
        caches = caches / "wait"  # empty too: the other variants share theirs
    env = {
        **os.environ,
        "DMUON_CACHE_DIR": str(caches / "dmuon"),
        "QUACK_CACHE_DIR": str(caches / "quack"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
    }
    for name in (
        "DMUON_SYRK_AUTOTUNE_LOG",
        "DMUON_KERNEL_CACHE",
        "CUTE_DSL_CACHE_DIR",
        "DMUON_KERNEL_COMPILE",
    ):
        env.pop(name, None)
    if variant == "dmuon-wait":
        env["DMUON_KERNEL_COMPILE"] = "wait"
    command = [
        sys.executable,
        __file__,
        "--child",
        variant.split("-")[0],
        f"--model={model}",
        *child_flags(args),
    ]
    print(f"bench_cold_start: {model} {variant} ...", flush=True)
    start = time.perf_counter()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - start
    if completed.returncode != 0:
        return {"error": completed.stderr[-6000:], "process_s": process_s}
    line = next(s for s in completed.stdout.splitlines() if s.startswith(RESULT_PREFIX))
    result = json.loads(line.removeprefix(RESULT_PREFIX))
    result["process_s"] = process_s
    log = completed.stderr
    result.update({name: log.count(marker) for name, marker in WORK_MARKERS.items()})
    result["triton_cache_kernels"] = triton_kernel_counts(caches / "triton")
    result["log_tail"] = [s for s in log.splitlines() if "[DMuon]" in s][-80:]
    return result


def triton_kernel_counts(folder: Path) -> dict[str, int]:
    """How many compiled specialisations of each Triton kernel ``folder`` holds after the
    process (one metadata file per compile; the cold run's compiles, and nothing new after a
    warm run that only loaded them)."""
    names = [path.stem for path in folder.glob("*/*.json") if not path.name.startswith("__grp__")]
    return dict(sorted(collections.Counter(names).items()))


def child_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        f"--device={args.device}",
        f"--steps={args.steps}",
        f"--max-steps={args.max_steps}",
        f"--seq={args.seq}",
        f"--batch={args.batch}",
        f"--output-dir={args.output_dir}",
    ]
    return [*flags, "--tiny"] if args.tiny else flags


# ---- the report ----------------------------------------------------------------------------------


def print_model(model: str, results: dict) -> dict:
    """The table of one model; returns the first-step seconds over AdamW per dmuon variant."""
    print(
        f"\n{model}\n{'variant':<11} {'first s':>8} {'over AdamW':>10} {'fwd+bwd s':>9} "
        f"{'step s':>7} {'later ms':>8} {'cand.':>5} {'cute':>4} {'quack':>5} {'graphs':>6}"
    )
    adamw = results["adamw"].get("first_step_s")
    extra = {}
    for variant, found in results.items():
        if "error" in found:
            print(f"{variant:<11} failed: {found['error'].splitlines()[-1:]}")
            continue
        over = found["first_step_s"] - adamw if adamw is not None else float("nan")
        if variant != "adamw":
            extra[variant] = over
        print(
            f"{variant:<11} {found['first_step_s']:>8.2f} {over:>10.2f} "
            f"{found.get('first_step_forward_backward_s', float('nan')):>9.2f} "
            f"{found.get('first_step_optimizer_s') or float('nan'):>7.2f} "
            f"{(found['later_step_median_s'] or 0) * 1e3:>8.1f} "
            f"{found['autotune_candidates']:>5} {found['cute_compiles']:>4} "
            f"{found['quack_kernels_ready']:>5} {found['graph_captures']:>6}"
        )
    for variant in ("dmuon-cold", "dmuon-warm"):
        found = results.get(variant, {})
        if "sampled_s" in found:
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(found["sampled_s"].items())[:6])
            print(f"  {variant} first step by where the main thread was (s): {top}")
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in found["phase_seconds_by_kind"].items())
            print(f"  {variant} first-use phases (s): {kinds or 'none'}")
    for variant in ("dmuon-cold", "dmuon-warm"):
        switch = results.get(variant, {}).get("kernel_switch")
        if switch and switch["switch_step"] is None and not switch["pending_at_end"]:
            print(f"  {variant} kernel switch: none (no background compile here, or it failed)")
        elif switch:
            after = switch["after_switch_step_median_s"]
            print(
                f"  {variant} kernel switch: step {switch['switch_step']}, "
                f"{switch['seconds_to_switch'] or float('nan'):.1f} s after the job started; "
                f"median step after it {'n/a' if after is None else f'{after * 1e3:.1f} ms'}"
                + (" (still pending at the end: more --steps)" if switch["pending_at_end"] else "")
            )
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--tiny", action="store_true", help="each model at a smoke-test size")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=1500,
        help="a background compile's run trains until the switch, then --steps more, at most this",
    )
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--child", choices=("adamw", "dmuon"), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", default=None, help=argparse.SUPPRESS)
    _common.add_record_options(parser, "benchmarks/results/cold-start-<gpu>-<date>.json")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    import torch

    device = torch.device(args.device)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dmuon-cold-start-") as scratch:
        args.output_dir = str(Path(scratch) / "trainer")
        for model in args.models:
            caches = Path(scratch) / "caches" / model
            results[model] = {v: run_variant(v, model, args, caches) for v in VARIANTS}
    over_adamw = {model: print_model(model, found) for model, found in results.items()}
    for model, extra in over_adamw.items():
        cold, warm = extra.get("dmuon-cold"), extra.get("dmuon-warm")
        print(
            f"{model}: cold {cold if cold is None else f'{cold:.2f}'} s over AdamW (target <= "
            f"{COLD_TARGET_S:g}); warm {warm if warm is None else f'{warm:.2f}'} s (target <= "
            f"{WARM_TARGET_S:g})"
        )
    if args.device != "cuda" and args.out is None:
        return
    date = _common.utc_now()
    record = {
        "benchmark": "bench_cold_start",
        "device": _common.device_name(device),
        "versions": _common.versions(
            **_common.installed("transformers", "quack-kernels", "nvidia-cutlass-dsl", "triton")
        ),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "command": " ".join(sys.argv),
        "config": {
            "models": {
                model: model_config(model, args.tiny, args.seq).to_dict() for model in args.models
            },
            "seq": args.seq,
            "batch": args.batch,
            "steps": args.steps,
            "max_steps": args.max_steps,
            "dtype": "bf16" if args.device == "cuda" else "fp32",
            "sample_interval_s": SAMPLE_INTERVAL_S,
        },
        "targets_s_over_adamw": {"cold": COLD_TARGET_S, "warm": WARM_TARGET_S},
        "first_step_s_over_adamw": over_adamw,
        "results": results,
        "wall_s": time.perf_counter() - started,
    }
    out = args.out or _common.result_path("cold-start", record["device"], date)
    _common.write_json(out, record)


if __name__ == "__main__":
    main()
