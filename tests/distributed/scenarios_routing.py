"""Scenarios of param_groups=, no_decay= and routes= on every rank of a gloo pool.

Each trains the tiny decoder with dedicate_params + fully_shard + dmuon.Muon and, on every rank,
the single-process reference with the per-parameter learning rates and weight decays the same
options mean, written out by name (``expected_hyperparameters``), not taken from dmuon.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
import dmuon.checkpoint as dckpt
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.layouts import data_parallel_meshes
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.reference_errors import relative_errors_to
from tests.reference_optim import ReferenceMuonAdamW

LR, ADAMW_LR, WEIGHT_DECAY, ADAMW_WEIGHT_DECAY = 0.02, 1e-3, 0.05, 0.01
LAYER_1_LR = 0.005  # param_groups=[{"params": <layers.1.*>, "lr": LAYER_1_LR}]


def is_norm_or_bias(name: str) -> bool:
    """HF Trainer's rule on the tiny decoder: its norms are named ``*_norm`` and ``norm``."""
    return name.endswith(".bias") or "norm" in name


def is_muon(routes: dict[str, str], name: str, param) -> bool:
    route = routes.get(name)
    return route == "muon" if route is not None else proj_predicate(name, param)


def expected_hyperparameters(model, layer_1_group: bool, no_decay: bool) -> dict:
    per_param = {}
    for name, _ in model.named_parameters():
        entry = {}
        if no_decay and is_norm_or_bias(name):
            entry["weight_decay"] = 0.0
        if layer_1_group and name.startswith("layers.1."):
            entry["lr"] = LAYER_1_LR
        if entry:
            per_param[name] = entry
    return per_param


def build(replicas: int, routes: dict, layer_1_group: bool, no_decay: bool):
    torch.manual_seed(0)
    model = TinyDecoder()
    shard_mesh, replicate_mesh, fsdp_mesh = data_parallel_meshes(replicas)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lm_head on Muon has no layer boundary: expected
        dmuon.dedicate_params(
            model, shard_mesh, proj_predicate, replicate_mesh=replicate_mesh, routes=routes
        )
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    groups = (
        [{"params": lambda name, p: name.startswith("layers.1."), "lr": LAYER_1_LR}]
        if layer_1_group
        else None
    )
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        adamw_lr=ADAMW_LR,
        adamw_weight_decay=ADAMW_WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        param_groups=groups,
        no_decay="hf" if no_decay else None,
    )
    return model, optimizer


def train_against_reference(
    replicas: int = 1,
    routes: dict | None = None,
    layer_1_group: bool = True,
    no_decay: bool = True,
    steps: int = 4,
    scheduler: bool = False,
) -> dict:
    routes = routes or {}
    model, optimizer = build(replicas, routes, layer_1_group, no_decay)
    torch.manual_seed(0)
    reference = TinyDecoder()
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        functools.partial(is_muon, routes),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        adamw_lr=ADAMW_LR,
        adamw_weight_decay=ADAMW_WEIGHT_DECAY,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
        per_param=expected_hyperparameters(reference, layer_1_group, no_decay),
    )
    lr_scheduler = (
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if scheduler else None
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    max_errors = []
    for step, batch in enumerate(batches(steps, world)):
        loss_fn(model, rank_rows(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_fn(reference, batch).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        if lr_scheduler is not None:
            lr_scheduler.step()
            # The reference scales every learning rate as StepLR does, by name.
            factor = 0.5 ** (step + 1)
            reference_optimizer.lr, reference_optimizer.adamw_lr = LR * factor, ADAMW_LR * factor
            for name, entry in expected_hyperparameters(reference, layer_1_group, no_decay).items():
                reference_optimizer.per_param[name] = {
                    **entry,
                    **({"lr": entry["lr"] * factor} if "lr" in entry else {}),
                }
        max_errors.append(max(relative_errors_to(model, reference).values()))
    return {"max_errors": max_errors, "routing": optimizer.routing()}


def routes_moved_in_a_checkpoint(path: str) -> dict:
    """Save after 2 steps with the projections on Muon; load into a model whose routes move
    ``layers.0.q_proj.weight`` to owner-side AdamW, ``layers.1.up_proj.weight`` to FSDP2 and
    ``lm_head.weight`` to Muon; train on."""
    model, optimizer = build(1, {}, layer_1_group=False, no_decay=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in batches(2, world):
        loss_fn(model, rank_rows(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)

    moved = {
        "layers.0.q_proj.weight": "adamw",
        "layers.1.up_proj.weight": "sharded_adamw",
        "lm_head.weight": "muon",
    }
    model, optimizer = build(1, moved, layer_1_group=False, no_decay=True)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    losses = []
    for batch in batches(2, world, seed=99):
        loss = loss_fn(model, rank_rows(batch, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "warnings": [str(w.message) for w in caught if "dmuon.checkpoint" in str(w.message)],
        "routes": {row.fqn: row.route for row in optimizer.routing() if row.fqn in moved},
        "group_routes": [g["route"] for g in optimizer.param_groups],
        "losses": losses,
    }


def rank_dependent_param_groups() -> str:
    """Rank 1 gives layer 1 another learning rate: every rank must get the agreement error."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    fully_shard(model, mesh=mesh)
    lr = 0.01 if dist.get_rank() == 1 else 0.02
    try:
        dmuon.Muon(model, param_groups=[{"params": ["layers.1.q_proj.weight"], "lr": lr}])
    except ValueError as error:
        return str(error)
    return "no error"
