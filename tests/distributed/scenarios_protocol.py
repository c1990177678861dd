"""Scenarios of the ownership protocol, run on every rank of a gloo pool.

Each builds the same tiny decoder on every rank and a single-process reference of it, trains
both on the same data (the reference on the full batch, each rank on its rows) and reports what
the test asserts. Collectives run for real; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.api import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.reference_optim import ReferenceMuonAdamW


@dataclass(kw_only=True)
class TrainConfig:
    replicas: int = 1  # > 1: HSDP with a ("replicate", "shard") mesh
    steps: int = 10
    ns_backend: str = "gram"
    ns_dtype: str = "float32"
    reshard_after_forward: bool = True
    replicate_async: bool = True
    micro_batches: int = 1  # > 1: gradient accumulation under dmuon.no_sync
    model: dict = field(default_factory=dict)
    weight_decay: float = 0.01
    two_steps_without_forward: bool = False


def build(config: TrainConfig):
    """The dmuon model (dedicated + fully_shard) and its optimizer, as a user writes it."""
    world = dist.get_world_size()
    if config.replicas > 1:
        mesh = init_device_mesh(
            "cpu", (config.replicas, world // config.replicas),
            mesh_dim_names=("replicate", "shard"),
        )
        shard_mesh, replicate_mesh, fsdp_mesh = mesh["shard"], mesh["replicate"], mesh
    else:
        shard_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        replicate_mesh, fsdp_mesh = None, shard_mesh
    torch.manual_seed(0)
    model = TinyDecoder(**config.model)
    owners = dmuon.dedicate_params(
        model, shard_mesh, proj_predicate, replicate_mesh=replicate_mesh,
        reshard_after_forward=config.reshard_after_forward,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=config.reshard_after_forward)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=config.reshard_after_forward)
    ns_dtype = getattr(torch, config.ns_dtype)
    optimizer = dmuon.Muon(
        model, lr=0.02, weight_decay=config.weight_decay,
        ns_backend=NewtonSchulz(backend=config.ns_backend, dtype=ns_dtype, kernel="cublas"),
        replicate_async=config.replicate_async,
    )
    return model, optimizer, owners


def build_reference(config: TrainConfig):
    torch.manual_seed(0)
    reference = TinyDecoder(**config.model)
    orthogonalize = functools.partial(
        newton_schulz, backend=config.ns_backend, dtype=getattr(torch, config.ns_dtype)
    )
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(), proj_predicate, lr=0.02,
        weight_decay=config.weight_decay, orthogonalize=orthogonalize,
    )
    return reference, optimizer


def train_step(model, optimizer, batch: torch.Tensor, config: TrainConfig) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = rank_rows(batch, rank, world)
    micro = rows.chunk(config.micro_batches)
    total = 0.0
    for index, chunk in enumerate(micro):
        last = index == len(micro) - 1
        context = dmuon.no_sync(model) if not last else contextlib.nullcontext()
        with context:
            loss = loss_fn(model, chunk) / len(micro)
            loss.backward()
        total += loss.item()
    optimizer.step()
    if config.two_steps_without_forward:
        optimizer.step()
    optimizer.zero_grad()
    return total


def reference_step(reference, optimizer, batch: torch.Tensor, config: TrainConfig) -> float:
    loss = loss_fn(reference, batch)
    loss.backward()
    optimizer.step()
    if config.two_steps_without_forward:
        optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def current_weights(model) -> dict[str, torch.Tensor]:
    """Full weights this rank can see: owned dedicated masters and every FSDP2 parameter."""
    state = get_dedicated_state(model)
    weights = {p.fqn: p.master.detach().clone() for p in state.iter_owned_masters()}
    for name, param in model.named_parameters():
        if name in state.params:
            continue
        weights[name] = param.full_tensor().detach().clone()
    return weights


def relative_errors(weights: dict[str, torch.Tensor], reference) -> dict[str, float]:
    expected = dict(reference.named_parameters())
    return {
        name: ((value - expected[name]).norm() / expected[name].norm().clamp_min(1e-30)).item()
        for name, value in weights.items()
    }


def train_against_reference(**kwargs) -> dict:
    """Train dmuon and the reference side by side; per-step max relative parameter error."""
    config = TrainConfig(**kwargs)
    model, optimizer, owners = build(config)
    reference, reference_optimizer = build_reference(config)
    world = dist.get_world_size()
    max_errors, losses = [], []
    for batch in batches(config.steps, world):
        losses.append(train_step(model, optimizer, batch, config))
        reference_step(reference, reference_optimizer, batch, config)
        errors = relative_errors(current_weights(model), reference)
        max_errors.append(max(errors.values()))
    return {
        "max_errors": max_errors,
        "losses": losses,
        "owned": {p.fqn: p.master.detach().clone() for p in get_dedicated_state(model).iter_owned_masters()},
        "owners": {name: (c.shard, c.replicate) for name, c in owners.items()},
    }
