"""torchtitan's own Trainer on one GPU: stock AdamW vs torchtitan's DistMuon vs dmuon-titan.

One Llama-3-8B-shaped model cut to ``--layers`` blocks (d 4096, 32 heads, 8 kv heads, ffn 14336,
vocab 128256), sequence ``--seq-len``, one sequence a step, torchtitan's default mixed precision
(bf16 parameters, fp32 reduction), the same synthetic tokens for every variant, each variant in a
fresh process (``torchrun --nproc-per-node 1``):

- ``adamw``: torchtitan's job as configured (``default_adamw``);
- ``distmuon``: torchtitan's ``DistMuon`` on the blocks' matrices (its ``ParamGroupConfig``),
  AdamW on the rest; its error is recorded if torchtitan refuses the layout;
- ``dmuon``: ``dmuon_titan.enable`` on the same job.

Per variant: the median over the timed steps (after ``--warmup``) of the whole train step
host-included (wall clock between synchronisations) and device-only (CUDA events around it),
the optimizer step alone (CUDA events), peak memory, and the last loss. Attention is causal
SDPA in every variant (FlexAttention would compile).

torchtitan 0.3.0 runs on torch 2.13 (the pair dmuon-titan is tested with) but for one call:
after the first step ``Trainer.train()`` shortens every group's timeout with
``torch.distributed.set_timeout``, a function of a later torch (2.13 has the method on each
``ProcessGroup``). Each worker gives torch that function when it lacks it, before training, and
the JSON lists it under ``shims`` (the same line the README's troubleshooting gives users). Where
torchtitan does not import or run with the installed torch, the JSON records the error and the
script exits 0.

Usage (repository root; on the GPU machine with the package sources and torchtitan's wheels on
the path)::

    python benchmarks/e2e/bench_titan.py --out $OUT/titan-h200-w1.json
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
import traceback
from pathlib import Path

VARIANTS = ("adamw", "distmuon", "dmuon")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    record: dict = {"inputs": vars(args) | {"out": str(args.out)}, "variants": {}}
    try:
        import torch
        import torchtitan

        record["versions"] = {"torch": torch.__version__, "torchtitan": torchtitan.__version__}
        import torchtitan.trainer
    except Exception as error:  # the installed torch may be older than torchtitan's nightly
        record["imports"] = False
        record["error"] = f"{type(error).__name__}: {error}"
        _write(args.out, record)
        print(f"torchtitan does not import here: {record['error']}")
        return
    record["imports"] = True
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "result.json"
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "1", __file__, "--worker", variant, "--worker-out", str(out),
                "--layers", str(args.layers), "--seq-len", str(args.seq_len),
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(args.out),
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=420)
            if out.exists():
                record["variants"][variant] = json.loads(out.read_text())
            else:
                record["variants"][variant] = {"error": done.stderr[-3000:]}
    _write(args.out, record)
    _print_table(record)


def _worker(args) -> None:
    result: dict = {}
    try:
        result = _train(args)
    except Exception as error:
        result = {
            "error": f"{type(error).__name__}: {error}",
            "trace": traceback.format_exc()[-3000:],
        }
    args.worker_out.write_text(json.dumps(result))


def _train(args) -> dict:
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.optimizer import ParamGroupConfig, default_adamw
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    spec = model_registry("8B")
    spec.model.layers = spec.model.layers[: args.layers]
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    vocab = spec.model.vocab_size

    class Tokens(BaseTokenizer):
        def __init__(self, config, **kwargs):
            super().__init__()
            self.eos_id = 0

        def encode(self, *args, **kwargs):
            raise NotImplementedError

        def decode(self, *args, **kwargs):
            raise NotImplementedError

        def get_vocab_size(self):
            return vocab

    class RandomTokens(BaseDataLoader):
        def __init__(self, config, *, seq_len, local_batch_size, **kwargs):
            self.shape = (local_batch_size, seq_len + 1)
            self.step = 0

        def __iter__(self):
            while True:
                generator = torch.Generator().manual_seed(self.step)
                tokens = torch.randint(0, vocab, self.shape, generator=generator)
                self.step += 1
                positions = torch.arange(self.shape[1] - 1).expand(self.shape[0], -1)
                yield {"input": tokens[:, :-1], "positions": positions.contiguous()}, tokens[:, 1:]

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, state):
            self.step = state["step"]

    config = Trainer.Config(
        model_spec=spec,
        tokenizer=Tokens.Config(),
        dataloader=RandomTokens.Config(),
        optimizer=default_adamw(lr=3e-4),
    )
    config.training.seq_len = args.seq_len
    config.training.local_batch_size = 1
    config.training.steps = args.steps
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.checkpoint.enable = False
    config.activation_checkpoint = None
    config.dump_folder = tempfile.mkdtemp()
    config.metrics.log_freq = 1
    if args.worker == "distmuon":
        matrices = r"^layers\.\d+\..*(wqkv|wq|wk|wv|wo|w1|w2|w3)\.weight$"
        config.optimizer.param_groups.insert(
            0, ParamGroupConfig(pattern=matrices, optimizer_name="DistMuon",
                                optimizer_kwargs={"lr": 0.02, "momentum": 0.95}),
        )  # fmt: skip
    if args.worker == "dmuon":
        import dmuon_titan

        config = dmuon_titan.enable(config)
    shims = _torch_functions_torchtitan_calls()
    trainer = config.build()
    device = trainer.device
    step_times, device_times, optimizer_times, losses = [], [], [], []
    train_step, optimizer_step = trainer.train_step, trainer.optimizers.step

    def timed_optimizer_step(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = optimizer_step(*a, **k)
        end.record()
        optimizer_times.append((start, end))
        return result

    def timed_train_step(data_iterator):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        train_step(data_iterator)
        end.record()
        torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - began)
        device_times.append(start.elapsed_time(end) / 1e3)

    log = trainer.metrics_processor.log

    def record_loss(step, loss, *rest, **kwargs):
        losses.append(float(loss))
        return log(step, loss, *rest, **kwargs)

    trainer.train_step = timed_train_step
    trainer.optimizers.step = timed_optimizer_step
    trainer.metrics_processor.log = record_loss
    torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    timed = slice(args.warmup, None)
    optimizer_ms = [s.elapsed_time(e) for s, e in optimizer_times][timed]
    result = {
        "step_s_host": statistics.median(step_times[timed]),
        "step_s_device": statistics.median(device_times[timed]),
        "optimizer_step_ms": statistics.median(optimizer_ms),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "first_step_s": step_times[0],
        "losses": losses,
        "gpu": torch.cuda.get_device_name(device),
        "shims": shims,
    }
    trainer.close()
    return result


def _torch_functions_torchtitan_calls() -> list[str]:
    """Give torch the functions torchtitan 0.3.0 calls that this torch lacks; their names."""
    import torch.distributed as dist

    shims = []
    if not hasattr(dist, "set_timeout"):  # torch 2.13: the method of each process group

        def set_timeout(timeout, group=None):
            (group if group is not None else dist.group.WORLD).set_timeout(timeout)

        dist.set_timeout = set_timeout
        shims.append("torch.distributed.set_timeout (ProcessGroup.set_timeout)")
    return shims


def _write(path: Path, record: dict) -> None:
    record["date"] = time.strftime("%Y-%m-%d")
    record["git_sha"] = os.environ.get("GIT_SHA", "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))


def _print_table(record: dict) -> None:
    base = record["variants"].get("adamw", {})
    print(
        f"{'variant':<10} {'step host s':>12} {'step dev s':>11} {'opt ms':>8} {'GiB':>6}  vs adamw"
    )
    for name, result in record["variants"].items():
        if "error" in result:
            print(f"{name:<10} error: {result['error'].splitlines()[-1][:90]}")
            continue
        ratio = (
            result["step_s_host"] / base["step_s_host"] if "step_s_host" in base else float("nan")
        )
        print(
            f"{name:<10} {result['step_s_host']:>12.4f} {result['step_s_device']:>11.4f} "
            f"{result['optimizer_step_ms']:>8.1f} {result['peak_memory_gib']:>6.1f}  {ratio:.2f}x"
        )


if __name__ == "__main__":
    main()
