"""Canonical FQNs on gloo: checkpoints move between wrapped and plain blocks, dmuon and stock.

The tiny decoder's blocks are wrapped before ``dedicate_params`` as a trainer does it: torch's
activation-checkpoint wrapper (``checkpoint_wrapper``: names gain ``_checkpoint_wrapped_module``)
and ``torch.compile(block, backend="eager")`` (an ``OptimizedModule``: names gain ``_orig_mod``),
or both. ``wrappers`` names them: ``""`` (plain), ``"ac"``, ``"compile"``, ``"ac+compile"``.
Training and data are those of ``scenarios_checkpoint`` (the same global batches on any world
size), so a run resumed from a checkpoint written with other wrappers must continue as if
uninterrupted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
import dmuon.checkpoint as dckpt
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_checkpoint import (
    GLOBAL_ROWS,
    SAVE_AT,
    STEPS,
    full_weights,
    train,
)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def wrapped_model(wrappers: str) -> TinyDecoder:
    """The tiny decoder (seed 0) with each block wrapped as ``wrappers`` says."""
    torch.manual_seed(0)
    model = TinyDecoder()
    for index, block in enumerate(model.layers):
        if "ac" in wrappers.split("+"):
            block = checkpoint_wrapper(block)
        if "compile" in wrappers.split("+"):
            block = torch.compile(block, backend="eager")
        model.layers[index] = block
    return model


def build(wrappers: str, replicas: int = 1, **muon_options):
    """dmuon on FSDP2 (HSDP for ``replicas`` > 1; one process for ``replicas=0``)."""
    model = wrapped_model(wrappers)
    if replicas == 0:
        dmuon.dedicate_params(model, None, proj_predicate)
    else:
        dedicate_and_shard(model, "cpu", replicas, reshard_after_forward=True)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        **muon_options,
    )
    return model, optimizer


def _save(state_dict: dict, path: str, via: str) -> None:
    if via == "dcp":
        dcp.save(state_dict, checkpoint_id=path)
    else:
        dckpt.save(state_dict, path)


def _load(state_dict: dict, path: str, via: str) -> None:
    if via == "dcp":
        dcp.load(state_dict, checkpoint_id=path)
    else:
        dckpt.load(state_dict, path)


def names_seen(wrappers: str) -> dict:
    """Every name dmuon records or writes for the model with ``wrappers`` on this rank."""
    seen = []
    model = wrapped_model(wrappers)
    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    else:
        mesh = None

    def predicate(name, param):
        seen.append(name)
        return proj_predicate(name, param)

    owners = dmuon.dedicate_params(
        model,
        mesh,
        predicate,
        routes={"layers.1._checkpoint_wrapped_module.o_proj.bias": "adamw", "norm.weight": "adamw"}
        if "ac" in wrappers.split("+")
        else {"layers.1.o_proj.bias": "adamw", "norm.weight": "adamw"},
    )
    if mesh is not None:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(
        model,
        param_groups=[
            {"params": ["layers.0.q_proj.weight"], "lr": 0.01},
            {"params": lambda name, p: name.startswith("layers.2."), "weight_decay": 0.5},
        ],
    )
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    full_sd, full_optim_sd = dckpt.get_state_dict(model, optimizer, options=FULL)
    return {
        "predicate": seen,
        "owners": {name: repr(owner) for name, owner in owners.items()},
        "dedicated": sorted(get_dedicated_state(model).params),
        "routing": [(row.fqn, row.route, row.lr, row.weight_decay) for row in optimizer.routing()],
        "model_keys": sorted(model_sd),
        "optim_keys": sorted(optim_sd["state"]),
        "optim_groups": [sorted(group["params"]) for group in optim_sd["param_groups"]],
        "full_keys": sorted(full_sd),
        "full_optim_keys": sorted(full_optim_sd.get("state", {})),
    }


def save_midway_and_finish(
    path: str, wrappers: str, replicas: int = 1, save_at: int = SAVE_AT, via: str = "dckpt"
) -> dict:
    """Train with ``wrappers``, save at ``save_at``, finish: the uninterrupted run's weights."""
    model, optimizer = build(wrappers, replicas)
    train(model, optimizer, range(save_at))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    _save({"model": model_sd, "optim": optim_sd}, path, via)
    train(model, optimizer, range(save_at, STEPS))
    return {"weights": full_weights(model)}


def resume_and_finish(
    path: str, wrappers: str, replicas: int = 1, save_at: int = SAVE_AT, via: str = "dckpt"
) -> dict:
    """A fresh model with ``wrappers`` loaded from ``path`` and trained to ``STEPS``."""
    model, optimizer = build(wrappers, replicas)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    _load({"model": model_sd, "optim": optim_sd}, path, via)
    dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(model, optimizer, range(save_at, STEPS))
    return {"weights": full_weights(model)}


# ---- dmuon and stock FSDP2 + AdamW --------------------------------------------------------------


def stock_model(wrappers: str) -> TinyDecoder:
    """The same decoder on stock FSDP2 (no dmuon) over every rank."""
    model = wrapped_model(wrappers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def stock_saves(path: str, wrappers: str, steps: int = 3) -> dict[str, torch.Tensor]:
    """Stock FSDP2 + AdamW trained ``steps`` steps, its model saved with torch's state dict;
    returns its full weights (first rank)."""
    model = stock_model(wrappers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in batches(steps, 1, per_rank=GLOBAL_ROWS):
        loss_fn(model, rank_rows(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    return get_model_state_dict(model, options=FULL)


def dmuon_loads_model_part(path: str, wrappers: str, via: str = "dckpt") -> dict:
    """A dmuon model with ``wrappers`` loads the model part of ``path``; its full weights."""
    model, _ = build(wrappers)
    model_sd = dckpt.get_model_state_dict(model)
    _load({"model": model_sd}, path, via)
    dckpt.set_model_state_dict(model, model_sd)
    return full_weights(model)


def dmuon_saves_model_part(path: str, wrappers: str, steps: int = 3) -> dict:
    """dmuon trained ``steps`` steps with ``wrappers``, its model part saved; full weights."""
    model, optimizer = build(wrappers)
    train(model, optimizer, range(steps))
    dckpt.save({"model": dckpt.get_model_state_dict(model)}, path)
    return full_weights(model)


def stock_loads(path: str, wrappers: str) -> dict[str, torch.Tensor]:
    """Stock FSDP2 with ``wrappers`` loads ``path`` with torch's state dict; its full weights."""
    model = stock_model(wrappers)
    model_sd = get_model_state_dict(model)
    dcp.load({"model": model_sd}, checkpoint_id=path)
    set_model_state_dict(model, model_sd)
    return get_model_state_dict(model, options=FULL)
