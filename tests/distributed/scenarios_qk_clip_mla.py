"""Scenarios of QK-clip on multi-head latent attention (``dmuon.MLAHeads``): a tiny decoder with
DeepSeek-V3's attention layout trained a few steps with a threshold low enough to clip, against a
single-process reference that applies Kimi K2's clip for MLA from the report (arXiv 2507.20534,
section 2.1: gamma_h = tau / S_max^h; the head's content query and content key rows each by
sqrt(gamma_h), its rotary query rows by gamma_h, the shared rotary key untouched), written here
head by head with Python floats. The maxima the reference clips with are brute-forced in float64
from q and k computed explicitly from the weights (``explicit_qk``), not read from the model.

Each runs on every rank of a gloo pool: 1-D (the owners hold the masters) or dp x tp with torch's
``parallelize_module`` (the two up-projections colwise: each TP rank computes and records its
own heads, and clips its chunk of their rows).
"""

from __future__ import annotations

import functools
import math

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
from tests.distributed.scenarios_qk_clip import VOCAB, relative_errors, rope
from tests.distributed.scenarios_tensor_parallel import full_weights
from tests.reference_optim import ReferenceMuonAdamW

DIM = 24
NUM_HEADS = 4
NOPE = 4  # qk_nope_head_dim
ROPE = 2  # qk_rope_head_dim
V_DIM = 3  # v_head_dim
Q_LORA = 12
KV_LORA = 8
# DeepSeek's softmax scale: qk_head_dim^-0.5 times YaRN's mscale squared (factor 4, mscale 1).
MSCALE = 0.1 * math.log(4.0) + 1.0
SCALING = (NOPE + ROPE) ** -0.5 * MSCALE * MSCALE
STEPS = 4


class LatentAttention(nn.Module):
    """DeepSeek-V3's attention: q through a LoRA (``q_a_proj``, norm, ``q_b_proj``: per head
    NOPE content rows then ROPE rotary rows) or one ``q_proj``; ``kv_a_proj`` gives the latent
    and the rotary key every head shares; ``kv_b_proj`` (per head NOPE key rows then V_DIM value
    rows) expands the latent."""

    def __init__(self, q_lora: bool) -> None:
        super().__init__()
        if q_lora:
            self.q_a_proj = nn.Linear(DIM, Q_LORA, bias=False)
            self.q_a_norm = nn.RMSNorm(Q_LORA)
            self.q_b_proj = nn.Linear(Q_LORA, NUM_HEADS * (NOPE + ROPE), bias=False)
        else:
            self.q_proj = nn.Linear(DIM, NUM_HEADS * (NOPE + ROPE), bias=False)
        self.kv_a_proj = nn.Linear(DIM, KV_LORA + ROPE, bias=False)
        self.kv_a_norm = nn.RMSNorm(KV_LORA)
        self.kv_b_proj = nn.Linear(KV_LORA, NUM_HEADS * (NOPE + V_DIM), bias=False)
        self.o_proj = nn.Linear(NUM_HEADS * V_DIM, DIM, bias=False)
        self.record = None  # called with the (heads,) maxima of each forward
        self.tp_group = None  # under tensor parallelism: this rank's heads see a part of k^R's use

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism this rank's heads.
        q = self.query(x).view(batch, seq, -1, NOPE + ROPE).transpose(1, 2)
        q_nope, q_rope = q.split([NOPE, ROPE], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([KV_LORA, ROPE], dim=-1)
        k_rope = k_rope.view(batch, 1, seq, ROPE)
        if self.tp_group is not None:
            k_rope = SumGradientOverTP.apply(k_rope, self.tp_group)
        q_rope, k_rope = rope(q_rope), rope(k_rope)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(batch, seq, -1, NOPE + V_DIM)
        k_nope, v = kv.transpose(1, 2).split([NOPE, V_DIM], dim=-1)
        if self.record is not None:
            self.record(dmuon.mla_max_logits(q_nope, q_rope, k_nope, k_rope, scaling=SCALING,
                                             is_causal=True))  # fmt: skip
        heads = q.shape[1]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, heads, -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALING)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SumGradientOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group. The shared rotary key
    serves every head, and each TP rank computes only its heads: its gradient is the sum of the
    ranks' parts (Megatron's copy-to-tensor-parallel-region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Block(nn.Module):
    def __init__(self, q_lora: bool) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.attn = LatentAttention(q_lora)
        self.mlp_norm = nn.LayerNorm(DIM)
        self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down_proj(F.gelu(self.up_proj(self.mlp_norm(x))))


