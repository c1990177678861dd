"""``torch.distributed.checkpoint.async_save`` of ``dmuon.checkpoint.get_state_dict`` on every rank
of a gloo pool: training goes on while the checkpoint is written, and a resume from it continues
as the uninterrupted run.

Uses ``scenarios_checkpoint``'s model, data and step counts (``SAVE_AT``, ``STEPS``).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dmuon.checkpoint as dckpt
from tests.distributed.scenarios_checkpoint import SAVE_AT, STEPS, build, full_weights, train


def async_save_midway_and_finish(path: str, replicas: int = 1, own_group: bool = True) -> dict:
    """Train ``SAVE_AT`` steps, ``dcp.async_save`` the state (on a gloo group of its own if
    ``own_group``), train to ``STEPS`` while it is written, then wait for it: the uninterrupted
    run and its checkpoint."""
    model, optimizer = build(replicas)
    train(model, optimizer, range(SAVE_AT))
    # Its own group: the save's collectives run on a background thread, beside the training's.
    checkpoint_group = dist.new_group(backend="gloo") if own_group else None
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    future = dcp.async_save(
        {"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=checkpoint_group
    )
    train(model, optimizer, range(SAVE_AT, STEPS))
    future.result()
    return {"weights": full_weights(model)}


def resume_with_dcp_load_and_finish(path: str, replicas: int = 1) -> dict:
    """A fresh model and optimizer, loaded from ``path`` with ``dcp.load``, trained to ``STEPS``."""
    model, optimizer = build(replicas)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(model, optimizer, range(SAVE_AT, STEPS))
    return {"weights": full_weights(model)}
