"""Scenarios of the DDP path (replicated, not sharded), run on every rank of a gloo pool.

Each builds the tiny decoder, dedicates its projections, wraps it in torch's
``DistributedDataParallel`` (without ``find_unused_parameters``) and trains it against the
single-process reference on the full batch; or sets up a model the wrong way and returns what
``dmuon.Muon`` raised, so the test sees every rank's message and the pool keeps its workers.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import dmuon
import dmuon.checkpoint as dckpt
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed import scenarios_checkpoint
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_protocol import TrainConfig, make_model
from tests.distributed.shared_reference import plain_reference_step, step_on_first_rank
from tests.reference_optim import ReferenceMuonAdamW

FP32_NS = functools.partial(NewtonSchulz, dtype=torch.float32, kernel="cublas")


def _flat_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


# AdamW without weight decay on both sides: which parameters decay (biases and norms do not, by
# default) is the optimizer's concern and tested there; here only the data path differs.
def _muon(model):
    return dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        adamw_weight_decay=0.0,
        ns_backend=FP32_NS(backend="gram"),
    )


def _reference(config: TrainConfig):
    reference = make_model(config)
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        proj_predicate,
        lr=0.02,
        weight_decay=0.01,
        adamw_weight_decay=0.0,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    return reference, optimizer


def wrap_in_ddp(model, entry_point: str = "ddp"):
    """What a user writes: dedicate the projections, then DDP around the same model."""
    mesh = _flat_mesh()
    if entry_point == "dedicate_params_ddp":
        return dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
    dmuon.dedicate_params(model, mesh, proj_predicate)
    return DistributedDataParallel(model)


def _weights(model) -> dict[str, torch.Tensor]:
    """Owned dedicated masters and every replicated parameter (plain tensors under DDP)."""
    state = get_dedicated_state(model)
    weights = {p.fqn: p.master.detach().clone() for p in state.iter_owned_masters()}
    for name, param in model.named_parameters():
        if name not in state.params:
            weights[name] = param.detach().clone()
    return weights


def _replicas_differ(model) -> float:
    """Largest difference between this rank's replicated parameters and rank 0's."""
    state = get_dedicated_state(model)
    worst = 0.0
    for name, param in model.named_parameters():
        if name in state.params:
            continue
        rank0 = param.detach().clone()
        dist.broadcast(rank0, src=0)
        worst = max(worst, (param.detach() - rank0).abs().max().item())
    return worst


def ddp_against_reference(
    steps: int = 10,
    micro_batches: int = 1,
    model: dict | None = None,
    entry_point: str = "ddp",
) -> dict:
    """Train the DDP-wrapped model and the reference; per-step max relative error, drift."""
    config = TrainConfig(model=model or {}, steps=steps, micro_batches=micro_batches)
    inner = make_model(config)
    ddp_model = wrap_in_ddp(inner, entry_point)
    optimizer = _muon(inner)
    reference, reference_optimizer = _reference(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    max_errors = []
    for batch in batches(steps, world):
        chunks = rank_rows(batch, rank, world).chunk(micro_batches)
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            with contextlib.nullcontext() if last else dmuon.no_sync(inner):
                (loss_fn(ddp_model, chunk) / len(chunks)).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_on_first_rank(reference, plain_reference_step, reference, reference_optimizer, batch)
        expected = dict(reference.named_parameters())
        max_errors.append(
            max(
                ((value - expected[name]).norm() / expected[name].norm()).item()
                for name, value in _weights(inner).items()
            )
        )
    return {"max_errors": max_errors, "replicas_differ": _replicas_differ(inner)}


def no_sync_skips_ddp_all_reduce() -> dict:
    """Gradients of a replicated parameter after one backward inside dmuon.no_sync: local."""
    inner = TinyDecoder()
    ddp_model = wrap_in_ddp(inner)
    _muon(inner)
    rows = rank_rows(batches(1, dist.get_world_size())[0], dist.get_rank(), dist.get_world_size())
    with dmuon.no_sync(inner):
        loss_fn(ddp_model, rows).backward()
    grad = inner.norm.weight.grad.clone()
    everyone = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, grad)
    return {
        "local_grads_differ": any(not torch.equal(g, everyone[0]) for g in everyone),
        "sync_restored": ddp_model.require_backward_grad_sync,
    }


def _muon_error(model) -> str:
    try:
        _muon(model)
    except ValueError as error:
        return str(error)
    return "no error"


def neither_sharded_nor_replicated() -> str:
    model = TinyDecoder()
    dmuon.dedicate_params(model, _flat_mesh(), proj_predicate)
    return _muon_error(model)


def ddp_before_dedicate_params() -> str:
    model = TinyDecoder()
    mesh = _flat_mesh()
    ddp_model = DistributedDataParallel(model)
    dmuon.dedicate_params(model, mesh, proj_predicate)
    message = _muon_error(model)
    del ddp_model
    return message


def ddp_around_a_parent_module() -> str:
    """dedicate_params on the model, DDP around a module that contains it: DDP's first
    broadcast reads the placeholders, which refuse."""
    model = TinyDecoder()
    dmuon.dedicate_params(model, _flat_mesh(), proj_predicate)
    try:
        DistributedDataParallel(torch.nn.ModuleDict({"decoder": model}))
    except RuntimeError as error:
        return str(error)
    return "no error"


def ddp_over_other_ranks() -> str:
    """DDP on a group of one rank each while dmuon's mesh spans the world."""
    model = TinyDecoder()
    dmuon.dedicate_params(model, _flat_mesh(), proj_predicate)
    alone = [dist.new_group([rank]) for rank in range(dist.get_world_size())]
    ddp_model = DistributedDataParallel(model, process_group=alone[dist.get_rank()])
    message = _muon_error(model)
    del ddp_model
    return message


