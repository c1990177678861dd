"""The tiny decoder ``run_protocol_cuda.py`` trains, its data, and how it is dedicated and sharded.

The benchmark's own copy of the model of the CPU protocol tests (``tests/distributed/models.py``),
so that no benchmark imports the test suite: the same shapes, deliberately uneven (rows not
divisible by the world size, a 1 x n matrix), so FSDP2 sharding and dmuon packing meet their
edge cases on CUDA too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon

VOCAB = 37
DIM = 30
FFN = 52


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=True)
        self.gate_proj = nn.Linear(DIM, 1, bias=False)  # a 1 x n matrix
        self.mlp_norm = nn.LayerNorm(DIM)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.o_proj(torch.tanh(self.q_proj(h))) * torch.sigmoid(self.gate_proj(h))
        return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))


class TinyDecoder(nn.Module):
    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def proj_predicate(name: str, param: nn.Parameter) -> bool:
    return "proj" in name and param.ndim == 2


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batches(num_steps: int, world_size: int, per_rank: int = 2, seq: int = 9, seed: int = 1234):
    """The full batch of every step, [world_size * per_rank, seq]; rank r takes its rows."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (world_size * per_rank, seq), generator=generator)
        for _ in range(num_steps)
    ]


def rank_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def dedicate_and_shard(model: nn.Module, device_type: str, replicas: int, reshard: bool) -> None:
    """What a user writes: a 1-D or ("replicate", "shard") mesh, ``dedicate_params`` on the
    projections, then ``fully_shard`` per layer and on the root."""
    world = dist.get_world_size()
    if replicas > 1:
        mesh = init_device_mesh(
            device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
        shard_mesh, replicate_mesh, fsdp_mesh = mesh["shard"], mesh["replicate"], mesh
    else:
        shard_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        replicate_mesh, fsdp_mesh = None, shard_mesh
    dmuon.dedicate_params(
        model,
        shard_mesh,
        proj_predicate,
        replicate_mesh=replicate_mesh,
        reshard_after_forward=reshard,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard)
