"""A tiny Qwen3-MoE (transformers 5 keeps its experts as (E, m, n) tensors) under dmuon.

Runs on every rank of a gloo pool, or in one process: dmuon with the projections and the expert
stacks dedicated by ``dmuon_hf.default_predicate`` (FSDP2 on every decoder layer when
distributed) against the single-process reference that updates each expert slice as its own
matrix.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_hf import default_predicate
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.reference_optim import ReferenceMuonAdamW

VOCAB_SIZE = 64
GLOBAL_ROWS = 4
CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_qwen3_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))


def predicate(name: str, param) -> bool:
    """What a user would write by hand: the attention projections and the fused expert stacks (``experts.gate_up_proj``,
    ``experts.down_proj``); the router (``mlp.gate``) stays with FSDP2."""
    return ("proj" in name and param.ndim == 2) or param.ndim == 3


def full_weights_round_trip(output_dir: str) -> dict:
    """Save one tiny Qwen3-MoE with ``save_model`` (transformers 5 writes its fused expert stacks
    one tensor per expert) and load it into another through DMuonTrainer's full-weights path
    (``save_only_model`` resumes and ``load_best_model_at_end``), in one process."""
    from transformers import TrainingArguments

    import dmuon.checkpoint as dckpt
    from dmuon_hf import DMuonTrainer

    args = TrainingArguments(output_dir=output_dir, use_cpu=True, report_to=[])
    models = []
    for seed in (1, 2):
        model = tiny_qwen3_moe(seed)
        dmuon.dedicate_params(model, None, predicate)
        trainer = DMuonTrainer(model=model, args=args, optimizers=(dmuon.Muon(model), None))
        models.append((model, trainer))
    (saved, saving), (loaded, loading) = models
    saving.save_model(f"{output_dir}/checkpoint")
    loading._load_from_checkpoint(f"{output_dir}/checkpoint")
    return {
        "saved": dckpt.get_model_state_dict(saved),
        "loaded": dckpt.get_model_state_dict(loaded),
    }


def train_against_reference(steps: int = 4) -> dict:
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = tiny_qwen3_moe()
    chosen = default_predicate(model)
    if distributed:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        dmuon.dedicate_params(model, mesh, chosen)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        dmuon.dedicate_params(model, None, chosen)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )
    reference = tiny_qwen3_moe()
    stacks = [name for name, param in reference.named_parameters() if param.ndim == 3]
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        chosen,
        lr=0.02,
        weight_decay=0.01,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
        expert_stacks=stacks,
    )
    generator = torch.Generator().manual_seed(1)
    per_rank = GLOBAL_ROWS // world
    max_errors = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB_SIZE, (GLOBAL_ROWS, 12), generator=generator)
        mine = ids[rank * per_rank : (rank + 1) * per_rank]
        model(input_ids=mine, labels=mine).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        max_errors.append(_max_owned_error(model, reference))
    return {
        "max_errors": max_errors,
        "stacks": sorted(get_dedicated_state(model).stacks),
        "expected_stacks": sorted(stacks),
    }


def _max_owned_error(model, reference) -> float:
    """Worst relative error of the weights this rank holds in full (owned masters, an expert
    piece against its experts of the reference; FSDP2's parameters gathered)."""
    state = get_dedicated_state(model)
    expected = dict(reference.named_parameters())
    pairs = []
    for p in state.iter_owned_masters():
        if p.experts is not None:
            pairs.append((p.master, expected[p.stack.fqn][p.experts[0] : p.experts[1]]))
        else:
            pairs.append((p.master, expected[p.fqn]))
    for name, param in model.named_parameters():
        if name not in state.params and name not in state.stacks:
            value = param.full_tensor() if hasattr(param, "full_tensor") else param
            pairs.append((value, expected[name]))
    return max(
        ((value.detach() - ref.detach()).norm() / ref.detach().norm()).item()
        for value, ref in pairs
    )