def wrapper_given_to_muon() -> str:
    model = TinyDecoder()
    ddp_model = wrap_in_ddp(model)
    try:
        _muon(ddp_model)
    except ValueError as error:
        return str(error)
    return "no error"


def composable_replicate() -> str:
    from torch.distributed._composable.replicate import replicate

    model = TinyDecoder()
    dmuon.dedicate_params(model, _flat_mesh(), proj_predicate)
    replicate(model)
    return _muon_error(model)


def replicate_mesh_given_to_dedicate_params_ddp() -> str:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    try:
        dmuon.dedicate_params_ddp(
            TinyDecoder(), mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"]
        )
    except ValueError as error:
        return str(error)
    return "no error"


# ---- checkpoints: DDP <-> 1-D FSDP2 ---------------------------------------------------------


def _build(layout: str):
    if layout == "fsdp":
        return (*scenarios_checkpoint.build(replicas=1), None)
    torch.manual_seed(0)
    model = TinyDecoder()
    ddp_model = wrap_in_ddp(model)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )
    return model, optimizer, ddp_model


def _train(model, forward_model, optimizer, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    every = batches(scenarios_checkpoint.STEPS, 1, per_rank=scenarios_checkpoint.GLOBAL_ROWS)
    for step in steps:
        loss_fn(forward_model, rank_rows(every[step], rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()


def save_midway_and_finish(
    path: str, layout: str, save_at: int = scenarios_checkpoint.SAVE_AT
) -> dict:
    model, optimizer, ddp_model = _build(layout)
    forward_model = ddp_model or model
    _train(model, forward_model, optimizer, range(save_at))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    _train(model, forward_model, optimizer, range(save_at, scenarios_checkpoint.STEPS))
    return {"weights": scenarios_checkpoint.full_weights(model)}


def resume_and_finish(path: str, layout: str, save_at: int = scenarios_checkpoint.SAVE_AT) -> dict:
    model, optimizer, ddp_model = _build(layout)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resume on another layout loads every entry
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _train(model, ddp_model or model, optimizer, range(save_at, scenarios_checkpoint.STEPS))
    return {"weights": scenarios_checkpoint.full_weights(model)}
