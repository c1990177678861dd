"""dmuon demo: train a small decoder on 4 CPU processes (gloo), dmuon on FSDP2 next to FSDP2 + AdamW.

Usage::

    hatch run demo                 # = python examples/demo.py
    python examples/demo.py --steps 60 --ranks 2

Run plainly, this script launches itself on ``--ranks`` local processes through
``torch.distributed.run --standalone`` (free port, ``OMP_NUM_THREADS=1``). Each process builds the
same decoder twice from the same seed: one copy gets dmuon's three-line integration
(``dedicate_params`` -> ``fully_shard`` per layer and root -> ``dmuon.Muon``), the other plain
``fully_shard`` + ``torch.optim.AdamW``. Both train on the same batches of a synthetic task: token
sequences drawn from a fixed random bigram rule in which every token has 4 possible successors,
so the best achievable loss is ln 4 ≈ 1.386 (ln 256 ≈ 5.545 for a uniform guess).

Rank 0 prints who owns each projection matrix, the partition's imbalance, and both losses (mean
over ranks) as training goes. Everything printed is measured in this run.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256
SUCCESSORS_PER_TOKEN = 4  # the task's entropy floor is ln(SUCCESSORS_PER_TOKEN)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the model -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderConfig:
    vocab_size: int = VOCAB_SIZE
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    ffn_dim: int = 384


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a SwiGLU MLP."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        dim, ffn = config.dim, config.ffn_dim
        self.num_heads = config.num_heads
        self.attn_norm = nn.RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, dim)
        batch, seq, dim = x.shape
        h = self.attn_norm(x)

        def heads(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, seq, head_dim)
            return t.view(batch, seq, self.num_heads, dim // self.num_heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attention.transpose(1, 2).reshape(batch, seq, dim))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (batch, seq) -> logits
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---- the task ------------------------------------------------------------------------------------


class BigramTask:
    """Sequences from a fixed random rule: token t is followed by one of its 4 successors."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(
            0, VOCAB_SIZE, (VOCAB_SIZE, SUCCESSORS_PER_TOKEN), generator=generator
        )
        self.generator = torch.Generator().manual_seed(seed + 1)

    def batch(self, rows: int, seq_len: int) -> torch.Tensor:  # (rows, seq_len)
        tokens = torch.empty(rows, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB_SIZE, (rows,), generator=self.generator)
        choices = torch.randint(
            0, SUCCESSORS_PER_TOKEN, (rows, seq_len - 1), generator=self.generator
        )
        for position in range(1, seq_len):
            tokens[:, position] = self.successors[tokens[:, position - 1], choices[:, position - 1]]
        return tokens


# ---- the worker (one per rank) -------------------------------------------------------------------


def build_models(dp_mesh):
    """The same initial decoder twice: dmuon on FSDP2, and FSDP2 + AdamW."""
    from torch.distributed.fsdp import fully_shard

    import dmuon

    torch.manual_seed(0)
    model = Decoder(DecoderConfig())
    baseline = copy.deepcopy(model)

    # dmuon: the three-line integration (SPEC.md), as a user writes it.
    owners = dmuon.dedicate_params(
        model, dp_mesh, predicate=lambda name, p: "proj" in name and p.ndim == 2
    )
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

    # The baseline: FSDP2 + AdamW with the same learning rate as dmuon's AdamW route.
    for layer in baseline.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(baseline, mesh=dp_mesh)
    baseline_optimizer = torch.optim.AdamW(baseline.parameters(), lr=1e-3, weight_decay=0.01)
    return model, optimizer, owners, baseline, baseline_optimizer


def owner_table(owners: dict, num_layers: int) -> str:
    """Rows: layers; columns: the seven projections; cells: the owner rank."""
    width = max(len(name) for name in PROJECTIONS)
    lines = ["layer  " + " ".join(f"{name:>{width}}" for name in PROJECTIONS)]
    for index in range(num_layers):
        cells = [owners[f"layers.{index}.{name}.weight"].shard for name in PROJECTIONS]
        lines.append(f"{index:>5}  " + " ".join(f"{cell:>{width}}" for cell in cells))
    return "\n".join(lines)


