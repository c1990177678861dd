"""Scenarios of QK-clip (``dmuon.QKClip``): a tiny attention decoder trained a few steps with a
threshold low enough to clip, against a single-process reference that applies the clip from the
formula (Kimi K2, arXiv 2507.20534: gamma = tau / S_max per head, W_q^h by gamma^alpha, W_k^h by
gamma^(1 - alpha); a shared key head of grouped-query attention left alone and gamma on the
query, or with ``gqa="per_key_group"`` one gamma per key group from its worst head, split by
alpha; QK-norm gains by one factor per layer), written here head by head with Python floats.

Each runs on every rank of a gloo pool: 1-D, HSDP (replicate x shard) or dp x tp with torch's
``parallelize_module`` (q/k/v colwise: each TP rank computes and records its own heads).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.testing import batches, dedicate_and_shard_on, rank_rows
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.scenarios_tensor_parallel import full_weights
from tests.reference_optim import ReferenceMuonAdamW

VOCAB = 37
DIM = 24
HEAD_DIM = 4
NUM_HEADS = 4
STEPS = 4


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, heads, seq, head_dim) by position (rotate-half form)."""
    seq, half = x.shape[2], x.shape[3] // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, kv_heads: int, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, NUM_HEADS * HEAD_DIM, bias=bias)
        self.k_proj = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=bias)
        self.v_proj = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(NUM_HEADS * HEAD_DIM, DIM, bias=False)
        self.q_norm = nn.RMSNorm(HEAD_DIM) if qk_norm else None
        self.k_norm = nn.RMSNorm(HEAD_DIM) if qk_norm else None
        self.record = None  # called with the (heads,) maxima of each forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism this rank's heads.
        q = self.q_proj(x).view(batch, seq, -1, HEAD_DIM)
        k = self.k_proj(x).view(batch, seq, -1, HEAD_DIM)
        v = self.v_proj(x).view(batch, seq, -1, HEAD_DIM).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q.transpose(1, 2)), rope(k.transpose(1, 2))
        if self.record is not None:
            self.record(dmuon.attention_max_logits(q, k, scaling=HEAD_DIM**-0.5, is_causal=True))
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, **attention) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.attn = Attention(**attention)
        self.mlp_norm = nn.LayerNorm(DIM)
        self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))


class AttentionDecoder(nn.Module):
    def __init__(self, num_layers: int = 2, **attention) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(**attention) for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def make_model(kv_heads: int = 2, bias: bool = True, qk_norm: bool = False) -> AttentionDecoder:
    torch.manual_seed(0)
    model = AttentionDecoder(kv_heads=kv_heads, bias=bias, qk_norm=qk_norm)
    with torch.no_grad():  # larger q/k weights: logits of a few units, so a tau of 1-2 clips
        for layer in model.layers:
            layer.attn.q_proj.weight.mul_(6.0)
            layer.attn.k_proj.weight.mul_(6.0)
    return model


def attention_heads(model: AttentionDecoder) -> list[dmuon.AttentionHeads]:
    heads = []
    for i, layer in enumerate(model.layers):
        attn, prefix = layer.attn, f"layers.{i}.attn"
        bias = attn.q_proj.bias is not None
        norm = attn.q_norm is not None
        heads.append(
            dmuon.AttentionHeads(
                name=prefix,
                q_weight=f"{prefix}.q_proj.weight",
                k_weight=f"{prefix}.k_proj.weight",
                num_heads=NUM_HEADS,
                num_kv_heads=attn.k_proj.out_features // HEAD_DIM,
                q_bias=f"{prefix}.q_proj.bias" if bias else None,
                k_bias=f"{prefix}.k_proj.bias" if bias else None,
                q_norm=f"{prefix}.q_norm.weight" if norm else None,
                k_norm=f"{prefix}.k_norm.weight" if norm else None,
            )
        )
    return heads


def predicate_of(k_on_adamw: bool):
    """The projections, k_proj left to FSDP2 (the AdamW route) if ``k_on_adamw``."""

    def predicate(name: str, param: nn.Parameter) -> bool:
        if k_on_adamw and "k_proj" in name:
            return False
        return "proj" in name and param.ndim == 2

    return predicate


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---- the reference, from the formula ----------------------------------------------------------


