"""The model half of ``dmuon.checkpoint``: a dmuon model's weights as a state dict, and back.

Keys are the model's own FQNs, exactly those of ``model.state_dict()`` on the un-wrapped model.
Values by mode:

- sharded (default): a dedicated matrix appears on its owner rank only, as its fp32 master (the
  tensor itself, so ``torch.distributed.checkpoint.load`` writes into it); FSDP2's parameters
  are their DTensors; everything else is the plain tensor every rank holds.
- ``full_state_dict=True``: every value is the full tensor in the parameter's own dtype, on
  every rank, or with ``cpu_offload=True`` on the CPU of the receiving rank only (the lowest
  rank of the ownership grid; rank 0 for a mesh over all ranks), the others getting ``{}``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import _IncompatibleKeys

from dmuon.checkpoint._context import CheckpointContext, checkpoint_context
from dmuon.checkpoint._experts import load_stack_values, stack_model_entry, stack_value_error
from dmuon.experts import ExpertStack
from dmuon.module_state import DedicatedEntry, dedicated_entries_applied, entries_as_markers
from dmuon.param import DedicatedParam


def get_model_state_dict(
    model: nn.Module, *, options: StateDictOptions | None = None
) -> dict[str, object]:
    """The model's state dict; see the module docstring for what each mode holds.

    Collective: every rank of the ownership grid calls it, in the same order as the other
    ``dmuon.checkpoint`` calls.
    """
    ctx = checkpoint_context(model, options)
    with entries_as_markers(ctx.state):
        raw = model.state_dict()
    frozen = _frozen_names(model) if ctx.options.ignore_frozen_params else set()
    result: dict[str, object] = {}
    for key, value in raw.items():
        if key in frozen:
            continue
        value = _entry(ctx, value)
        if value is not None:
            result[key] = value
    return result if not ctx.full or ctx.keeps_full else {}


def _entry(ctx: CheckpointContext, value: object) -> object | None:
    if isinstance(value, DedicatedEntry) and isinstance(value.param, ExpertStack):
        return stack_model_entry(ctx, value.param)  # one (E, m, n) entry, see ``_experts``
    if isinstance(value, DedicatedEntry):
        p = value.param
        owned = _owned_value(p)
        if ctx.full:
            if owned is not None:
                owned = owned.to(p.placeholder.dtype)
                owned = owned.full_tensor() if isinstance(owned, DTensor) else owned
            return ctx.full_from_owner(
                ctx.owner_rank(p), owned, tuple(p.shape), p.placeholder.dtype
            )
        return ctx.offloaded(owned) if owned is not None else None
    if isinstance(value, DTensor):
        return ctx.full_from_shards(value) if ctx.full else ctx.offloaded(value)
    if ctx.full and not ctx.keeps_full:
        return None
    return ctx.offloaded(value)


def _owned_value(p: DedicatedParam) -> torch.Tensor | None:
    """The owner's master (a DTensor of its TP chunks under tensor parallelism: the TP ranks of
    the owner write one chunk each); None where this rank owns no part of it."""
    if p.master is None:
        return None
    master = p.master.detach()
    return p.tp.as_dtensor(master) if p.is_tp_sharded else master


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, object],
    *,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load ``model_state_dict`` (sharded or full) into every copy of the weights.

    Dedicated values go into the owners' fp32 masters, then to every copy that serves forward
    (local segments, HSDP replicas) before this returns; FSDP2's parameters take their local
    shards. Collective. With ``strict`` (the default) missing, unexpected or mis-shaped keys raise
    on every rank, naming them, before any weight changes.
    """
    ctx = checkpoint_context(model, options)
    with entries_as_markers(ctx.state):
        current = model.state_dict()
    frozen = _frozen_names(model) if ctx.options.ignore_frozen_params else set()
    to_load: dict[str, object] = {}
    masters: list[tuple[DedicatedParam, torch.Tensor]] = []
    missing, unexpected, errors = [], [], []
    stacks: list[tuple[ExpertStack, torch.Tensor]] = []
    for key, target in current.items():
        value = model_state_dict.get(key)
        if isinstance(target, DedicatedEntry) and isinstance(target.param, ExpertStack):
            stack = target.param
            to_load[key] = stack.placeholder  # keeps load_state_dict's strict check quiet
            if not stack.owned_pieces():
                continue  # the owners of its pieces load it
            if value is None:
                if key not in frozen:
                    missing.append(key)
            elif (error := stack_value_error(key, stack, value)) is not None:
                errors.append(error)
            else:
                stacks.append((stack, value))
            continue
        if isinstance(target, DedicatedEntry):
            p = target.param
            to_load[key] = p.placeholder  # keeps load_state_dict's strict check quiet
            if p.master is None:
                continue  # the owner loads it
            if value is None:
                if key not in frozen:
                    missing.append(key)
                continue
            if _global_shape(value) != tuple(p.shape):
                errors.append(_shape_error(key, value, p.shape))
                continue
            masters.append((p, value))
        elif value is None:
            if key not in frozen:
                missing.append(key)
        elif _global_shape(value) != _global_shape(target):
            errors.append(_shape_error(key, value, _global_shape(target)))
        else:
            to_load[key] = _shard_like(target, value)
    unexpected = [key for key in model_state_dict if key not in current]
    # Only a dedicated value's owner looks for it: every rank reports what any rank missed.
    missed_anywhere = {key for found in ctx.all_gather(missing) for key in found}
    missing_everywhere = [key for key in current if key in missed_anywhere]
    if ctx.options.strict:
        errors += [f"missing key {key}" for key in missing]
        errors += [f"unexpected key {key}" for key in unexpected]
    ctx.raise_if_any_rank_failed(errors, "the model state dict does not fit the model")

    with torch.no_grad():
        for p, value in masters:
            p.master.copy_(p.local_value(value))
    load_stack_values(stacks)
    with dedicated_entries_applied(ctx.state):
        model.load_state_dict(to_load, strict=False)
    ctx.state.publish_masters()
    return _IncompatibleKeys(missing_everywhere, unexpected)


def _frozen_names(model: nn.Module) -> set[str]:
    return {name for name, param in model.named_parameters() if not param.requires_grad}


def _global_shape(value: object) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _shape_error(key: str, value: object, expected) -> str:
    return (
        f"size mismatch for {key}: the state dict has shape {_global_shape(value)}, the model "
        f"{tuple(expected)}"
    )


def _shard_like(target: object, value: object) -> object:
    """A full tensor given for a sharded parameter becomes this rank's shard of it."""
    if isinstance(target, DTensor) and not isinstance(value, DTensor):
        return distribute_tensor(
            value.to(target.device), target.device_mesh, target.placements, src_data_rank=None
        )
    return value