def train_step(model, optimizer, tokens: torch.Tensor) -> tuple[float, float]:
    """One step; returns (loss averaged over ranks, seconds)."""
    started = time.perf_counter()
    loss = next_token_loss(model, tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    seconds = time.perf_counter() - started
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return mean_loss.item() / dist.get_world_size(), seconds


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon.hooks import get_dedicated_state

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    say = print if rank == 0 else (lambda *_, **__: None)

    model, optimizer, owners, baseline, baseline_optimizer = build_models(dp_mesh)
    plan = get_dedicated_state(model).plan
    num_layers = len(model.layers)
    say(f"dmuon {dmuon.__version__} · torch {torch.__version__} · {world} ranks (gloo, CPU)")
    ns_dtype = optimizer.newton_schulz.iteration_dtype(torch.device("cpu"))
    requested = (
        "auto: fp16 on CUDA, fp32 elsewhere" if optimizer.newton_schulz.dtype is None else "set"
    )
    say(f"Newton-Schulz: {dmuon.get_ns_backend()}, iteration dtype {ns_dtype} ({requested})")
    say(f"\nOwner rank of each projection matrix ({len(owners)} matrices):")
    say(owner_table(owners, num_layers))
    say(
        "(each of these matrices has < 5M elements, so a layer's matrices form one unit with one "
        "owner; large matrices get their own owner)"
    )
    say(
        "(the embedding, the norms and lm_head are not dedicated: their route is sharded_adamw, "
        "FSDP2 shards them and AdamW updates the shards; the dmuon log's route lines count both)"
    )
    say(f"\npartition imbalance (heaviest owner / mean): {plan.imbalance:.3f}")
    say(plan.describe())

    task = BigramTask(seed=0)
    floor = math.log(SUCCESSORS_PER_TOKEN)
    say(
        f"\ntask: next token of a random bigram rule, {SUCCESSORS_PER_TOKEN} successors per token "
        f"(best possible loss ln {SUCCESSORS_PER_TOKEN} = {floor:.3f}); "
        f"batch {args.batch_per_rank} x {args.seq_len} tokens per rank"
    )
    say("\n step   dmuon loss   FSDP2+AdamW loss")
    dmuon_seconds = baseline_seconds = 0.0
    for step in range(1, args.steps + 1):
        global_batch = task.batch(args.batch_per_rank * world, args.seq_len)
        tokens = global_batch[rank * args.batch_per_rank : (rank + 1) * args.batch_per_rank]
        dmuon_loss, seconds = train_step(model, optimizer, tokens)
        dmuon_seconds += seconds
        baseline_loss, seconds = train_step(baseline, baseline_optimizer, tokens)
        baseline_seconds += seconds
        if step == 1 or step % args.print_every == 0 or step == args.steps:
            say(f"{step:>5}   {dmuon_loss:>10.4f}   {baseline_loss:>16.4f}")
    say(
        f"\nfinal loss after {args.steps} steps: dmuon {dmuon_loss:.4f}, "
        f"FSDP2+AdamW {baseline_loss:.4f} (floor {floor:.3f})"
    )
    say(
        f"wall time per step on rank 0 (CPU, {world} processes sharing the cores): "
        f"dmuon {dmuon_seconds / args.steps * 1e3:.0f} ms, "
        f"FSDP2+AdamW {baseline_seconds / args.steps * 1e3:.0f} ms"
    )
    say(
        f"(CPU numbers say nothing about GPU speed: here Newton-Schulz runs in {ns_dtype} on "
        "cores every process shares, where a GPU runs it in fp16 on its matrix units)"
    )
    dist.destroy_process_group()
    exit_now(0)


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown.

    With torch 2.13 on gloo a process sometimes aborts while the interpreter shuts down, after
    ``destroy_process_group()`` ("terminate called without an active exception"); plain FSDP2
    without dmuon does it too. Everything is done and flushed by now, so skip that teardown.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the launcher --------------------------------------------------------------------------------


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        os.path.abspath(__file__),
        *argv,
    ]
    started = time.perf_counter()
    returncode = subprocess.call(command, env=env)
    print(f"demo finished in {time.perf_counter() - started:.1f} s (exit code {returncode})")
    return returncode


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="number of gloo processes (default 4)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-per-rank", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--print-every", type=int, default=5)
    return parser.parse_args(argv)


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # started by torch.distributed.run
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
