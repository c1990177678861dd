"""What dmuon's own tests and benchmarks share: the reference optimizer they check dmuon.Muon
against, and the tiny decoder they train. Not a training utility: slow on purpose, small on
purpose.

``import dmuon.testing`` is never done by dmuon itself (``dmuon/__init__`` does not import it, no
module of dmuon uses it; ``tests/test_dependency_direction.py`` checks both), so the oracle stays
independent of what it checks, and the benchmarks reach it without importing the test suite.

The reference optimizer, ``ReferenceMuonAdamW``: a plain, single-process Muon + AdamW over the
full (unsharded) model.

Owns the optimizer math of SPEC.md written as directly as possible, so a reader can check it line
by line: Muon for the parameters ``is_muon`` selects, decoupled AdamW for the rest. dmuon.Muon,
whatever it shards, broadcasts or overlaps, must produce the same parameters as this class run on
the full model with the full-batch gradients.

It must not be fast, clever or shared with dmuon: no torch.optim inside, no fused or foreach
kernels, no dmuon code (the class uses torch alone). Orthogonalization is passed in, so the same
oracle serves an fp32 Newton-Schulz (exact comparisons) and the bf16 one of ``torch.optim.Muon``.

Muon, for a parameter W of shape (m, n, ...) flattened to the matrix (m, n * ...), with gradient g
(a parameter named in ``expert_stacks``, of shape (E, m, n), is E matrices W[e], each updated
below on its own, with its own momentum):

1. momentum: first step ``buf = g``, then ``buf = momentum * buf + g``;
2. Nesterov: ``u = g + momentum * buf``, else ``u = buf``;
3. ``O = orthogonalize(u)``;
4. ``W = W * (1 - lr * weight_decay)``;
5. ``W = W - lr * 0.2 * sqrt(max(m, n)) * O``.

Options (``docs/update-rules.md``), each off by default:

- ``momentum_dtype=torch.bfloat16``: step 1 in fp32 on the stored buffer, the new buffer stored
  rounded to bf16; step 2 uses the unrounded fp32 ``buf``. ``torch.int8``: the same, the buffer
  stored as ``q · s / 127`` per run of 256 elements of a row, ``s`` the run's max |buf| and
  ``q = round(buf / (s / 127))`` (0 where s = 0).
- ``normuon_beta2=β2`` (NorMuon, Li et al. 2025, arXiv 2510.05491), between steps 3 and 4, with
  ``v`` (m,) zero at the start: ``v = β2 * v + (1 - β2) * mean over columns of O * O``,
  ``O = O / (sqrt(v) + normuon_eps)`` row by row, ``O = O * sqrt(min(m, n)) / ‖O‖_F``.
- ``row_blocks={name: (b_1, ..., b_k)}``: the matrix's rows ``[r_i, r_i + b_i)`` are each
  updated by steps 1 to 5 as a matrix of their own (b_i, n): own state, own ``O``, own scale.

AdamW, with step count t (per parameter, counting only steps where it had a gradient):
``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g^2``, ``m_hat = m / (1-b1^t)``,
``v_hat = v / (1-b2^t)``, ``W = W * (1 - adamw_lr * adamw_weight_decay)``,
``W = W - adamw_lr * m_hat / (sqrt(v_hat) + eps)``.

A parameter whose ``grad`` is None is skipped: its weight and state stay as they are.

``no_decay(name)`` selects the parameters that get no weight decay; the default is HF Trainer's
rule (``dmuon.Muon``'s default) read from the name alone: ``bias``, ``layernorm`` or ``rmsnorm``
in it, or a ``norm`` / ``*_norm`` component. ``decay_everything=True`` turns it off.
``per_param`` overrides the learning rate and weight decay of single parameters by name (what
``dmuon.Muon``'s ``param_groups=`` and ``no_decay=`` decide): ``{"norm.weight": {"weight_decay":
0.0}}`` replaces ``adamw_weight_decay`` (or ``weight_decay`` for a Muon parameter) for it alone;
``"normuon_beta2"`` (None: off) and ``"momentum_dtype"`` likewise for a Muon parameter.

The tiny decoder, ``TinyDecoder``: decoder-shaped, with the awkward cases built in. Shapes are
deliberately uneven (rows not divisible by the world size, a 1 x n matrix) so FSDP2 sharding and
dmuon packing meet their edge cases on every run. ``batches``/``rank_rows`` give every step's
full batch and a rank's rows of it; ``dedicate_and_shard`` is what a user writes to put it on a
mesh (the one function here that calls dmuon, through its public ``dedicate_params``).

The Llama-style decoder, ``Llama``: the one model definition the benchmarks train (``bench_e2e``
and the scripts built on it, ``bench_convergence``, ``bench_moonlight``'s rotary and SwiGLU):
token embedding, ``LlamaConfig.layers`` pre-norm layers of grouped-query attention with rotary
embedding and causal ``F.scaled_dot_product_attention``, RMSNorm, SwiGLU gate/up/down, an untied
``lm_head``, every ``nn.Linear``/``nn.Embedding`` weight drawn from N(0, 0.02). Its shapes are
whatever the benchmark passes; the defaults are bench_e2e's (about 1.0 B parameters).
``next_token_loss`` is its loss with the logits upcast to fp32 (the benchmarks compute in bf16).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import dmuon

__all__ = [
    "DIM",
    "FFN",
    "MUON_RMS_MATCHING_FACTOR",
    "VOCAB",
    "Block",
    "Llama",
    "LlamaConfig",
    "ReferenceMuonAdamW",
    "SwiGLU",
    "TinyDecoder",
    "apply_rotary",
    "batches",
    "dedicate_and_shard",
    "hf_no_decay",
    "loss_fn",
    "next_token_loss",
    "proj_predicate",
    "rank_rows",
]

# ---- the reference optimizer ---------------------------------------------------------------------

# Scale that gives Muon's update the RMS of a typical AdamW update (Moonshot's "match RMS").
MUON_RMS_MATCHING_FACTOR = 0.2


def hf_no_decay(name: str) -> bool:
    """HF Trainer's no-weight-decay rule, by name: biases and norm weights."""
    lowered = name.lower()
    components = lowered.split(".")
    return (
        "bias" in lowered
        or "layernorm" in lowered
        or "rmsnorm" in lowered
        or any(part == "norm" or part.endswith("_norm") for part in components)
    )


