"""Scenarios of mixture-of-experts stacks (E, m, n), run on every rank of a gloo pool.

Each trains the tiny MoE decoder (``models_moe``) with its projections and expert stacks
dedicated, on FSDP2 (1-D or HSDP) or DDP, against the single-process reference that updates each
expert slice as its own matrix (``ReferenceMuonAdamW(expert_stacks=...)``), and reports what the
test asserts: per-step errors, the expert slices' owners, and the matrices each rank
orthogonalised.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.models import batches, loss_fn, rank_rows
from tests.distributed.models_moe import MoEDecoder, expert_stack_names, moe_predicate
from tests.reference_optim import ReferenceMuonAdamW

LR, WEIGHT_DECAY = 0.02, 0.01


@dataclass(kw_only=True)
class MoEConfig:
    replicas: int = 1  # > 1: HSDP with a ("replicate", "shard") mesh
    steps: int = 10
    reshard_after_forward: bool = True
    micro_batches: int = 1  # > 1: accumulation under dmuon.no_sync
    checkpoint_layers: bool = False
    ddp: bool = False  # DistributedDataParallel instead of fully_shard


def make_model(config: MoEConfig) -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(checkpoint_layers=config.checkpoint_layers)


def build(config: MoEConfig):
    """The dmuon model as a user writes it; returns (model, module to call, optimizer, owners)."""
    model = make_model(config)
    world = dist.get_world_size()
    if config.ddp:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        owners = dmuon.dedicate_params(model, mesh, moe_predicate)
        runner = DistributedDataParallel(model, process_group=mesh.get_group())
    else:
        if config.replicas > 1:
            mesh = init_device_mesh(
                "cpu",
                (config.replicas, world // config.replicas),
                mesh_dim_names=("replicate", "shard"),
            )
            shard_mesh, replicate_mesh, fsdp_mesh = mesh["shard"], mesh["replicate"], mesh
        else:
            shard_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
            replicate_mesh, fsdp_mesh = None, shard_mesh
        owners = dmuon.dedicate_params(
            model,
            shard_mesh,
            moe_predicate,
            replicate_mesh=replicate_mesh,
            reshard_after_forward=config.reshard_after_forward,
        )
        for layer in model.layers:
            fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=config.reshard_after_forward)
        fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=config.reshard_after_forward)
        runner = model
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )
    return model, runner, optimizer, owners


def build_reference(config: MoEConfig):
    reference = make_model(config)
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        moe_predicate,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
        expert_stacks=expert_stack_names(reference),
    )
    return reference, optimizer


def train_step(model, runner, optimizer, batch: torch.Tensor, config: MoEConfig) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = rank_rows(batch, rank, world).chunk(config.micro_batches)
    for index, chunk in enumerate(micro):
        last = index == len(micro) - 1
        with dmuon.no_sync(model) if not last else contextlib.nullcontext():
            (loss_fn(runner, chunk) / len(micro)).backward()
    optimizer.step()
    optimizer.zero_grad()


def owned_errors(model, reference) -> dict[str, float]:
    """Relative error of every weight this rank holds in full: owned masters (an expert piece
    against its experts of the reference stack) and the parameters FSDP2 or DDP keep."""
    state = get_dedicated_state(model)
    expected = dict(reference.named_parameters())
    weights = {}
    for p in state.iter_owned_masters():
        if p.experts is not None:
            start, stop = p.experts
            weights[p.fqn] = (p.master, expected[p.stack.fqn][start:stop])
        else:
            weights[p.fqn] = (p.master, expected[p.fqn])
    for name, param in model.named_parameters():
        if name in state.params or name in state.stacks:
            continue
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        weights[name] = (value, expected[name])
    return {
        name: ((value.detach() - ref.detach()).norm() / ref.detach().norm()).item()
        for name, (value, ref) in weights.items()
    }


def train_against_reference(**kwargs) -> dict:
    """Train dmuon and the reference side by side; per-step max relative error, the owners, and
    the (rows, cols) of every matrix this rank orthogonalised in the first step."""
    config = MoEConfig(**kwargs)
    model, runner, optimizer, owners = build(config)
    reference, reference_optimizer = build_reference(config)
    orthogonalised = _record_newton_schulz(optimizer)
    max_errors = []
    for step, batch in enumerate(batches(config.steps, dist.get_world_size())):
        train_step(model, runner, optimizer, batch, config)
        if step == 0:
            first_step_matrices = list(orthogonalised)
        loss_fn(reference, batch).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        max_errors.append(max(owned_errors(model, reference).values()))
    state = get_dedicated_state(model)
    return {
        "max_errors": max_errors,
        "owners": {name: (c.shard, c.replicate) for name, c in owners.items()},
        "expert_slices": dict(state.plan.expert_slices),
        "orthogonalised": first_step_matrices,
        "routing": optimizer.routing(),
        "stack_is_leaf_in_forward": _stack_seen_in_forward(model, runner),
    }


def _record_newton_schulz(optimizer) -> list[tuple[int, int]]:
    """Record the (short, long) shape of every matrix each Newton-Schulz call receives."""
    shapes: list[tuple[int, int]] = []
    newton_schulz = optimizer.newton_schulz
    iterate = newton_schulz.iterate_normalized

    def recording(inputs):
        shapes.extend(tuple(matrix.shape) for matrix in inputs)
        return iterate(inputs)

    newton_schulz.iterate_normalized = recording
    return shapes


def _stack_seen_in_forward(model, runner) -> dict:
    """What the block's forward sees of ``w_in``: its shape and whether it is an autograd leaf."""
    seen = {}
    block = model.layers[0]

    def look(module, args):
        seen["shape"] = tuple(module.w_in.shape)
        seen["is_leaf"] = module.w_in.is_leaf and module.w_in.requires_grad

    handle = block.register_forward_pre_hook(look)
    with torch.no_grad():
        runner(batches(1, dist.get_world_size())[0][:1])
    handle.remove()
    return seen
