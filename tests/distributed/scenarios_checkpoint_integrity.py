"""Checkpoint integrity scenarios: load a checkpoint whose files were damaged after the save, and
record what each rank raised and whether anything it holds changed.

The checkpoints are ``tests.distributed.scenarios_checkpoint``'s (the tiny decoder saved after
``SAVE_AT`` steps); the tests damage a copy on disk between the save and the load. The functions
here run on every rank of a gloo pool.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import dmuon.checkpoint as dckpt
from tests.distributed.scenarios_checkpoint import (
    SAVE_AT,
    STEPS,
    build,
    full_weights,
    train,
)


def _held_values(model, optimizer) -> dict[str, object]:
    """Every value this rank holds of the model and its optimizer, copied: its local part of
    ``dmuon.checkpoint.get_state_dict`` (the owners' masters, FSDP2's shards, the state)."""
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    held: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}", inner)
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                walk(f"{prefix}.{index}", inner)
        elif isinstance(value, DTensor):
            held[prefix] = value.to_local().detach().clone()
        elif isinstance(value, torch.Tensor):
            held[prefix] = value.detach().clone()
        else:
            held[prefix] = value

    walk("model", model_sd)
    walk("optim", optim_sd)
    return held


def _changed(before: dict[str, object], after: dict[str, object]) -> list[str]:
    changed = sorted(set(before) ^ set(after))
    for key in before.keys() & after.keys():
        old, new = before[key], after[key]
        same = torch.equal(old, new) if isinstance(old, torch.Tensor) else old == new
        if not same:
            changed.append(key)
    return sorted(changed)


def load_into_a_trained_model(path: str) -> dict:
    """A model and optimizer trained one step (so every value differs from the checkpoint's)
    load ``path``: what was raised here, and which of the values this rank holds changed."""
    model, optimizer = build()
    train(model, optimizer, range(1))
    before = _held_values(model, optimizer)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    result = {"error": None, "type": None}
    try:
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    except Exception as error:  # the message is what the test checks
        result["error"], result["type"] = str(error), type(error).__name__
    result["changed"] = _changed(before, _held_values(model, optimizer))
    return result


def save_with_torch_midway_and_finish(path: str) -> dict:
    """``save_midway_and_finish``, but saved with stock ``torch.distributed.checkpoint.save``:
    a checkpoint without dmuon's checksums."""
    model, optimizer = build()
    train(model, optimizer, range(SAVE_AT))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    train(model, optimizer, range(SAVE_AT, STEPS))
    return {"weights": full_weights(model)}


def resume_recording_warnings(path: str) -> dict:
    """``resume_and_finish`` with ``dmuon.checkpoint``'s warnings recorded instead of raised."""
    model, optimizer = build()
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(model, optimizer, range(SAVE_AT, STEPS))
    return {
        "weights": full_weights(model),
        "warnings": [str(w.message) for w in caught if "dmuon.checkpoint" in str(w.message)],
    }
