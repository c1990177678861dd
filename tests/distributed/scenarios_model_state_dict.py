"""A plain ``model.state_dict()`` / ``model.load_state_dict()`` on a distributed dmuon model, as a
DCP-based trainer uses them.

The trainer's pattern (torchtitan's ``ModelWrapper``, Lightning, accelerate): take
``model.state_dict()``, ``torch.distributed.checkpoint.save`` it; to resume, ``dcp.load`` into a
fresh model's ``model.state_dict()`` and hand the result to ``model.load_state_dict``. The
optimizer goes through ``dmuon.checkpoint`` (a DCP dict as well). Models, data and layouts are
those of ``scenarios_checkpoint``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dmuon.checkpoint as dckpt
from dmuon.hooks import get_dedicated_state
from tests.distributed.models import TinyDecoder, loss_fn
from tests.distributed.scenarios_checkpoint import SAVE_AT, STEPS, build, full_weights, train

FULL_EVERYWHERE = StateDictOptions(full_state_dict=True)


def entries(replicas: int = 1, tp: int = 1) -> dict:
    """What ``model.state_dict()`` holds on this rank after two steps, for each key."""
    model, optimizer = build(replicas, tp=tp)
    train(model, optimizer, range(2))
    state = get_dedicated_state(model)
    masters = {p.fqn: p.master for p in state.iter_owned_masters()}
    found = {}
    for key, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        found[key] = {
            "shape": tuple(value.shape),
            "numel": value.numel(),
            "dtensor": isinstance(value, DTensor),
            "is_master": key in masters and local.data_ptr() == masters[key].data_ptr(),
        }
    return {
        "entries": found,
        "owned": sorted(masters),
        "dedicated": sorted(state.params),
    }


def save_midway_and_finish(
    path: str, replicas: int = 1, tp: int = 1, save_at: int = SAVE_AT, via: str = "plain"
) -> dict:
    """``dcp.save`` of the model state dict (``via``: ``model.state_dict()``, or torch's
    ``get_model_state_dict``) and dmuon's optimizer state dict at ``save_at``; the uninterrupted
    run's weights at ``STEPS``."""
    model, optimizer = build(replicas, tp=tp)
    train(model, optimizer, range(save_at))
    model_sd = model.state_dict() if via == "plain" else get_model_state_dict(model)
    optim_sd = dckpt.get_optimizer_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    train(model, optimizer, range(save_at, STEPS))
    return {"weights": full_weights(model)}


def resume_and_finish(
    path: str, replicas: int = 1, tp: int = 1, save_at: int = SAVE_AT, via: str = "plain"
) -> dict:
    """A fresh model resumed the trainer's way (``dcp.load`` into its ``state_dict()``, then
    ``load_state_dict(strict=False)``; or torch's ``get_model_state_dict`` and
    ``set_model_state_dict``, strict), trained to ``STEPS``."""
    model, optimizer = build(replicas, tp=tp)
    model_sd = dict(model.state_dict()) if via == "plain" else get_model_state_dict(model)
    loaded = {"model": model_sd, "optim": dckpt.get_optimizer_state_dict(model, optimizer)}
    dcp.load(loaded, checkpoint_id=path)
    if via == "plain":
        model.load_state_dict(loaded["model"], strict=False)
    else:
        set_model_state_dict(model, loaded["model"])
    dckpt.set_optimizer_state_dict(model, optimizer, loaded["optim"])
    train(model, optimizer, range(save_at, STEPS))
    return {"weights": full_weights(model)}


# ---- dmuon and stock FSDP2 ------------------------------------------------------------------------


def stock_model() -> TinyDecoder:
    """The tiny decoder on stock FSDP2 (no dmuon) over every rank."""
    torch.manual_seed(0)
    model = TinyDecoder()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_stock_weights(model) -> dict[str, torch.Tensor]:
    return {key: value.full_tensor() for key, value in model.state_dict().items()}


def dmuon_saves_stock_loads(path: str, replicas: int = 1, tp: int = 1) -> dict:
    """dmuon trained 3 steps ``dcp.save``s ``model.state_dict()``; stock FSDP2 loads it the
    trainer's way. Both models' full weights (first rank)."""
    model, optimizer = build(replicas, tp=tp)
    train(model, optimizer, range(3))
    dcp.save(model.state_dict(), checkpoint_id=path)
    stock = stock_model()
    loaded = dict(stock.state_dict())
    dcp.load(loaded, checkpoint_id=path)
    stock.load_state_dict(loaded)
    return {"weights": {"dmuon": full_weights(model), "stock": _full_stock_weights(stock)}}


def stock_saves_dmuon_loads(path: str, replicas: int = 1, tp: int = 1) -> dict:
    """Stock FSDP2 + AdamW trained 3 steps ``dcp.save``s ``model.state_dict()``; dmuon loads it
    the trainer's way, and its next forward serves the loaded weights on every rank (HSDP
    replicas included). Both models' full weights and logits."""
    stock = stock_model()
    adamw = torch.optim.AdamW(stock.parameters(), lr=1e-2)
    tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        loss_fn(stock, tokens).backward()
        adamw.step()
        adamw.zero_grad()
    dcp.save(stock.state_dict(), checkpoint_id=path)
    model, _ = build(replicas, tp=tp)
    loaded = dict(model.state_dict())
    dcp.load(loaded, checkpoint_id=path)
    model.load_state_dict(loaded)
    with torch.no_grad():
        logits = {"dmuon": model(tokens), "stock": stock(tokens)}
    weights = {"dmuon": full_weights(model), "stock": _full_stock_weights(stock)}
    return {"weights": weights, "logits": logits}


def full_values_load_on_every_rank(replicas: int = 1) -> dict:
    """``model.load_state_dict(strict=False)`` of new full values for the dedicated matrices on
    every rank (FSDP2's own parameters take no full tensors: they keep theirs); the logits the
    next forward gives, and those of a plain model with the same weights."""
    model, optimizer = build(replicas)
    train(model, optimizer, range(1))
    plain = TinyDecoder()
    plain.load_state_dict(dckpt.get_model_state_dict(model, options=FULL_EVERYWHERE))
    torch.manual_seed(7)
    dedicated = set(get_dedicated_state(model).params)
    new_values = {key: torch.randn_like(value) for key, value in plain.state_dict().items()
                  if key in dedicated}  # fmt: skip
    plain.load_state_dict(new_values, strict=False)
    model.load_state_dict(new_values, strict=False)
    tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return {"logits": {"dmuon": model(tokens), "plain": plain(tokens)}}


def strict_load_of_a_dict_without_one_key(replicas: int = 1) -> str:
    """``model.load_state_dict`` (strict) of this model's own state dict less ``layers.0.q_proj
    .weight``: the error on its owner, nothing elsewhere."""
    model, _ = build(replicas)
    state_dict = model.state_dict()
    state_dict.pop("layers.0.q_proj.weight", None)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as error:
        return str(error)
    finally:
        model(torch.zeros(1, 2, dtype=torch.long))  # every rank publishes the loaded masters
    return "no error"