@torch.no_grad()
def reference_qk_clip(
    model: AttentionDecoder, maxima: dict[int, torch.Tensor], tau, alpha, gqa="per_query_head"
) -> int:
    """Kimi K2's QK-clip on the full model, one head at a time (``gqa="per_key_group"``: one
    gamma per key group, from its worst head); returns the heads over the threshold."""
    clipped = 0
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        kv_heads = attn.k_proj.out_features // HEAD_DIM
        s_max = [float(s) for s in maxima[i]]
        if attn.q_norm is not None:  # shared gains: one gamma for the layer
            worst = max(s_max)
            if worst > tau:
                gamma = tau / worst
                attn.q_norm.weight.mul_(gamma**alpha)
                attn.k_norm.weight.mul_(gamma ** (1 - alpha))
                clipped += sum(s > tau for s in s_max)
            continue
        if kv_heads < NUM_HEADS and gqa == "per_key_group":
            group = NUM_HEADS // kv_heads
            clipped += sum(s > tau for s in s_max)
            for g in range(kv_heads):
                worst = max(s_max[g * group : (g + 1) * group])
                if worst <= tau:
                    continue
                gamma = tau / worst
                q_rows = slice(g * group * HEAD_DIM, (g + 1) * group * HEAD_DIM)
                k_rows = slice(g * HEAD_DIM, (g + 1) * HEAD_DIM)
                for proj, rows, factor in ((attn.q_proj, q_rows, gamma**alpha),
                                           (attn.k_proj, k_rows, gamma ** (1 - alpha))):  # fmt: skip
                    proj.weight[rows] *= factor
                    if proj.bias is not None:
                        proj.bias[rows] *= factor
            continue
        for h, s in enumerate(s_max):
            if s <= tau:
                continue
            clipped += 1
            gamma = tau / s
            q_factor = gamma**alpha if kv_heads == NUM_HEADS else gamma
            rows = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
            attn.q_proj.weight[rows] *= q_factor
            if attn.q_proj.bias is not None:
                attn.q_proj.bias[rows] *= q_factor
            if kv_heads == NUM_HEADS:  # a shared key head (GQA) is left alone
                attn.k_proj.weight[rows] *= gamma ** (1 - alpha)
                if attn.k_proj.bias is not None:
                    attn.k_proj.bias[rows] *= gamma ** (1 - alpha)
    return clipped


def build_reference(model_options: dict, k_on_adamw: bool):
    reference = make_model(**model_options)
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        predicate_of(k_on_adamw),
        lr=0.02,
        weight_decay=0.01,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    maxima: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(reference.layers):
        layer.attn.record = functools.partial(maxima.__setitem__, i)
    return reference, optimizer, maxima


def relative_errors(weights: dict[str, torch.Tensor], reference: nn.Module) -> dict[str, float]:
    expected = dict(reference.named_parameters())
    return {
        name: ((value - expected[name]).norm() / expected[name].norm().clamp_min(1e-30)).item()
        for name, value in weights.items()
    }


# ---- the scenarios ---------------------------------------------------------------------------


def build_distributed(mesh_kind: str, model_options: dict, k_on_adamw: bool):
    """The model on a 1-D, HSDP or dp x tp mesh over every rank; (model, data rank, data
    ranks)."""
    world = dist.get_world_size()
    model = make_model(**model_options)
    if mesh_kind == "1d":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        shard, replicate, fsdp, dp_rank, dp = mesh, None, mesh, mesh.get_local_rank(), world
    elif mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        shard, replicate, fsdp = mesh["shard"], mesh["replicate"], mesh
        dp_rank, dp = dist.get_rank(), world
    else:  # "tp": dp x 2
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = {
            "layers.*.attn.q_proj": ColwiseParallel(),
            "layers.*.attn.k_proj": ColwiseParallel(),
            "layers.*.attn.v_proj": ColwiseParallel(),
            "layers.*.attn.o_proj": RowwiseParallel(),
        }
        parallelize_module(model, mesh["tp"], plan)
        shard, replicate, fsdp = mesh["dp"], None, mesh["dp"]
        dp_rank, dp = mesh["dp"].get_local_rank(), world // 2
    dedicate_and_shard_on(
        model, shard, replicate_mesh=replicate, fsdp_mesh=fsdp, predicate=predicate_of(k_on_adamw)
    )
    return model, dp_rank, dp