class ReferenceMuonAdamW:
    """Muon on the parameters ``is_muon(name, param)`` selects, AdamW on the others."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, Tensor]],
        is_muon: Callable[[str, Tensor], bool],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        orthogonalize: Callable[[Tensor], Tensor],
        per_param: Mapping[str, Mapping[str, float]] | None = None,
        no_decay: Callable[[str], bool] | None = None,
        decay_everything: bool = False,
        expert_stacks: Collection[str] = (),
        momentum_dtype: torch.dtype | None = None,
        normuon_beta2: float | None = None,
        normuon_eps: float = 1e-8,
        row_blocks: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self.lr = lr
        self.momentum_dtype = momentum_dtype
        self.normuon_beta2 = normuon_beta2
        self.normuon_eps = normuon_eps
        self.row_blocks = {name: tuple(sizes) for name, sizes in (row_blocks or {}).items()}
        self.momentum = momentum
        self.nesterov = nesterov
        self.weight_decay = weight_decay
        self.adamw_lr = adamw_lr
        self.adamw_betas = adamw_betas
        self.adamw_eps = adamw_eps
        self.adamw_weight_decay = adamw_weight_decay
        self.orthogonalize = orthogonalize
        self.expert_stacks = frozenset(expert_stacks)
        self.per_param = {name: dict(entry) for name, entry in (per_param or {}).items()}
        self.params: dict[str, Tensor] = dict(named_params)
        if not decay_everything:
            for name in self.params:
                if (no_decay or hf_no_decay)(name):
                    self.per_param.setdefault(name, {}).setdefault("weight_decay", 0.0)
        self.muon_names: list[str] = []
        self.adamw_names: list[str] = []
        for name, param in self.params.items():
            if is_muon(name, param):
                if param.ndim < 2:
                    raise ValueError(
                        f"is_muon selected {name!r} of shape {tuple(param.shape)}, but Muon needs "
                        "a parameter with at least 2 dimensions; make is_muon return False for it "
                        "so it goes to AdamW"
                    )
                self.muon_names.append(name)
            else:
                self.adamw_names.append(name)
        # name -> {"momentum_buffer"} for Muon, {"step", "exp_avg", "exp_avg_sq"} for AdamW.
        self.state: dict[str, dict[str, Tensor | int]] = {}

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for name in self.muon_names:
            param = self.params[name]
            if param.grad is not None:
                self._muon_update(name, param, param.grad)
        for name in self.adamw_names:
            param = self.params[name]
            if param.grad is not None:
                self._adamw_update(name, param, param.grad)

    def _muon_update(self, name: str, param: Tensor, grad: Tensor) -> None:
        if name in self.expert_stacks:
            # An (E, m, n) expert stack is E matrices: each expert slice has its own momentum
            # (state "<name>[e]"), orthogonalization and (m, n) scale, as if it were a parameter.
            for expert in range(param.shape[0]):
                self._muon_matrix_update(f"{name}[{expert}]", name, param[expert], grad[expert])
            return
        if name in self.row_blocks:
            # Each row block is a matrix of its own (state "<name>[rows a:b]").
            start = 0
            for rows in self.row_blocks[name]:
                stop = start + rows
                key = f"{name}[rows {start}:{stop}]"
                self._muon_matrix_update(key, name, param[start:stop], grad[start:stop])
                start = stop
            return
        self._muon_matrix_update(name, name, param, grad)

    def _muon_matrix_update(self, key: str, name: str, param: Tensor, grad: Tensor) -> None:
        """Muon on one matrix ``param`` (updated in place), its state under ``key``, its
        hyperparameters under ``name``."""
        rows = param.shape[0]
        grad = grad.reshape(rows, -1)  # (m, n): trailing dims flattened into n
        columns = grad.shape[1]
        state = self.state.setdefault(key, {})
        momentum_dtype = self.per_param.get(name, {}).get("momentum_dtype", self.momentum_dtype)
        if "momentum_buffer" not in state:
            buf = grad.clone()
        else:
            buf = self.momentum * state["momentum_buffer"].to(grad.dtype) + grad
        # Stored rounded to momentum_dtype (None: the gradient's); the update uses buf unrounded.
        if momentum_dtype == torch.int8:
            state["momentum_buffer"] = _int8_rounded(buf)
        else:
            state["momentum_buffer"] = buf.to(momentum_dtype or buf.dtype)
        update = grad + self.momentum * buf if self.nesterov else buf
        # (m, n), in the parameter's dtype: torch.optim.Muon's orthogonalizer returns bf16, and
        # scaling a bf16 tensor would round the update to bf16.
        orthogonal = self.orthogonalize(update).to(param.dtype)
        beta2 = self.per_param.get(name, {}).get("normuon_beta2", self.normuon_beta2)
        if beta2 is not None:
            v = state.get("row_second_moment", torch.zeros(rows, dtype=orthogonal.dtype))
            v = beta2 * v + (1 - beta2) * (orthogonal * orthogonal).mean(dim=1)
            state["row_second_moment"] = v
            orthogonal = orthogonal / (v.sqrt()[:, None] + self.normuon_eps)
            orthogonal = orthogonal * math.sqrt(min(rows, columns)) / orthogonal.norm()
        scale = MUON_RMS_MATCHING_FACTOR * math.sqrt(max(rows, columns))
        lr = self.per_param.get(name, {}).get("lr", self.lr)
        weight_decay = self.per_param.get(name, {}).get("weight_decay", self.weight_decay)
        new_weight = param * (1 - lr * weight_decay)
        new_weight = new_weight - lr * scale * orthogonal.reshape(param.shape)
        param.copy_(new_weight)

    def _adamw_update(self, name: str, param: Tensor, grad: Tensor) -> None:
        beta1, beta2 = self.adamw_betas
        state = self.state.setdefault(name, {})
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step = state["step"]
        state["exp_avg"] = beta1 * state["exp_avg"] + (1 - beta1) * grad
        state["exp_avg_sq"] = beta2 * state["exp_avg_sq"] + (1 - beta2) * grad * grad
        exp_avg_corrected = state["exp_avg"] / (1 - beta1**step)
        exp_avg_sq_corrected = state["exp_avg_sq"] / (1 - beta2**step)
        lr = self.per_param.get(name, {}).get("lr", self.adamw_lr)
        weight_decay = self.per_param.get(name, {}).get("weight_decay", self.adamw_weight_decay)
        new_weight = param * (1 - lr * weight_decay)
        new_weight = new_weight - lr * exp_avg_corrected / (
            exp_avg_sq_corrected.sqrt() + self.adamw_eps
        )
        param.copy_(new_weight)


def _int8_rounded(buf: Tensor, run: int = 256) -> Tensor:
    """``buf`` (m, n) as an int8 momentum with one scale per ``run`` elements of a row holds it."""
    rows, columns = buf.shape
    runs = -(-columns // run)
    padded = torch.zeros(rows, runs * run, dtype=buf.dtype)
    padded[:, :columns] = buf
    padded = padded.view(rows, runs, run)
    step = padded.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(step > 0, padded / step, torch.zeros_like(padded)).round()
    return (q * step).view(rows, runs * run)[:, :columns]


# ---- the tiny decoder and its data ---------------------------------------------------------------

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


def dedicate_and_shard(
    model: nn.Module,
    device_type: str,
    replicas: int,
    reshard_after_forward: bool,
    predicate: Callable[[str, nn.Parameter], bool] = proj_predicate,
) -> dict:
    """What a user writes: a 1-D or ("replicate", "shard") mesh over the default group,
    ``dedicate_params`` on the projections, then ``fully_shard`` per layer and on the root.
    Returns the owner map."""
    world = dist.get_world_size()
    if replicas > 1:
        mesh = init_device_mesh(
            device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
        )
        shard_mesh, replicate_mesh, fsdp_mesh = mesh["shard"], mesh["replicate"], mesh
    else:
        shard_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        replicate_mesh, fsdp_mesh = None, shard_mesh
    return dedicate_and_shard_on(
        model,
        shard_mesh,
        replicate_mesh=replicate_mesh,
        fsdp_mesh=fsdp_mesh,
        reshard_after_forward=reshard_after_forward,
        predicate=predicate,
    )


def dedicate_and_shard_on(
    model: nn.Module,
    shard_mesh,
    *,
    replicate_mesh=None,
    fsdp_mesh=None,
    reshard_after_forward: bool = True,
    predicate: Callable[[str, nn.Parameter], bool] = proj_predicate,
) -> dict:
    """``dedicate_params`` over the given meshes, then ``fully_shard`` per layer and on the root
    over ``fsdp_mesh`` (default: ``shard_mesh``). Returns the owner map."""
    owners = dmuon.dedicate_params(
        model,
        shard_mesh,
        predicate,
        replicate_mesh=replicate_mesh,
        reshard_after_forward=reshard_after_forward,
    )
    fsdp_mesh = shard_mesh if fsdp_mesh is None else fsdp_mesh
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
    return owners


# ---- the Llama-style decoder the benchmarks train ------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab: int = 32000
    dim: int = 2048
    layers: int = 16
    heads: int = 16
    kv_heads: int = 8
    ffn: int = 5632
    rope_theta: float = 10000.0


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on (batch, heads, seq, head_dim), the two halves as (real, imaginary)."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class _LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = config.heads, config.kv_heads
        self.head_dim = config.dim // config.heads
        self.q_proj = nn.Linear(config.dim, config.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _LlamaLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=1e-5)
        self.attn = _LlamaAttention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=1e-5)
        self.mlp = SwiGLU(config.dim, config.ffn)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """``seq``: the longest sequence the rotary tables cover; ``checkpoint_layers``: each layer
    recomputed in backward (activation checkpointing)."""

    def __init__(self, config: LlamaConfig, seq: int, checkpoint_layers: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(_LlamaLayer(config) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.dim, eps=1e-5)
        self.lm_head = nn.Linear(config.dim, config.vocab, bias=False)
        self.checkpoint_layers = checkpoint_layers
        head_dim = config.dim // config.heads
        inverse_freq = config.rope_theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), inverse_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed_tokens(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for layer in self.layers:
            if self.checkpoint_layers:
                # The whole layer call re-runs in backward, its module hooks included.
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def next_token_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Cross-entropy of ``model``'s logits at each position against the next token, the logits
    upcast to fp32 first."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
