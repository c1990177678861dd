"""dmuon.checkpoint on CUDA tensors: save midway, resume, and compare with the uninterrupted run.

A small decoder (defined here) with ``dedicate_params`` on its projections, ``fully_shard`` per
layer and root, and ``dmuon.Muon`` (fp32 Newton-Schulz, cuBLAS; the AdamW route runs torch's
fused AdamW on CUDA) trains ``2 * --steps`` steps; a sharded checkpoint is written after
``--steps``. A fresh model and optimizer load it and train the remaining steps. Rank 0 compares
the final full weights of the two runs (bit for bit on the same world size), and checks the
full state dict with and without ``cpu_offload`` (keys, shapes, dtypes of the plain model, and
equal values).

Usage (GPU machine, repository root, packages importable)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/checks/run_checkpoint_cuda.py --backend gloo
    python -m torch.distributed.run --nproc-per-node 1 benchmarks/checks/run_checkpoint_cuda.py --backend nccl
    ... --device cpu    # the same on CPU (a smoke test of this script)

Rank 0 prints a table and writes JSON (``--out``, default
``benchmarks/results/checkpoint-cuda-<device>-<backend>-w<world>-<date>.json``). Exit code 1 when
a check fails.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

_common.add_package_sources_if_missing()  # before dmuon is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import dmuon  # noqa: E402
import dmuon.checkpoint as dckpt  # noqa: E402
from dmuon_kernels.newton_schulz import NewtonSchulz  # noqa: E402

VOCAB, DIM, FFN, LAYERS, ROWS, SEQ = 97, 64, 176, 3, 8, 17


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down_proj(F.gelu(self.up_proj(torch.tanh(self.q_proj(h)))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def build(device: torch.device):
    torch.manual_seed(0)
    model = Decoder().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))
    dmuon.dedicate_params(model, mesh, lambda name, p: "proj" in name and p.ndim == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    newton_schulz = NewtonSchulz(dtype=torch.float32, kernel="cublas")
    return model, dmuon.Muon(model, ns_backend=newton_schulz, weight_decay=0.01)


def train(model, optimizer, steps: range, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (ROWS * world, SEQ), generator=generator)
        tokens = tokens[rank * ROWS : (rank + 1) * ROWS].to(device)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def run(args, device: torch.device, folder: Path) -> dict:
    full_on_rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optimizer = build(device)
    train(model, optimizer, range(args.steps), device)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, folder / "step")
    train(model, optimizer, range(args.steps, 2 * args.steps), device)
    uninterrupted = dckpt.get_model_state_dict(model, options=full_on_rank0)
    everywhere = dckpt.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    _, optim_full = dckpt.get_state_dict(model, optimizer, options=full_on_rank0)

    resumed_model, resumed_optimizer = build(device)
    model_sd, optim_sd = dckpt.get_state_dict(resumed_model, resumed_optimizer)
    dckpt.load({"model": model_sd, "optim": optim_sd}, folder / "step")
    dckpt.set_state_dict(
        resumed_model, resumed_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    train(resumed_model, resumed_optimizer, range(args.steps, 2 * args.steps), device)
    resumed = dckpt.get_model_state_dict(resumed_model, options=full_on_rank0)
    if dist.get_rank() != 0:
        return {}
    plain = Decoder().state_dict()
    return {
        "keys_shapes_dtypes_of_the_plain_model": {
            k: (tuple(v.shape), v.dtype) for k, v in uninterrupted.items()
        }
        == {k: (tuple(v.shape), v.dtype) for k, v in plain.items()},
        "full_everywhere_equals_full_on_rank0": all(
            torch.equal(everywhere[k].cpu(), v) for k, v in uninterrupted.items()
        ),
        "optimizer_entries": sum(len(v) for v in optim_full["state"].values()),
        "resume_bit_identical": all(torch.equal(resumed[k], v) for k, v in uninterrupted.items()),
        "max_relative_difference": max(
            ((resumed[k] - v).norm() / v.norm().clamp_min(1e-30)).item()
            for k, v in uninterrupted.items()
        ),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--steps", type=int, default=3, help="steps before and after the save")
    _common.add_record_options(parser)
    args = parser.parse_args(argv)
    device = _common.start_process_group(
        "run_checkpoint_cuda", args.device, args.backend, "--device cpu --backend gloo"
    )
    folder = [tempfile.mkdtemp(prefix="dmuon-ckpt-cuda-")]
    dist.broadcast_object_list(folder, src=0)
    result = run(args, device, Path(folder[0]))
    world = dist.get_world_size()
    failed = False
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
        label = _common.device_name(device)
        print(f"run_checkpoint_cuda: {label} x {world} ({args.backend}), torch {torch.__version__}")
        for key, value in result.items():
            print(f"  {key:<42}{value}")
        failed = not all(
            result[k]
            for k in (
                "keys_shapes_dtypes_of_the_plain_model",
                "full_everywhere_equals_full_on_rank0",
                "resume_bit_identical",
            )
        )
        date = _common.utc_now()
        record = {
            "benchmark": "run_checkpoint_cuda",
            "device": label,
            "world_size": world,
            "backend": args.backend,
            **_common.versions(dmuon=dmuon.__version__),
            "git_sha": _common.git_sha(args.git_sha),
            "date": _common.iso_seconds(date),
            "inputs": {"steps": args.steps, "model": [VOCAB, DIM, FFN, LAYERS, ROWS, SEQ]},
            "results": result,
        }
        out = args.out or _common.result_path(
            "checkpoint-cuda", label, date, args.backend, f"w{world}"
        )
        _common.write_json(out, record)
    dist.destroy_process_group()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
