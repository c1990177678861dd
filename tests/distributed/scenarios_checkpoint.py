"""Checkpoint scenarios: save on one layout, resume on another, compare with an uninterrupted run.

Every run trains the tiny decoder on the same global batches (``GLOBAL_ROWS`` rows a step, split
evenly over the ranks), so the averaged gradient, and hence the training, is the same on any
world size up to the order of float additions. The functions here run on every rank of a gloo
pool, or in one process without torch.distributed (``replicas=0`` there means ``mesh=None``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import dmuon
import dmuon.checkpoint as dckpt
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard_on
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_protocol import dedicate_and_shard
from tests.distributed.scenarios_tensor_parallel import tensor_parallel_plan

GLOBAL_ROWS = 24  # divisible by every world size the tests use (1, 2, 3, 4, 8)
# A checkpoint is saved after SAVE_AT steps (momentum and AdamW moments already past their first
# step) and resumed for STEPS - SAVE_AT more: the first resumed step reads the loaded state, the
# second the state the resumed run made itself.
STEPS = 4
SAVE_AT = 2
FULL_ON_FIRST_RANK = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def build(
    replicas: int = 1,
    predicate=proj_predicate,
    model_kwargs: dict | None = None,
    tp: int = 1,
    **muon_options,
):
    torch.manual_seed(0)
    model = TinyDecoder(**(model_kwargs or {}))
    if tp > 1:
        _tensor_parallel(model, tp, predicate)
    elif _distributed():
        dedicate_and_shard(model, "cpu", replicas, reshard_after_forward=True, predicate=predicate)
    else:
        dmuon.dedicate_params(model, None, predicate)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        **muon_options,
    )
    return model, optimizer


def _tensor_parallel(model, tp: int, predicate) -> None:
    """dp x tp: torch's colwise/rowwise plan on the "tp" dim, dmuon and FSDP2 on "dp"."""
    mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=False))
    dedicate_and_shard_on(model, mesh["dp"], predicate=predicate)


