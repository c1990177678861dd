"""A Moonlight-shaped MoE model on one GPU: dmuon + MuonClip against FSDP2 + fused AdamW.

The model is Moonlight-16B-A3B's shape (its public config) cut to a few layers: hidden 2048;
multi-head latent attention with a plain ``q_proj`` (q_lora_rank None), ``kv_a_proj`` to the
512-wide latent plus the 64-wide rotary key every head shares, ``kv_b_proj`` up to 16 heads of
128 key-content + 128 value dims, rotary 64 per head; the first layer dense (SwiGLU 11264), the
others mixture-of-experts: a sigmoid token-choice top-6 router over 64 routed experts of 1408
(``gate``; top-k weights normalised and scaled by 2.446, as Moonlight's), the experts as (E, m, n)
stacks ``w1`` / ``w3`` (1408, 2048) and ``w2`` (2048, 1408) computed expert by expert over the
tokens sorted by expert, and 2 shared experts as one SwiGLU of 2816. The default, 4 layers
(1 dense + 3 MoE) and the full 163840 vocabulary, has 2.51 B parameters (1.00 B active per
token, embedding included); micro-batch 2 x sequence 2048 in bf16 compute, fp32 parameters,
world size 1.

Two arms, each in its own process (``--arm``; the driver, run without it, starts them one after
the other, through ``torch.distributed.run`` for ``--nproc`` above 1, and merges their records),
on the same seeded model and the same tokens:

- ``fsdp2-adamw``: ``fully_shard`` per layer and root with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``torch.optim.AdamW(fused=True)``;
- ``dmuon-muonclip``: ``dmuon.dedicate_params`` on every matrix and expert stack of the layers
  (attention projections, dense MLP, router gate, expert stacks, shared experts; the embedding,
  lm_head and norms stay with FSDP2) with ``param_policy`` bf16 compute / fp32 reduce, the same
  ``fully_shard``, ``dmuon.Muon(model)`` with its defaults, and ``dmuon.QKClip`` over
  ``dmuon.MLAHeads`` at tau 100: each attention records ``dmuon.mla_max_logits`` in every
  training forward (its cost is in the step time), and the clip runs inside ``step()``
  (``--tau`` sets another threshold: the quick run's logits stay far under 100).

Per arm: the build (model, dedicate, shard, optimizer; seconds), the first step (cold: the first
zero_grad + forward + backward + step with whatever dmuon compiles or autotunes, seconds), the
median over ``--steps`` steps after ``--warmup`` of the whole step (zero_grad + forward + backward
+ step, host clock between synchronisations), the optimizer step alone (host clock between a
synchronisation before ``step()`` and one after it, clip included) and its device time (CUDA
events around ``step()``), the peak memory (``max_memory_allocated``, a fresh process per arm),
the optimizer state's bytes and the losses (must be finite). On CPU, host times only.

Usage (repository root; on the GPU machine put the package sources on PYTHONPATH)::

    python benchmarks/e2e/bench_moonlight.py --out $OUT/moonlight.json
    python benchmarks/e2e/bench_moonlight.py --device cpu --quick       # gloo, tiny, < 1 minute
    python benchmarks/e2e/bench_moonlight.py --layers 3 --vocab 32768   # a smaller cut
    python benchmarks/e2e/bench_moonlight.py --device cpu --quick --nproc 2 --tau 0.08  # clips

The driver prints a table last and writes JSON (``--out``; default
``benchmarks/results/moonlight-<gpu>-<date>.json``, none with ``--quick`` unless given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

_common.add_package_sources_if_missing()  # before dmuon is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import dmuon  # noqa: E402
from benchmarks.e2e.bench_e2e import optimizer_state_bytes  # noqa: E402
from dmuon.testing import SwiGLU, apply_rotary, next_token_loss  # noqa: E402

ARMS = ("fsdp2-adamw", "dmuon-muonclip")
ADAMW_LR = 1e-3  # the AdamW arm's; dmuon.Muon's own defaults are lr 0.02, adamw_lr 1e-3
QK_CLIP_THRESHOLD = 100.0  # tau, Kimi K2's
ROUTED_SCALING = 2.446  # Moonlight's routed_scaling_factor
INIT_STD = 0.02


# ---- the model --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MoonlightConfig:
    """Moonlight-16B-A3B's shape; ``layers`` and ``vocab`` cut to one GPU."""

    vocab: int = 163840
    dim: int = 2048
    layers: int = 4
    dense_layers: int = 1  # the first layers are dense (first_k_dense_replace)
    dense_ffn: int = 11264
    heads: int = 16
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    experts: int = 64
    top_k: int = 6
    moe_ffn: int = 1408
    shared_experts: int = 2
    rope_theta: float = 50000.0

    @property
    def scaling(self) -> float:
        """The softmax scale: qk_head_dim^-0.5 (Moonlight has no YaRN scaling)."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


QUICK_CONFIG = MoonlightConfig(
    vocab=512, dim=64, layers=2, dense_ffn=128, heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, experts=8, top_k=2, moe_ffn=32, shared_experts=1,
)  # fmt: skip


class LatentAttention(nn.Module):
    """Multi-head latent attention without a query LoRA: ``q_proj`` gives each head its content
    rows then its rotary rows; ``kv_a_proj`` the latent and the rotary key all heads share;
    ``kv_b_proj`` each head's key-content rows then its value rows."""

    def __init__(self, config: MoonlightConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(c.dim, c.heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), False)
        self.kv_a_proj = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(c.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(c.heads * c.v_head_dim, c.dim, bias=False)
        self.record = None  # QK-clip's recorder: called with the (heads,) maxima of each forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, (batch, seq, _) = self.config, x.shape
        nope, rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        q = self.q_proj(x).view(batch, seq, c.heads, nope + rope).transpose(1, 2)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([c.kv_lora_rank, rope], dim=-1)
        k_rope = k_rope.view(batch, 1, seq, rope)
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(batch, seq, c.heads, nope + c.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([nope, c.v_head_dim], dim=-1)
        if self.record is not None:
            self.record(dmuon.mla_max_logits(q_nope, q_rope, k_nope, k_rope, scaling=c.scaling,
                                             is_causal=True))  # fmt: skip
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, c.heads, -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MoE(nn.Module):
    """Token-choice top-k over ``experts`` SwiGLU experts held as (E, m, n) stacks (``w1``,
    ``w3``: (E, moe_ffn, dim); ``w2``: (E, dim, moe_ffn)), plus the shared experts.

    The routed tokens are sorted by expert, each expert multiplies its contiguous rows, and the
    outputs are summed back per token with their router weights. The stacks are unbound once per
    forward (one ``unbind`` backward stacks the E gradients, where indexing each expert would
    add E full-stack gradients)."""

    def __init__(self, config: MoonlightConfig) -> None:
        super().__init__()
        c = config
        self.top_k = c.top_k
        self.gate = nn.Linear(c.dim, c.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(c.experts, c.moe_ffn, c.dim))
        self.w3 = nn.Parameter(torch.empty(c.experts, c.moe_ffn, c.dim))
        self.w2 = nn.Parameter(torch.empty(c.experts, c.dim, c.moe_ffn))
        self.shared = SwiGLU(c.dim, c.shared_experts * c.moe_ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, dim)
        scores = torch.sigmoid(self.gate(x).float())  # (tokens, E)
        weights, chosen = scores.topk(self.top_k, dim=-1)  # (tokens, k)
        weights = weights / weights.sum(dim=-1, keepdim=True) * ROUTED_SCALING
        flat_expert = chosen.flatten()  # (tokens * k,)
        order = flat_expert.argsort(stable=True)
        token_of = order // self.top_k  # the token of each sorted (token, choice)
        counts = torch.bincount(flat_expert, minlength=self.w1.shape[0]).tolist()  # host sync
        routed = x.index_select(0, token_of)  # (tokens * k, dim), sorted by expert
        w1, w2, w3 = self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0)
        outputs = []
        for expert, rows in enumerate(routed.split(counts)):
            hidden = F.silu(rows @ w1[expert].T) * (rows @ w3[expert].T)
            outputs.append(hidden @ w2[expert].T)
        routed_out = torch.cat(outputs) * weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of, routed_out)
        return (out + self.shared(x)).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: MoonlightConfig, dense: bool) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=1e-6)
        self.attn = LatentAttention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=1e-6)
        self.mlp = SwiGLU(config.dim, config.dense_ffn) if dense else MoE(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Moonlight(nn.Module):
    def __init__(self, config: MoonlightConfig, seq: int, checkpoint_layers: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dense=i < config.dense_layers) for i in range(config.layers)
        )
        self.norm = nn.RMSNorm(config.dim, eps=1e-6)
        self.lm_head = nn.Linear(config.dim, config.vocab, bias=False)
        self.checkpoint_layers = checkpoint_layers
        rope = config.qk_rope_head_dim
        inverse_freq = config.rope_theta ** (-torch.arange(0, rope, 2).float() / rope)
        angles = torch.outer(torch.arange(seq).float(), inverse_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for param in self.parameters():
            if param.ndim >= 2:
                nn.init.normal_(param, std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for layer in self.layers:
            if self.checkpoint_layers:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def is_dedicated(name: str, param: nn.Parameter) -> bool:
    """Every matrix and expert stack of the layers: attention projections, dense MLP, router
    gate, expert stacks, shared experts. Not the embedding, lm_head or norms."""
    return name.startswith("layers.") and param.ndim >= 2


def mla_heads(model: Moonlight, config: MoonlightConfig) -> list[dmuon.MLAHeads]:
    return [
        dmuon.MLAHeads(
            name=f"layers.{i}.attn",
            q_weight=f"layers.{i}.attn.q_proj.weight",
            kv_weight=f"layers.{i}.attn.kv_b_proj.weight",
            num_heads=config.heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
        )
        for i in range(len(model.layers))
    ]


def parameter_counts(config: MoonlightConfig) -> dict[str, int]:
    """Total, routed-expert and active-per-token parameter counts (from a meta model)."""
    with torch.device("meta"):
        model = Moonlight(config, 1, False)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(
        p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in ("w1", "w2", "w3")
    )
    active = total - routed + routed * config.top_k // config.experts
    return {"total": total, "routed_experts": routed, "active_per_token": active}


# ---- one arm ----------------------------------------------------------------------------------


def build(arm: str, args: argparse.Namespace, mesh, device: torch.device):
    """(model, optimizer, QK-clip or None, extra JSON fields) of one arm, from the seeded model."""
    torch.manual_seed(0)
    with device:
        model = Moonlight(args.model, args.seq, args.checkpoint)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    extra: dict = {}
    clip = None
    if arm == "dmuon-muonclip":
        dmuon.dedicate_params(
            model,
            mesh,
            predicate=is_dedicated,
            param_policy={
                "defaults": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
            },
        )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if arm == "fsdp2-adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, fused=True)
    else:
        optimizer = dmuon.Muon(model)
        clip = dmuon.QKClip(model, optimizer, mla_heads(model, args.model), threshold=args.tau)
        for i, layer in enumerate(model.layers):
            layer.attn.record = lambda maxima, name=f"layers.{i}.attn": clip.record(name, maxima)
        routes = [row.route for row in optimizer.routing()]
        extra["routing"] = {route: routes.count(route) for route in sorted(set(routes))}
        extra["partition"] = dmuon.inspect.view(model).plan.describe()
        newton_schulz = optimizer.newton_schulz
        extra["newton_schulz"] = repr(newton_schulz)
        extra["ns_kernel"] = f"{newton_schulz.kernel} ({newton_schulz.kernel_reason})"
    return model, optimizer, clip, extra


def measure(arm: str, args: argparse.Namespace, mesh, device: torch.device, tokens) -> dict:
    """This arm's build and first-step seconds, per-step times, losses and memory."""
    cuda = device.type == "cuda"
    started = time.perf_counter()
    model, optimizer, clip, extra = build(arm, args, mesh, device)
    _common.synchronize(device)
    build_s = time.perf_counter() - started
    allocated_after_build = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
    step_ms, optimizer_ms, optimizer_device_ms, losses = [], [], [], []
    clipped_heads, max_logits = [], []
    first_step_s = None
    for index in range(args.warmup + args.steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _common.synchronize(device)
        step_start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(model, tokens)
        loss.backward()
        _common.synchronize(device)
        optimizer_start = time.perf_counter()
        if cuda:
            begin.record()
        optimizer.step()
        if cuda:
            end.record()
        _common.synchronize(device)
        step_end = time.perf_counter()
        losses.append(loss.item())
        if clip is not None:
            clipped_heads.append(clip.clipped_heads)
            max_logits.append(max(float(m.max()) for m in clip.last_max_logits.values()))
        if index == 0:
            first_step_s = step_end - step_start
        if index >= args.warmup:
            step_ms.append((step_end - step_start) * 1e3)
            optimizer_ms.append((step_end - optimizer_start) * 1e3)
            if cuda:
                optimizer_device_ms.append(begin.elapsed_time(end))
    if arm == "dmuon-muonclip":
        dmuon.wait_all_replicate_broadcasts(model)
        extra["clipped_heads_per_step"] = clipped_heads
        extra["qk_clip_threshold"] = clip.threshold
        extra["max_logit_per_step"] = max_logits
    return {
        "build_s": build_s,
        "first_step_s": first_step_s,
        "step_ms_median": statistics.median(step_ms),
        "optimizer_ms_median": statistics.median(optimizer_ms),
        "optimizer_device_ms_median": (
            statistics.median(optimizer_device_ms) if optimizer_device_ms else None
        ),
        "step_ms": step_ms,
        "optimizer_ms": optimizer_ms,
        "optimizer_device_ms": optimizer_device_ms,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "allocated_after_build_gib": allocated_after_build,
        "optimizer_state_gib": optimizer_state_bytes(optimizer) / 2**30,
        "losses": losses,
        "losses_finite": all(math.isfinite(x) for x in losses),
        **extra,
    }


def training_tokens(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """The (micro-batch, seq + 1) token ids, the same in every arm."""
    generator = torch.Generator().manual_seed(1000)
    return torch.randint(
        0, args.model.vocab, (args.micro_batch, args.seq + 1), generator=generator
    ).to(device)


def run_arm(args: argparse.Namespace) -> int:
    """One arm in this process (under ``torch.distributed.run``): rank 0 writes ``--arm-out``."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    cpu_run = "--device cpu --quick"
    device = _common.start_process_group("bench_moonlight", args.device, backend, cpu_run)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    tokens = training_tokens(args, device)
    try:
        result = measure(args.arm, args, mesh, device, tokens)
    except Exception as error:  # recorded, so the other arm's numbers are not lost
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    if dist.get_rank() == 0:
        result.update(
            device=_common.device_name(device), world_size=world, backend=dist.get_backend()
        )
        if args.arm == "dmuon-muonclip" or "error" not in result:
            result["ns_backend"] = dmuon.get_ns_backend()
        args.arm_out.write_text(json.dumps(result, default=str))
    dist.destroy_process_group()
    return 0 if "error" not in result and result["losses_finite"] else 1


# ---- the driver -------------------------------------------------------------------------------


def arm_command(args: argparse.Namespace, arm: str, arm_out: Path) -> list[str]:
    """The command of one arm, with this run's settings: ``torch.distributed.run`` for several
    ranks; one rank is started directly (``arm_environment``), a process and an import of torch
    fewer."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    return [
        sys.executable, *(launcher if args.nproc > 1 else []), __file__,
        "--arm", arm, "--arm-out", str(arm_out),
        "--device", args.device, "--seq", str(args.seq), "--micro-batch", str(args.micro_batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--tau", str(args.tau),
        "--layers", str(args.model.layers), "--vocab", str(args.model.vocab),
        "--checkpoint" if args.checkpoint else "--no-checkpoint",
        *(["--quick"] if args.quick else []),
    ]  # fmt: skip


def arm_environment(args: argparse.Namespace) -> dict[str, str]:
    """This environment, plus the rendezvous variables ``torch.distributed.run`` would set for
    one rank on a free local port."""
    environment = os.environ.copy()
    if args.nproc == 1:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        environment.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    return environment


def print_report(header: str, results: dict) -> None:
    print(header)
    print(
        f"{'arm':<15} {'build s':>8} {'first s':>8} {'step ms':>9} {'vs adamw':>9} "
        f"{'opt ms':>8} {'opt dev ms':>10} {'peak GiB':>9} {'state GiB':>9} "
        f"{'loss first->last':>18}"
    )
    baseline = results.get("fsdp2-adamw", {}).get("step_ms_median")
    for arm, result in results.items():
        if "error" in result:
            print(f"{arm:<15} FAILED: {result['error']}")
            continue
        step = result["step_ms_median"]
        device_ms = result["optimizer_device_ms_median"]
        peak = result["peak_gib"]
        losses = result["losses"]
        finite = "" if result["losses_finite"] else " NOT FINITE"
        print(
            f"{arm:<15} {result['build_s']:>8.2f} {result['first_step_s']:>8.2f} {step:>9.2f} "
            f"{f'{step / baseline:.3f}x' if baseline else '-':>9} "
            f"{result['optimizer_ms_median']:>8.2f} "
            f"{f'{device_ms:.2f}' if device_ms is not None else '-':>10} "
            f"{f'{peak:.2f}' if peak is not None else '-':>9} "
            f"{result['optimizer_state_gib']:>9.3f} {losses[0]:>8.4f}->{losses[-1]:<8.4f}{finite}"
        )
    clip = results.get("dmuon-muonclip", {})
    if "max_logit_per_step" in clip:
        print(
            f"dmuon-muonclip: QK-clip tau {clip['qk_clip_threshold']:g}: largest logit per step "
            f"{[round(x, 2) for x in clip['max_logit_per_step']]}, heads clipped per step "
            f"{clip['clipped_heads_per_step']}; routes {clip['routing']}"
        )
    for arm, result in results.items():
        if "traceback" in result:
            print(f"{arm} failed with:\n{result['traceback']}")


def drive(args: argparse.Namespace) -> int:
    """Run each arm in its own process, then print the table and write the JSON."""
    counts = parameter_counts(args.model)
    header = (
        f"bench_moonlight: {args.device} x {args.nproc}, torch {torch.__version__}; "
        f"Moonlight-shaped {counts['total'] / 1e6:,.1f} M params "
        f"({counts['active_per_token'] / 1e6:,.1f} M active), "
        f"{args.model.layers} layers ({args.model.dense_layers} dense), vocab {args.model.vocab}; "
        f"micro-batch {args.micro_batch} x seq {args.seq}, bf16 compute, fp32 params; activation "
        f"checkpointing {'ON' if args.checkpoint else 'off'}; median of {args.steps} steps after "
        f"{args.warmup} warm-up"
    )
    print(header, flush=True)
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        for arm in args.arms:
            arm_out = Path(scratch) / f"{arm}.json"
            started = time.perf_counter()
            command = arm_command(args, arm, arm_out)
            completed = subprocess.run(command, env=arm_environment(args))
            seconds = time.perf_counter() - started
            if arm_out.exists():
                results[arm] = json.loads(arm_out.read_text())
            else:
                results[arm] = {"error": f"the arm's process exited {completed.returncode} "
                                "without a record (its output above says why)"}  # fmt: skip
            results[arm]["process_seconds"] = seconds
            print(f"  {arm}: exit {completed.returncode} after {seconds:.1f} s", flush=True)
    print()
    print_report(header, results)
    device_label = next((r["device"] for r in results.values() if "device" in r), args.device)
    date = _common.utc_now()
    record = {
        "benchmark": "bench_moonlight",
        "inputs": {
            "model": asdict(args.model),
            "params": counts,
            "seq": args.seq,
            "micro_batch": args.micro_batch,
            "tokens_per_step": args.seq * args.micro_batch * args.nproc,
            "steps": args.steps,
            "warmup": args.warmup,
            "checkpoint": args.checkpoint,
            "compute_dtype": "bfloat16",
            "master_dtype": "float32",
            "arms": args.arms,
            "nproc": args.nproc,
            "quick": args.quick,
            "adamw_lr": ADAMW_LR,
            "muon": "dmuon.Muon(model) defaults",
            "qk_clip_threshold": args.tau,
            "expert_compute": "tokens sorted by expert, one matmul per expert (unbind)",
        },
        "device": device_label,
        **_common.versions(dmuon=dmuon.__version__),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "timing": "each arm in its own process; per step: host clock from a synchronisation "
        "before zero_grad to one after step(), with a synchronisation before step(); optimizer: "
        "host clock across step() (QK-clip included) between the two synchronisations, and CUDA "
        "events around it (device); first step: the first such step, cold; median over steps",
        "env": _common.dmuon_environment(),
        "results": results,
    }
    out = args.out
    if out is None and not args.quick:
        out = _common.result_path("moonlight", device_label, date)
    if out is not None:
        _common.write_json(out, record)
    failed = [a for a, r in results.items() if "error" in r or not r.get("losses_finite")]
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model, seq 32 (smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="default 4 (2 with --quick)")
    parser.add_argument("--vocab", type=int, default=None, help="default 163840 (512)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (32 with --quick)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default 2")
    parser.add_argument("--steps", type=int, default=None, help="timed steps; default 8 (2)")
    parser.add_argument("--warmup", type=int, default=None, help="default 2 (1 with --quick)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per arm (default 1)")
    parser.add_argument(
        "--tau",
        type=float,
        default=QK_CLIP_THRESHOLD,
        help=f"QK-clip threshold (default {QK_CLIP_THRESHOLD:g}; a small one makes the clip act)",
    )
    parser.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="non-reentrant activation checkpointing per layer (default off)",
    )
    parser.add_argument(
        "--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)} (default both)"
    )
    parser.add_argument("--arm", choices=ARMS, default=None, help="internal: run this arm only")
    parser.add_argument("--arm-out", type=Path, default=None, help="internal: the arm's record")
    _common.add_record_options(parser, "default: benchmarks/results/moonlight-<gpu>-<date>.json")
    args = parser.parse_args(argv)
    base = QUICK_CONFIG if args.quick else MoonlightConfig()
    args.model = replace(base, layers=args.layers or base.layers, vocab=args.vocab or base.vocab)
    args.seq = args.seq or (32 if args.quick else 2048)
    args.micro_batch = args.micro_batch or 2
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    if args.arm is not None and args.arm_out is None:
        parser.error("--arm needs --arm-out (the driver passes both)")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    args = parse_args(argv)
    if args.arm is not None:
        return run_arm(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
