"""Tiny models for protocol tests: decoder-shaped, with the awkward cases built in.

Shapes are deliberately uneven (rows not divisible by the world size, a 1 x n matrix) so FSDP2
sharding and dmuon packing meet their edge cases on every run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 37
DIM = 30
FFN = 52


class Block(nn.Module):
    def __init__(self, dim: int = DIM, ffn: int = FFN) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=True)
        self.gate_proj = nn.Linear(dim, 1, bias=False)  # a 1 x n matrix
        self.mlp_norm = nn.LayerNorm(dim)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.o_proj(torch.tanh(self.q_proj(h))) * torch.sigmoid(self.gate_proj(h))
        return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))


class TinyDecoder(nn.Module):
    def __init__(
        self,
        num_layers: int = 3,
        *,
        tie_embeddings: bool = False,
        checkpoint_layers: bool = False,
        skip_layer: int | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.checkpoint_layers = checkpoint_layers
        # A layer that is skipped in forward gets no gradient (an unused branch).
        self.skip_layer = skip_layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for index, layer in enumerate(self.layers):
            if index == self.skip_layer:
                continue
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpoint_layers else layer(x)
        return self.lm_head(self.norm(x))


def proj_predicate(name: str, param: nn.Parameter) -> bool:
    return "proj" in name and param.ndim == 2


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batches(num_steps: int, world_size: int, per_rank: int = 2, seq: int = 9, seed: int = 1234):
    """The full batch of every step, [world_size * per_rank, seq]; rank r takes rows r::world."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (world_size * per_rank, seq), generator=generator)
        for _ in range(num_steps)
    ]


def rank_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]