class MLADecoder(nn.Module):
    def __init__(self, q_lora: bool, num_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(q_lora) for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def q_name(attn: LatentAttention) -> str:
    return "q_proj" if hasattr(attn, "q_proj") else "q_b_proj"


def make_mla_model(q_lora: bool = True) -> MLADecoder:
    torch.manual_seed(0)
    model = MLADecoder(q_lora)
    with torch.no_grad():  # larger up-projections: logits of a few units, so a tau of 2 clips
        for layer in model.layers:
            getattr(layer.attn, q_name(layer.attn)).weight.mul_(5.0)
            layer.attn.kv_b_proj.weight.mul_(5.0)
            layer.attn.kv_a_proj.weight[KV_LORA:].mul_(5.0)  # the shared rotary key
    return model


def mla_heads(model: MLADecoder) -> list[dmuon.MLAHeads]:
    return [
        dmuon.MLAHeads(
            name=f"layers.{i}.attn",
            q_weight=f"layers.{i}.attn.{q_name(layer.attn)}.weight",
            kv_weight=f"layers.{i}.attn.kv_b_proj.weight",
            num_heads=NUM_HEADS,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=V_DIM,
        )
        for i, layer in enumerate(model.layers)
    ]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---- the reference, from the report ------------------------------------------------------------


@torch.no_grad()
def explicit_qk(attn: LatentAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q^C, q^R, k^C, k^R) in float64 from the attention's input and weights, head by head
    through the row blocks: q^C_h = rows [h (n + r), h (n + r) + n) of the query projection,
    q^R_h the next r rows, k^C_h rows [h (n + v), h (n + v) + n) of kv_b_proj, k^R the last r
    rows of kv_a_proj (shared); q^R and k^R after RoPE. Shapes (batch, heads or 1, seq, dim)."""
    x = x.double()
    if hasattr(attn, "q_proj"):
        q_in, q_weight = x, attn.q_proj.weight.double()
    else:
        q_in = rms_norm_float64(attn.q_a_norm, x @ attn.q_a_proj.weight.double().T)
        q_weight = attn.q_b_proj.weight.double()
    kv_a = attn.kv_a_proj.weight.double()
    latent = rms_norm_float64(attn.kv_a_norm, x @ kv_a[:KV_LORA].T)
    kv_b = attn.kv_b_proj.weight.double()
    q_nope, q_rope, k_nope = [], [], []
    for h in range(NUM_HEADS):
        q_rows, kv_rows = h * (NOPE + ROPE), h * (NOPE + V_DIM)
        q_nope.append(q_in @ q_weight[q_rows : q_rows + NOPE].T)
        q_rope.append(q_in @ q_weight[q_rows + NOPE : q_rows + NOPE + ROPE].T)
        k_nope.append(latent @ kv_b[kv_rows : kv_rows + NOPE].T)
    k_rope = (x @ kv_a[KV_LORA:].T)[:, None]  # (batch, 1, seq, ROPE): one for every head
    return (
        torch.stack(q_nope, 1),
        rope(torch.stack(q_rope, 1)),
        torch.stack(k_nope, 1),
        rope(k_rope),
    )


def rms_norm_float64(norm: nn.RMSNorm, y: torch.Tensor) -> torch.Tensor:
    """``norm`` (a float32 RMSNorm, eps None: float32's) applied in float64."""
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * norm.weight.double()


def brute_force_mla_max_logits(q_nope, q_rope, k_nope, k_rope, scaling) -> list[float]:
    """max over (b, i, j <= i) of scaling * (q^C_h[b, i] . k^C_h[b, j] + q^R_h[b, i] . k^R[b, j])
    per head, in Python floats (causal attention)."""
    batch, heads, seq, _ = q_nope.shape
    result = [-math.inf] * heads
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                for j in range(i + 1):
                    content = float(q_nope[b, h, i] @ k_nope[b, h, j])
                    rotary = float(q_rope[b, h, i] @ k_rope[b, 0, j])
                    result[h] = max(result[h], scaling * (content + rotary))
    return result


def capture_attention_inputs(model: MLADecoder) -> dict[int, list[torch.Tensor]]:
    """Layer -> the inputs of its attention in each forward (forward pre-hooks)."""
    inputs: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.layers):
        layer.attn.register_forward_pre_hook(
            lambda module, args, i=i: inputs.setdefault(i, []).append(args[0].detach())
        )
    return inputs


def explicit_max_logits(model: MLADecoder, inputs: dict[int, list[torch.Tensor]]) -> dict:
    """Layer -> the brute-forced maxima of every recorded input, with the current weights."""
    maxima = {}
    for i, layer in enumerate(model.layers):
        per_input = [
            brute_force_mla_max_logits(*explicit_qk(layer.attn, x), SCALING) for x in inputs[i]
        ]
        maxima[i] = [max(values) for values in zip(*per_input)]
    return maxima


@torch.no_grad()
def reference_mla_clip(model: MLADecoder, maxima: dict[int, list[float]], tau, alpha) -> int:
    """Kimi K2's QK-clip for MLA on the full model, one head at a time; the heads clipped."""
    clipped = 0
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        q_weight = getattr(attn, q_name(attn)).weight
        for h, s_max in enumerate(maxima[i]):
            if s_max <= tau:
                continue
            clipped += 1
            gamma = tau / s_max
            q_rows, kv_rows = h * (NOPE + ROPE), h * (NOPE + V_DIM)
            q_weight[q_rows : q_rows + NOPE] *= gamma**alpha  # q^C: sqrt(gamma) at alpha 0.5
            q_weight[q_rows + NOPE : q_rows + NOPE + ROPE] *= gamma  # q^R: gamma
            attn.kv_b_proj.weight[kv_rows : kv_rows + NOPE] *= gamma ** (1 - alpha)  # k^C
            # the value rows and the shared rotary key (kv_a_proj) stay
    return clipped


# ---- the scenarios ---------------------------------------------------------------------------


def predicate_of(kv_on_adamw: bool):
    """The projections, kv_b_proj left to FSDP2 (the AdamW route) if ``kv_on_adamw``."""

    def predicate(name: str, param: nn.Parameter) -> bool:
        if kv_on_adamw and "kv_b_proj" in name:
            return False
        return "proj" in name and param.ndim == 2

    return predicate


def build_distributed(mesh_kind: str, q_lora: bool, kv_on_adamw: bool = False):
    """The model on a 1-D or dp x tp mesh over every rank; (model, data rank, data ranks)."""
    world = dist.get_world_size()
    model = make_mla_model(q_lora)
    predicate = predicate_of(kv_on_adamw)
    if mesh_kind == "1d":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        shard, fsdp, dp_rank, dp = mesh, mesh, mesh.get_local_rank(), world
    else:  # "tp": dp x 2, the up-projections colwise (by whole heads), o_proj rowwise
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = {
            f"layers.*.attn.{q_name(model.layers[0].attn)}": ColwiseParallel(),
            "layers.*.attn.kv_b_proj": ColwiseParallel(),
            "layers.*.attn.o_proj": RowwiseParallel(),
        }
        parallelize_module(model, mesh["tp"], plan)
        for layer in model.layers:
            layer.attn.tp_group = mesh["tp"].get_group()
        shard, fsdp = mesh["dp"], mesh["dp"]
        dp_rank, dp = mesh["dp"].get_local_rank(), world // 2
    dedicate_and_shard_on(model, shard, fsdp_mesh=fsdp, predicate=predicate)
    return model, dp_rank, dp


def train_mla_with_qk_clip(
    *,
    mesh_kind: str,
    threshold: float,
    alpha: float = 0.5,
    q_lora: bool = True,
    kv_on_adamw: bool = False,
) -> dict:
    """``STEPS`` steps of dmuon.Muon + QKClip on MLA beside the reference; the worst relative
    weight error after each step, the heads clipped per step on both sides, and the largest
    difference between the reduced maxima and the reference's brute force."""
    model, dp_rank, dp = build_distributed(mesh_kind, q_lora, kv_on_adamw)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )
    clip = dmuon.QKClip(model, optimizer, mla_heads(model), threshold=threshold, alpha=alpha)
    for i, layer in enumerate(model.layers):
        layer.attn.record = functools.partial(clip.record, f"layers.{i}.attn")
    reference = make_mla_model(q_lora)
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        predicate_of(kv_on_adamw),
        lr=0.02,
        weight_decay=0.01,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    inputs = capture_attention_inputs(reference)
    max_errors, clipped, reference_clipped, max_logit_errors = [], [], [], []
    for batch in batches(STEPS, dp, seq=7):
        loss_of(model, rank_rows(batch, dp_rank, dp)).backward()
        optimizer.step()
        optimizer.zero_grad()
        inputs.clear()
        loss_of(reference, batch).backward()
        maxima = explicit_max_logits(reference, inputs)  # the weights the forward used
        reference_optimizer.step()
        reference_clipped.append(reference_mla_clip(reference, maxima, threshold, alpha))
        reference_optimizer.zero_grad()
        clipped.append(clip.clipped_heads)
        max_logit_errors.append(
            max(
                (clip.last_max_logits[f"layers.{i}.attn"].double() - torch.tensor(maxima[i]))
                .abs()
                .max()
                .item()
                for i in maxima
            )
        )
        errors = relative_errors(full_weights(model), reference)
        max_errors.append(max(errors.values()))
    state = get_dedicated_state(model)
    return {
        "dedicated": sorted(state.params),
        "max_errors": max_errors,
        "clipped": clipped,
        "reference_clipped": reference_clipped,
        "max_logit_errors": max_logit_errors,
        "rank": dist.get_rank(),
    }
