"""Full state dicts as snapshots: take one, train a step, see whether its values moved.

A full state dict (``full_state_dict=True``, with or without ``cpu_offload``) is what a user
saves with ``torch.save`` or compares later; every value must be a tensor of its own, as torch's
FSDP2 path gives (its ``full_tensor()`` gathers into new storage), never the fp32 master, the
momentum buffer or a plain parameter the next step updates in place. Models and training are
those of ``scenarios_checkpoint``; the functions run on every rank of a gloo pool, or in one
process (``replicas=0``).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

import dmuon.checkpoint as dckpt
from tests.distributed.scenarios_checkpoint import build, train

OPTIONS = {
    "cpu_offload": StateDictOptions(full_state_dict=True, cpu_offload=True),
    "every_rank": StateDictOptions(full_state_dict=True),
}


def _tensors(state_dict: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, by its dotted path."""
    found = {}
    for key, value in state_dict.items():
        if isinstance(value, dict):
            found.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            found[f"{prefix}{key}"] = value
    return found


def snapshots_after_a_step(options: str, replicas: int = 1, tp: int = 1) -> dict:
    """Take the full model and optimizer state dicts after one step, keep a copy of each value,
    train one more step: the keys whose value changed under the dict (it moved with training)
    and the keys whose value a dict taken after the step holds differently (training did change
    them, so an alias would have shown)."""
    model, optimizer = build(replicas, tp=tp)
    train(model, optimizer, range(1))
    taken = {
        "model": dckpt.get_model_state_dict(model, options=OPTIONS[options]),
        "optim": dckpt.get_optimizer_state_dict(model, optimizer, options=OPTIONS[options]),
    }
    kept = {key: value.clone() for key, value in _tensors(taken).items()}
    train(model, optimizer, range(1, 2))
    after = _tensors(
        {
            "model": dckpt.get_model_state_dict(model, options=OPTIONS[options]),
            "optim": dckpt.get_optimizer_state_dict(model, optimizer, options=OPTIONS[options]),
        }
    )
    now = _tensors(taken)
    return {
        "keys": sorted(kept),
        "moved": sorted(key for key, value in kept.items() if not torch.equal(now[key], value)),
        "trained": sorted(key for key, value in kept.items() if not torch.equal(after[key], value)),
    }
