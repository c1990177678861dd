"""A decoder whose attention projects q, k and v with one fused matrix, checkpointed as three.

``FusedQKV`` holds ``wqkv``, one ``nn.Linear`` whose output rows are grouped per key/value head
as (n_kv_heads, group + 2, head_dim): the ``group`` query heads that share the key/value head,
then its key head, then its value head. Its checkpoints hold the unfused layout of ``SplitQKV``
(``wq``, ``wk``, ``wv``): a state-dict post-hook splits ``wqkv.weight`` and ``wqkv.bias`` into
the three keys, and a load pre-hook merges them back. As such hooks in training frameworks do,
both reshape and slice the value, gather a DTensor to ``Replicate`` first (the reshape needs the
whole leading dim; the result stays a DTensor), and skip a key that is not there (a sharded state
dict holds some keys on some ranks only). ``FusedDecoder(fused=False)`` is the same model with
``SplitQKV``: the same weights under the same keys, so checkpoints move between the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

VOCAB = 37
DIM = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = DIM // HEADS
GROUP = HEADS // KV_HEADS  # query heads per key/value head
FFN = 52
SPLIT_NAMES = ("wq", "wk", "wv")


class FusedQKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, KV_HEADS * (GROUP + 2) * HEAD_DIM, bias=True)
        self.register_state_dict_post_hook(_split_on_save)
        self.register_load_state_dict_pre_hook(_merge_on_load)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        qkv = self.wqkv(x).view(batch, seq, KV_HEADS, GROUP + 2, HEAD_DIM)
        q, k, v = qkv.split([GROUP, 1, 1], dim=3)
        return (
            q.reshape(batch, seq, HEADS, HEAD_DIM),
            k.reshape(batch, seq, KV_HEADS, HEAD_DIM),
            v.reshape(batch, seq, KV_HEADS, HEAD_DIM),
        )


def _grouped(tensor: torch.Tensor) -> torch.Tensor:
    """``wqkv``'s weight (rows, DIM) or bias (rows,) as (KV_HEADS, GROUP + 2, HEAD_DIM, ...)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
    return tensor.reshape(KV_HEADS, GROUP + 2, HEAD_DIM, *tensor.shape[1:])


def _split_on_save(module, state_dict, prefix, local_metadata) -> None:
    for kind in ("weight", "bias"):
        key = f"{prefix}wqkv.{kind}"
        if key not in state_dict:
            continue
        grouped = _grouped(state_dict.pop(key))
        tail = grouped.shape[3:]
        parts = grouped.split([GROUP, 1, 1], dim=1)
        for name, part in zip(SPLIT_NAMES, parts):
            state_dict[f"{prefix}{name}.{kind}"] = part.reshape(-1, *tail).contiguous()


def _merge_on_load(module, state_dict, prefix, *args) -> None:
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name in SPLIT_NAMES]
        if not all(key in state_dict for key in keys):
            continue
        q, k, v = (state_dict.pop(key) for key in keys)
        if isinstance(q, DTensor):
            q, k, v = (t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
                       for t in (q, k, v))  # fmt: skip
        tail = q.shape[1:]
        merged = torch.cat(
            [
                q.reshape(KV_HEADS, GROUP, HEAD_DIM, *tail),
                k.reshape(KV_HEADS, 1, HEAD_DIM, *tail),
                v.reshape(KV_HEADS, 1, HEAD_DIM, *tail),
            ],
            dim=1,
        )
        state_dict[f"{prefix}wqkv.{kind}"] = merged.reshape(-1, *tail)


class SplitQKV(nn.Module):
    """The unfused projections, in the layout ``FusedQKV`` checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=True)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=True)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        return (
            self.wq(x).view(batch, seq, HEADS, HEAD_DIM),
            self.wk(x).view(batch, seq, KV_HEADS, HEAD_DIM),
            self.wv(x).view(batch, seq, KV_HEADS, HEAD_DIM),
        )


class Block(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.qkv = FusedQKV() if fused else SplitQKV()
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = nn.LayerNorm(DIM)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x))  # (batch, seq, heads, HEAD_DIM)
        # Query/key norm: without it the key bias would shift every score of a query alike and
        # get no gradient but rounding noise.
        q, k = (F.rms_norm(t, (HEAD_DIM,)) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(GROUP, dim=1) for t in (k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attended.transpose(1, 2).flatten(2))
        return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))


class FusedDecoder(nn.Module):
    def __init__(self, num_layers: int = 2, *, fused: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(fused) for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def matrices(name: str, param: nn.Parameter) -> bool:
    """The dedicated parameters: the fused projection and the other block matrices."""
    return param.ndim == 2 and name.startswith("layers.")
