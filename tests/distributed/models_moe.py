"""A tiny mixture-of-experts decoder for protocol tests: a router and stacked experts.

Each block keeps its experts as (E, m, n) tensors, as Mixtral-style grouped GEMMs do: ``w_in``
(E, hidden, dim) is used through one ``torch.bmm`` over every expert, ``w_out`` (E, dim, hidden)
through per-expert matmuls on slices ``w_out[e]`` of the tokens routed to expert ``e`` (top-2).
Shapes are uneven (dim 20, hidden 36) so the two stacks' matrices are (36, 20) and (20, 36): one
batched Newton-Schulz shape, oriented both ways.

Expert parallelism (``shard_experts``): each rank of an ``ep`` group keeps only its EP slot's
experts ``[first, first + E / ep)`` of both stacks (a local (E / ep, m, n) tensor, or a DTensor
sharded Shard(0) over the ep mesh as torchtitan's ``ExpertParallel`` makes it) and the block
dispatches tokens with a real ``all_to_all`` over the ep group (autograd through
``torch.distributed.nn.functional.all_to_all_single``). The dispatch is *dense*: every rank sends
all its tokens, each with its (N, E) combine weights (the top-2 gates, zeros elsewhere), to every
ep rank; each runs its local experts on the tokens routed to them (none: the expert is skipped,
as in one process), and a second all-to-all returns each rank's partial outputs to the tokens'
rank, which sums them. Equal splits keep it simple; the experts' math is the one-process
block's, so dmuon on it is compared with the single-process reference on the full model.
``blocked_experts`` masks experts out of the router for a step (they get no tokens anywhere).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard
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
        self.num_experts = num_experts
        # Expert parallelism (``shard_experts``): the ep group and this rank's first expert.
        self.ep_group: dist.ProcessGroup | None = None
        self.first_expert = 0
        self.blocked_experts: tuple[int, ...] = ()  # routed no token while set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.q_proj(self.attn_norm(x)))
        return x + self._experts(self.moe_norm(x))

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # (N, dim)
        logits = self.router(tokens)
        if self.blocked_experts:
            blocked = torch.zeros(logits.shape[-1], dtype=torch.bool)
            blocked[list(self.blocked_experts)] = True
            logits = logits.masked_fill(blocked, float("-inf"))
        gates = torch.softmax(logits, dim=-1)  # (N, E)
        weights, chosen = gates.topk(TOP_K, dim=-1)  # (N, k)
        if self.ep_group is not None:
            return self._dispatch(tokens, weights, chosen).reshape(x.shape)
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

    def _dispatch(self, tokens, weights, chosen) -> torch.Tensor:
        """Every token to every ep rank, their experts' outputs back (see the module docstring)."""
        ep = dist.get_world_size(self.ep_group)
        combine = torch.zeros(tokens.shape[0], self.num_experts).scatter(1, chosen, weights)
        payload = torch.cat([tokens, combine], dim=1).repeat(ep, 1)  # one copy per ep rank
        received = all_to_all_single(torch.empty_like(payload), payload, group=self.ep_group)
        their_tokens, their_combine = received.split([tokens.shape[1], self.num_experts], dim=1)
        partial = self._local_experts(their_tokens, their_combine)
        returned = all_to_all_single(torch.empty_like(partial), partial, group=self.ep_group)
        return returned.view(ep, *tokens.shape).sum(0)

    def _local_experts(self, tokens, combine) -> torch.Tensor:
        """This rank's experts on the tokens routed to them, weighted by their gates."""
        w_in, w_out = _local(self.w_in), _local(self.w_out)
        local_experts = w_in.shape[0]
        hidden = F.gelu(torch.bmm(tokens.expand(local_experts, -1, -1), w_in.mT))
        out = torch.zeros_like(tokens)
        for expert in range(local_experts):
            gate = combine[:, self.first_expert + expert]
            rows = gate.nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            expert_out = hidden[expert, rows] @ w_out[expert].T
            out = out.index_add(0, rows, expert_out * gate[rows, None])
        return out


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


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


def shard_experts(model: MoEDecoder, ep_mesh, *, as_dtensor: bool) -> None:
    """Keep this rank's EP slot of every expert stack, as a DTensor sharded Shard(0) over
    ``ep_mesh`` (torchtitan's layout) or as the local (E / ep, m, n) tensor, and dispatch tokens
    over ``ep_mesh``'s group; before ``dmuon.dedicate_params``."""
    ep, slot = ep_mesh.size(), ep_mesh.get_local_rank()
    for block in model.layers:
        per_slot = block.num_experts // ep
        block.ep_group = ep_mesh.get_group()
        block.first_expert = slot * per_slot
        for attr in ("w_in", "w_out"):
            mine = getattr(block, attr).detach()[slot * per_slot : (slot + 1) * per_slot].clone()
            if as_dtensor:
                mine = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)
            setattr(block, attr, nn.Parameter(mine))