def train(model, optimizer, steps: range) -> list[float]:
    # The data is split over the ownership grid (TP peers see the same rows).
    grid = sorted(r for row in get_dedicated_state(model).mesh.rank_grid for r in row)
    rank = grid.index(dist.get_rank()) if dist.is_initialized() else 0
    world = len(grid)
    # Step i's batch is the same whatever the count drawn (one generator, drawn in order).
    every = batches(max(steps.stop, STEPS), 1, per_rank=GLOBAL_ROWS)
    losses = []
    for step in steps:
        loss = loss_fn(model, rank_rows(every[step], rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_weights(model) -> dict[str, torch.Tensor]:
    """The full model on the first rank ({} elsewhere)."""
    return dckpt.get_model_state_dict(model, options=FULL_ON_FIRST_RANK)


def save_midway_and_finish(
    path: str, replicas: int = 1, save_at: int = SAVE_AT, tp: int = 1
) -> dict:
    """Train ``save_at`` steps, save, train to ``STEPS``: the uninterrupted run and its checkpoint."""
    model, optimizer = build(replicas, tp=tp)
    train(model, optimizer, range(save_at))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    train(model, optimizer, range(save_at, STEPS))
    return {"weights": full_weights(model)}


def resume_and_finish(path: str, replicas: int = 1, save_at: int = SAVE_AT, tp: int = 1) -> dict:
    """A fresh model and optimizer, loaded from ``path``, trained to ``STEPS``."""
    model, optimizer = build(replicas, tp=tp)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resume on another layout loads every entry
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    lrs = [group["lr"] for group in optimizer.param_groups]
    train(model, optimizer, range(save_at, STEPS))
    return {"weights": full_weights(model), "lrs": lrs}


def holds_offloaded_full_dicts(replicas: int = 1, tp: int = 1) -> tuple[bool, bool]:
    """Whether this rank got the full model and optimizer dicts of ``cpu_offload=True``."""
    model, optimizer = build(replicas, tp=tp)
    train(model, optimizer, range(1))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer, options=FULL_ON_FIRST_RANK)
    return bool(model_sd), bool(optim_sd)


def state_dict_shapes(replicas: int = 1, tp: int = 1) -> dict:
    """Keys and shapes of the full model state dict, and what plain paths do on this model."""
    model, optimizer = build(replicas, tp=tp)
    train(model, optimizer, range(2))
    full = full_weights(model)
    _, optim_full = dckpt.get_state_dict(model, optimizer, options=FULL_ON_FIRST_RANK)
    sharded, optim_sharded = dckpt.get_state_dict(model, optimizer)
    result = {
        "full": {key: tuple(value.shape) for key, value in full.items()},
        "full_dtypes": {str(value.dtype) for value in full.values()},
        "optim_full_keys": {
            fqn: sorted(entries) for fqn, entries in optim_full.get("state", {}).items()
        },
        "optim_groups": [sorted(g["params"]) for g in optim_sharded["param_groups"]],
        "sharded_dedicated_keys": sorted(
            key for key in sharded if key in get_dedicated_state(model).params
        ),
        "owned": sorted(p.fqn for p in get_dedicated_state(model).iter_owned_masters()),
    }
    for name, attempt in {
        "torch_get_model_state_dict": lambda: _torch_get_model_state_dict(model),
        "torch_get_optimizer_state_dict": lambda: _torch_get_optimizer_state_dict(model, optimizer),
        "named_parameters_save": lambda: torch.save(dict(model.named_parameters()), "/dev/null"),
        "detach": lambda: {n: p.detach() for n, p in model.named_parameters()},
    }.items():
        try:
            attempt()
            result[name] = "no error"
        except Exception as error:  # the message is what the test checks
            result[name] = f"{type(error).__name__}: {error}"
    return result


def _torch_get_model_state_dict(model):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _torch_get_optimizer_state_dict(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def load_errors(path: str) -> dict[str, str]:
    """What loading ``path`` says for targets with a mis-shaped, an extra and a missing key."""
    messages = {}
    for case, num_layers in {"mis-shaped": 3, "not-in-model": 2, "not-in-checkpoint": 4}.items():
        model, optimizer = build(model_kwargs={"num_layers": num_layers})
        model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
        if case == "mis-shaped":
            model_sd["layers.0.q_proj.weight"] = torch.zeros(3, 3)
        try:
            dckpt.load({"model": model_sd, "optim": optim_sd}, path)
            messages[case] = "no error"
        except ValueError as error:
            messages[case] = str(error)
    try:
        dckpt.load({"model": {}}, path + "-never-written")
        messages["incomplete"] = "no error"
    except FileNotFoundError as error:
        messages["incomplete"] = str(error)
    return messages


def groups_after_loading_other_groups(path: str, param_groups: list | None) -> dict:
    """Save with the default groups; load into an optimizer built with ``param_groups``, once
    from disk and once from the dict in memory: each group's hyperparameters both ways."""
    model, optimizer = build(replicas=0)
    train(model, optimizer, range(2))
    saved_model, saved_optim = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": saved_model, "optim": saved_optim}, path)
    loaded = {}
    for way in ("disk", "memory"):
        fresh, fresh_optimizer = build(replicas=0, param_groups=param_groups)
        model_sd, optim_sd = dckpt.get_state_dict(fresh, fresh_optimizer)
        if way == "disk":
            dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        else:
            model_sd, optim_sd = saved_model, saved_optim
        dckpt.set_state_dict(
            fresh, fresh_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
        )
        loaded[way] = [
            dict(group, params=len(group["params"])) for group in fresh_optimizer.param_groups
        ]
    return loaded


def frozen_for_a_while(path: str) -> dict:
    """``lm_head.weight`` (FSDP2's, on AdamW) trains at step 0, is frozen for steps 1-2 and
    trains again from step 4; saved at step 3, where it is frozen, and resumed from there."""

    def run(model, optimizer, steps: range) -> None:
        head = dict(model.named_parameters())["lm_head.weight"]
        for step in steps:
            head.requires_grad_(step not in (1, 2, 3))
            train(model, optimizer, range(step, step + 1))

    model, optimizer = build()
    run(model, optimizer, range(3))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    run(model, optimizer, range(3, 6))
    resumed, resumed_optimizer = build()
    dict(resumed.named_parameters())["lm_head.weight"].requires_grad_(False)  # as at step 3
    model_sd, optim_sd = dckpt.get_state_dict(resumed, resumed_optimizer)
    dckpt.load({"model": model_sd, "optim": optim_sd}, path)
    dckpt.set_state_dict(
        resumed, resumed_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    run(resumed, resumed_optimizer, range(3, 6))
    return {"resumed": full_weights(resumed), "uninterrupted": full_weights(model)}


def partial_load_keys() -> dict[str, list[str]]:
    """``set_model_state_dict(strict=False)`` of a plain model's ``layers.1.*`` values only:
    the incompatible keys this rank reports, and the keys the dict really lacks."""
    model, _ = build()
    torch.manual_seed(1)
    plain = TinyDecoder().state_dict()
    partial = {key: value for key, value in plain.items() if key.startswith("layers.1.")}
    result = dckpt.set_model_state_dict(model, partial, options=StateDictOptions(strict=False))
    return {
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
        "lacking": [key for key in plain if key not in partial],
    }


def route_change_warning(path: str) -> list[str]:
    """Load a checkpoint written with the projections on Muon into a model where
    ``layers.0.q_proj.weight`` is left to AdamW (and ``lm_head.weight`` is on Muon)."""
    moved = {"layers.0.q_proj.weight"}

    def predicate(name, param):
        return (proj_predicate(name, param) and name not in moved) or name == "lm_head.weight"

    model, optimizer = build(predicate=predicate)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return [str(w.message) for w in caught if "dmuon.checkpoint" in str(w.message)]


def save_then_die_in_the_next_save(path: str, dying_rank: int = 1) -> None:
    """Save a complete checkpoint after 2 steps; train a step; then ``dying_rank`` dies as the
    next save into the same path starts writing (the other ranks are left inside the save)."""
    import os

    from dmuon.checkpoint import _storage

    model, optimizer = build()
    train(model, optimizer, range(2))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    train(model, optimizer, range(2, 3))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    if dist.get_rank() == dying_rank:
        _storage.dcp.save = lambda *args, **kwargs: os._exit(1)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)


def load_in_one_process(path: str) -> dict[str, torch.Tensor]:
    """Weights of a fresh one-process model loaded from ``path`` (raises like ``load`` does)."""
    model, optimizer = build(replicas=0)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.load({"model": model_sd, "optim": optim_sd}, path)
    dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return full_weights(model)


def trained_in_one_process(steps: int) -> dict[str, torch.Tensor]:
    model, optimizer = build(replicas=0)
    train(model, optimizer, range(steps))
    return full_weights(model)


def load_model_only(path: str) -> dict[str, torch.Tensor]:
    """Weights of a fresh one-process model after loading only ``{"model": ...}`` from ``path``."""
    model, _ = build(replicas=0)
    model_sd = dckpt.get_model_state_dict(model)
    dckpt.load({"model": model_sd}, path)
    dckpt.set_model_state_dict(model, model_sd)
    return full_weights(model)


def older_checkpoint_without_a_group_option(path: str) -> dict:
    """Save with one group option removed (as a dmuon that predates it would), then load."""
    model, optimizer = build(replicas=0)
    train(model, optimizer, range(2))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    del optim_sd["param_groups"][0]["adjust_lr"]
    optim_sd["param_groups"][0]["retired_option"] = 1  # one it has and this dmuon does not
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    fresh, fresh_optimizer = build(replicas=0)
    model_sd, optim_sd = dckpt.get_state_dict(fresh, fresh_optimizer)
    dckpt.load({"model": model_sd, "optim": optim_sd}, path)
    dckpt.set_state_dict(
        fresh, fresh_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    return {
        "group": dict(fresh_optimizer.param_groups[0], params=None),
        "weights": full_weights(fresh),
        "expected": full_weights(model),
    }


def flattened_round_trip(path: str) -> dict:
    """Save a flattened optimizer state dict, resume from it in one process, finish training."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model, optimizer = build(replicas=0)
    train(model, optimizer, range(3))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer, options=flat)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    train(model, optimizer, range(3, 6))
    resumed, resumed_optimizer = build(replicas=0)
    model_sd, optim_sd = dckpt.get_state_dict(resumed, resumed_optimizer, options=flat)
    dckpt.load({"model": model_sd, "optim": optim_sd}, path)
    dckpt.set_state_dict(
        resumed,
        resumed_optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=flat,
    )
    train(resumed, resumed_optimizer, range(3, 6))
    return {
        "flat_keys": sorted(optim_sd)[:3],
        "weights": full_weights(resumed),
        "expected": full_weights(model),
    }
