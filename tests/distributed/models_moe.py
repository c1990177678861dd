"""A tiny mixture-of-experts decoder for protocol tests: a router and stacked experts.

Each block keeps its experts as (E, m, n) tensors, as Mixtral-style grouped GEMMs do: ``w_in``
(E, hidden, dim) is used through one ``torch.bmm`` over every expert, ``w_out`` (E, dim, hidden)
through per-expert matmuls on slices ``w_out[e]`` of the tokens routed to expert ``e`` (top-2).
Shapes are uneven (dim 20, hidden 36) so the two stacks' matrices are (36, 20) and (20, 36): one
batched Newton-Schulz shape, oriented both ways.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.distributed.models import VOCAB

DIM = 20
HIDDEN = 36
NUM_EXPERTS = 8
TOP_K = 2


class MoEBlock(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, num_experts: int = NUM_EXPERTS):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.moe_norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, hidden, dim) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(num_experts, dim, hidden) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.q_proj(self.attn_norm(x)))
        return x + self._experts(self.moe_norm(x))

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # (N, dim)
        gates = torch.softmax(self.router(tokens), dim=-1)  # (N, E)
        weights, chosen = gates.topk(TOP_K, dim=-1)  # (N, k)
        num_experts = self.w_in.shape[0]
        # Every expert's input projection in one grouped GEMM: (E, N, dim) x (E, dim, hidden).
        hidden = F.gelu(torch.bmm(tokens.expand(num_experts, -1, -1), self.w_in.mT))
        out = torch.zeros_like(tokens)
        for expert in range(num_experts):
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            expert_out = hidden[expert, rows] @ self.w_out[expert].T  # (n_e, dim)
            out = out.index_add(0, rows, expert_out * weights[rows, slot, None])
        return out.reshape(x.shape)


class MoEDecoder(nn.Module):
    def __init__(self, num_layers: int = 2, *, checkpoint_layers: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoEBlock() for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.checkpoint_layers = checkpoint_layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpoint_layers else layer(x)
        return self.lm_head(self.norm(x))


def moe_predicate(name: str, param: nn.Parameter) -> bool:
    """The projections and the expert stacks; the router stays with FSDP2 (AdamW)."""
    return ("proj" in name and param.ndim == 2) or param.ndim == 3


def expert_stack_names(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if param.ndim == 3]