def train_with_qk_clip(
    *,
    mesh_kind: str,
    threshold: float,
    alpha: float = 0.5,
    gqa: str = "per_query_head",
    steps: int = STEPS,
    k_on_adamw: bool = False,
    **model_options,
) -> dict:
    """``steps`` steps of dmuon.Muon + QKClip beside the reference; the worst relative weight
    error after each step, and the heads clipped per step on both sides."""
    model, dp_rank, dp = build_distributed(mesh_kind, model_options, k_on_adamw)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )
    clip = dmuon.QKClip(
        model, optimizer, attention_heads(model), threshold=threshold, alpha=alpha, gqa=gqa
    )
    for i, layer in enumerate(model.layers):
        layer.attn.record = functools.partial(clip.record, f"layers.{i}.attn")
    reference, reference_optimizer, maxima = build_reference(model_options, k_on_adamw)
    max_errors, clipped, reference_clipped, max_logit_errors = [], [], [], []
    for batch in batches(steps, dp, seq=7):
        loss_of(model, rank_rows(batch, dp_rank, dp)).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_of(reference, batch).backward()
        reference_optimizer.step()
        reference_clipped.append(reference_qk_clip(reference, maxima, threshold, alpha, gqa))
        reference_optimizer.zero_grad()
        clipped.append(clip.clipped_heads)
        max_logit_errors.append(
            max(
                (clip.last_max_logits[f"layers.{i}.attn"] - maxima[i]).abs().max().item()
                for i in maxima
            )
        )
        errors = relative_errors(full_weights(model), reference)
        max_errors.append(max(errors.values()))
    state = get_dedicated_state(model)
    return {
        "max_errors": max_errors,
        "clipped": clipped,
        "reference_clipped": reference_clipped,
        "max_logit_errors": max_logit_errors,
        "dedicated": sorted(state.params),
        "rank": dist.get_rank(),
    }


def never_reached_threshold_is_bitwise_no_clip(*, mesh_kind: str, **model_options) -> dict:
    """Two identical models, one with a QKClip whose threshold no head reaches: after a few
    steps every weight this rank holds is bitwise equal."""
    results = []
    for with_clip in (False, True):
        model, dp_rank, dp = build_distributed(mesh_kind, model_options, k_on_adamw=False)
        optimizer = dmuon.Muon(model, lr=0.02, weight_decay=0.01)
        clip = None
        if with_clip:
            clip = dmuon.QKClip(model, optimizer, attention_heads(model), threshold=1e6)
            for i, layer in enumerate(model.layers):
                layer.attn.record = functools.partial(clip.record, f"layers.{i}.attn")
        for batch in batches(STEPS, dp, seq=7):
            loss_of(model, rank_rows(batch, dp_rank, dp)).backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append((full_weights(model), clip))
    (plain, _), (clipped, clip) = results
    return {
        "bitwise_equal": plain.keys() == clipped.keys()
        and all(torch.equal(plain[name], clipped[name]) for name in plain),
        "max_logit": max(m.max().item() for m in clip.last_max_logits.values()),
        "clipped_heads": clip.clipped_heads,
    }


def unrecorded_layer_raises_everywhere() -> dict:
    """Layer 1 never records: the step raises on every rank, before any weight changes."""
    model, dp_rank, dp = build_distributed("1d", {}, k_on_adamw=False)
    optimizer = dmuon.Muon(model, lr=0.02)
    clip = dmuon.QKClip(model, optimizer, attention_heads(model), threshold=1.0)
    model.layers[0].attn.record = functools.partial(clip.record, "layers.0.attn")
    before = {name: value.clone() for name, value in full_weights(model).items()}
    loss_of(model, rank_rows(batches(1, dp, seq=7)[0], dp_rank, dp)).backward()
    try:
        optimizer.step()
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    after = full_weights(model)
    return {
        "message": message,
        "unchanged": all(torch.equal(before[name], after[name]) for name in before),
    }


def max_logits_reduce_over_ranks() -> dict:
    """Each rank records a different maximum for a head: every rank sees the largest."""
    model, _, _ = build_distributed("1d", {}, k_on_adamw=False)
    optimizer = dmuon.Muon(model, lr=0.0, adamw_lr=0.0)
    clip = dmuon.QKClip(model, optimizer, attention_heads(model), threshold=1e6)
    rank = dist.get_rank()
    for name in clip.layers:
        clip.record(name, torch.full((NUM_HEADS,), float(rank)) + torch.arange(NUM_HEADS) * 10)
    optimizer.step()
    world = dist.get_world_size()
    return {
        name: values.tolist() == [world - 1 + 10.0 * h for h in range(NUM_HEADS)]
        for name, values in clip.last_max_logits.items()
    }
