"""The model half of ``dmuon.checkpoint``: a dmuon model's weights as a state dict, and back.

Keys are canonical FQNs (``dmuon.fqn``): those of ``model.state_dict()`` on the plain model,
with no wrapper segment (``_checkpoint_wrapped_module``, ``_orig_mod``), so a checkpoint moves
between runs with activation checkpointing or ``torch.compile`` on and off, and to and from a
stock (non-dmuon) model's ``torch.distributed.checkpoint.state_dict``. The dict is read through
``model.state_dict()`` and written through ``model.load_state_dict()``, so other modules'
state-dict hooks (a fused projection split into ``wq`` / ``wk`` / ``wv`` keys, say) apply as
they do on a stock model. Values by mode:

- sharded (default): a dedicated matrix appears on its owner rank only, as its fp32 master (the
  tensor itself, so ``torch.distributed.checkpoint.load`` writes into it; see [Note: a dedicated
  parameter's state-dict entry] in ``dmuon.module_state``); FSDP2's parameters are their
  DTensors; everything else is the plain tensor every rank holds.
- ``full_state_dict=True``: every value is the full tensor in the parameter's own dtype, on
  every rank, or with ``cpu_offload=True`` on the CPU of the receiving rank only (the lowest
  rank of the ownership grid; rank 0 for a mesh over all ranks), the others getting ``{}``.
  Each is a tensor of its own, never a master or parameter that later steps change (see [Note:
  a full state dict is a snapshot] in ``_context``).

Loading takes either, and with ``broadcast_from_rank0=True`` a full dict that only that first
rank holds (``_from_source`` moves its values; the checks stay here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon._torch_internals import EXTRA_STATE_KEY_SUFFIX, IncompatibleKeys, local_shards
from dmuon.checkpoint._context import CheckpointContext, checkpoint_context
from dmuon.checkpoint._experts import load_stack_values, stack_model_entry, stack_value_error
from dmuon.checkpoint._from_source import Entry, Plan, Transfer, ValueInfo
from dmuon.experts import ExpertStack
from dmuon.fqn import canonical_fqn, state_dict_key
from dmuon.module_state import owns_part, register_load_pre_hook
from dmuon.param import DedicatedParam


def get_model_state_dict(
    model: nn.Module, *, options: StateDictOptions | None = None
) -> dict[str, object]:
    """The model's state dict; see the module docstring for what each mode holds.

    Collective: every rank of the ownership grid calls it, in the same order as the other
    ``dmuon.checkpoint`` calls.
    """
    ctx = checkpoint_context(model, options)
    with ctx.state.reading_checkpoint(lambda p: _dedicated_entry(ctx, p)):
        raw = model.state_dict()
    frozen = _frozen_names(model) if ctx.options.ignore_frozen_params else set()
    result: dict[str, object] = {}
    for key, value in raw.items():
        fqn = canonical_fqn(key)
        if fqn in frozen:
            continue
        value = _entry(ctx, value)
        if value is not None:
            result[fqn] = value
    return result if not ctx.full or ctx.keeps_full else {}


def _dedicated_entry(ctx: CheckpointContext, p: DedicatedParam | ExpertStack) -> object | None:
    """What ``model.state_dict()`` holds for ``p`` on this rank in this mode (None: no key).
    Full values are gathered from the owner here, in module order on every rank."""
    if isinstance(p, ExpertStack):
        return stack_model_entry(ctx, p)  # one (E, m, n) entry, see ``_experts``
    owned = _owned_value(p)
    if not ctx.full:
        return owned  # the master itself, for DCP to load into
    if isinstance(owned, DTensor):  # converted before the TP ranks gather it
        owned = owned.to(p.placeholder.dtype).full_tensor()
    return ctx.full_from_owner(ctx.owner_rank(p), owned, tuple(p.shape), p.placeholder.dtype)


def _entry(ctx: CheckpointContext, value: object) -> object | None:
    """A value of ``model.state_dict()`` (after every module's hooks) as this mode holds it."""
    if local_shards(value) is not None:
        return value  # a sharded expert stack, offloaded as it was built
    if isinstance(value, DTensor):
        # In a full state dict every DTensor left is FSDP2's (or a value hooks made of one), on
        # every rank: the gathers pair up. Dedicated values were gathered by the entry maker.
        return ctx.full_from_shards(value) if ctx.full else ctx.offloaded(value)
    if ctx.full:
        return ctx.full_value(value) if ctx.keeps_full else None
    return ctx.offloaded(value)


def _owned_value(p: DedicatedParam) -> torch.Tensor | None:
    """The owner's master (a DTensor of its TP chunks under tensor parallelism: the TP ranks of
    the owner write one chunk each); None where this rank owns no part of it."""
    if p.master is None:
        return None
    master = p.master_value().detach()  # an offloaded master's CPU home (``dmuon.offload``)
    return p.tp.as_dtensor(master) if p.is_tp_sharded else master


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, object],
    *,
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load ``model_state_dict`` (sharded or full) into every copy of the weights.

    The dict goes through ``model.load_state_dict``, so other modules' load hooks (a fused
    projection merging ``wq`` / ``wk`` / ``wv``) apply first; every value they leave is then
    checked before any weight changes. Dedicated values go into the owners' fp32 masters, then to
    every copy that serves forward (local segments, HSDP replicas) before this returns; FSDP2's
    parameters take their local shards. Collective. With ``strict`` (the default) missing,
    unexpected or mis-shaped keys raise on every rank, naming them, before any weight changes.

    ``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)``: only the first rank of
    the ownership grid (rank 0 for a mesh over every rank) holds the full dict, the others pass
    ``{}``; each owner receives only its matrices (see [Note: each owner receives only its
    matrices] in ``dmuon.checkpoint._from_source``). The model may come from the meta device
    (``to_empty`` after ``dedicate_params`` and ``fully_shard``, then this load).
    """
    ctx = checkpoint_context(model, options, loading=True)
    from_source = ctx.options.broadcast_from_rank0
    if from_source and ctx.rank != ctx.receiver:
        model_state_dict = {}  # torch's convention: only the source's dict is read
    found, incompatible = _take_values(ctx, model, model_state_dict)
    if from_source:
        return _load_from_source(ctx, model, found, incompatible)

    frozen = _frozen_names(model) if ctx.options.ignore_frozen_params else set()
    masters: list[tuple[DedicatedParam, torch.Tensor]] = []
    stacks: list[tuple[ExpertStack, torch.Tensor]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    missing, errors = [], []
    for key, target, value in found.values:
        p = found.dedicated.get(id(target))
        if value is None:
            # Only a dedicated value's owner looks for it (a sharded dict is per rank).
            if key not in frozen and (p is None or owns_part(p)):
                missing.append(key)
        elif isinstance(p, ExpertStack):
            if (error := stack_value_error(key, p, value)) is not None:
                errors.append(error)
            elif p.owned_pieces():
                stacks.append((p, value))
        elif p is not None:
            if _global_shape(value) != tuple(p.shape):
                errors.append(_shape_error(key, value, p.shape))
            elif p.master is not None:
                masters.append((p, value))
        elif _global_shape(value) != _global_shape(target):
            errors.append(_shape_error(key, value, _global_shape(target)))
        else:
            copies.append((target, _shard_like(target, value)))
    missing += [key for key, value in found.extra_states if value is None]
    unexpected = list(dict.fromkeys(canonical_fqn(key) for key in incompatible.unexpected_keys))
    # Every rank reports what any rank missed, in the model's order.
    missed_anywhere = {key for found_here in ctx.all_gather(missing) for key in found_here}
    missing_everywhere = [key for key in found.order if key in missed_anywhere]
    if ctx.options.strict:
        errors += [f"missing key {key}" for key in missing]
        errors += [f"unexpected key {key}" for key in unexpected]
    ctx.raise_if_any_rank_failed(errors, "the model state dict does not fit the model")

    with torch.no_grad():
        for p, value in masters:
            p.master_value().copy_(p.local_value(value))
        load_stack_values(stacks)
        for target, value in copies:
            target.copy_(value)
    for key, value in found.extra_states:
        if value is not None:
            found.extra_state_modules[key].set_extra_state(value)
    ctx.state.publish_masters()
    return IncompatibleKeys(missing_everywhere, unexpected)


def _take_values(
    ctx: CheckpointContext, model: nn.Module, model_state_dict: dict[str, object]
) -> tuple[_Found, IncompatibleKeys]:
    """Run ``model.load_state_dict`` with every module's hooks, taking each value it would load
    instead of loading it (see ``_Found``)."""
    found = _Found(dedicated=_dedicated_by_placeholder(ctx))
    keyed = {state_dict_key(model, key): value for key, value in model_state_dict.items()}
    handles = [
        register_load_pre_hook(module, found.take_values)
        for module in model.modules()
        if module._parameters or module._buffers or _has_extra_state(module)
    ]
    try:
        with ctx.state.loading_checkpoint_elsewhere():
            incompatible = model.load_state_dict(keyed, strict=False)
    finally:
        for handle in handles:
            handle.remove()
    return found, incompatible


def _load_from_source(
    ctx: CheckpointContext, model: nn.Module, found: _Found, incompatible: IncompatibleKeys
) -> IncompatibleKeys:
    """``broadcast_from_rank0=True``: the source checks its full dict and sends each value to
    the ranks that keep it (see [Note: each owner receives only its matrices] in
    ``_from_source``)."""
    transfer = Transfer(ctx)
    plan = transfer.share_plan(
        _source_plan(ctx, model, found, incompatible) if ctx.rank == ctx.receiver else None
    )
    if plan.errors:
        lines = [f"rank {ctx.receiver}: {error}" for error in plan.errors]
        shown = "\n  ".join(lines[:20])
        more = f"\n  ... {len(lines) - 20} more" if len(lines) > 20 else ""
        raise ValueError(
            f"dmuon.checkpoint: the model state dict does not fit the model:\n  {shown}{more}"
        )
    entries = [
        Entry(key=key, target=target, dedicated=found.dedicated.get(id(target)), value=value)
        for key, target, value in found.values
    ]
    transfer.load(entries, plan)
    for (key, _), value in zip(found.extra_states, plan.extra_states, strict=True):
        if value is not None:
            found.extra_state_modules[key].set_extra_state(value)
    ctx.state.publish_masters()
    return IncompatibleKeys(plan.missing, plan.unexpected)


def _source_plan(
    ctx: CheckpointContext, model: nn.Module, found: _Found, incompatible: IncompatibleKeys
) -> Plan:
    """On the source: what every rank needs to receive the values, and what does not fit."""
    frozen = _frozen_names(model) if ctx.options.ignore_frozen_params else set()
    infos: list[ValueInfo | None] = []
    missing, errors = [], []
    for key, target, value in found.values:
        if value is None:
            if key not in frozen:
                missing.append(key)
            infos.append(None)
            continue
        p = found.dedicated.get(id(target))
        expected = tuple(p.shape) if p is not None else _global_shape(target)
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            errors.append(
                f"{key}: broadcast_from_rank0 loads full plain tensors from the source rank, "
                f"got a {type(value).__name__}; pass the dict of get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) or of "
                "torch.load / safetensors"
            )
        elif _global_shape(value) != expected:
            errors.append(_shape_error(key, value, expected))
        is_tensor = isinstance(value, torch.Tensor)
        infos.append(ValueInfo(tuple(value.shape), value.dtype) if is_tensor else None)
    missing += [key for key, value in found.extra_states if value is None]
    unexpected = list(dict.fromkeys(canonical_fqn(key) for key in incompatible.unexpected_keys))
    if ctx.options.strict:
        errors += [f"missing key {key}" for key in missing]
        errors += [f"unexpected key {key}" for key in unexpected]
    return Plan(
        values=infos,
        extra_states=[value for _, value in found.extra_states],
        errors=errors,
        missing=[key for key in found.order if key in set(missing)],
        unexpected=unexpected,
    )


@dataclass(slots=True)
class _Found:
    """Every value ``load_state_dict`` would load, by canonical key, taken from it instead (so
    that nothing changes before every value is checked)."""

    dedicated: dict[int, DedicatedParam | ExpertStack]  # id(placeholder) -> what it stands for
    values: list[tuple[str, torch.Tensor, object | None]] = field(default_factory=list)
    extra_states: list[tuple[str, object | None]] = field(default_factory=list)
    extra_state_modules: dict[str, nn.Module] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def take_values(
        self, module: nn.Module, state_dict: dict, prefix: str, error_msgs: list[str]
    ) -> None:
        """A load pre-hook, registered last on ``module``: after the module's own hooks, take
        the values of its parameters and persistent buffers out of ``state_dict``."""
        local = [*module._parameters.items()]
        local += [
            (name, buffer)
            for name, buffer in module._buffers.items()
            if name not in module._non_persistent_buffers_set
        ]
        for name, target in local:
            if target is None:
                continue
            key = canonical_fqn(prefix + name)
            self.order.append(key)
            self.values.append((key, target, state_dict.pop(prefix + name, None)))
        if _has_extra_state(module):
            key = canonical_fqn(prefix + EXTRA_STATE_KEY_SUFFIX)
            self.order.append(key)
            self.extra_states.append((key, state_dict.pop(prefix + EXTRA_STATE_KEY_SUFFIX, None)))
            self.extra_state_modules[key] = module


def _dedicated_by_placeholder(ctx: CheckpointContext) -> dict[int, DedicatedParam | ExpertStack]:
    dedicated: dict[int, DedicatedParam | ExpertStack] = {}
    for p in ctx.state.params.values():
        dedicated[id(p.placeholder)] = p.stack if p.stack is not None else p
    return dedicated


def _has_extra_state(module: nn.Module) -> bool:
    """Whether torch would load an ``_extra_state`` entry into ``module``."""
    return type(module).set_extra_state is not nn.Module.set_extra_state


def _frozen_names(model: nn.Module) -> set[str]:
    return {
        canonical_fqn(name) for name, param in model.named_parameters() if not param.requires_grad
    }


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
