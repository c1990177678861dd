"""What ``model.state_dict()`` and ``model.load_state_dict()`` hold for dedicated parameters.

Owns the module hooks that stand in for the 0-element placeholders (see [Note: placeholder and
unsharded parameter] in ``param``) when torch saves or loads a module, and what a dedicated
parameter's entry is on each rank. It must not issue collectives: ``dmuon.checkpoint`` reads
full state dicts through these hooks with an entry maker of its own
(``DedicatedState.reading_checkpoint``), which gathers.

[Note: a dedicated parameter's state-dict entry]
As FSDP2's, a dmuon model's state dict is sharded: each rank holds its part, and
``torch.distributed.checkpoint`` (DCP) writes and reads each part where it lives.

- On the owner, the entry is its fp32 master, the tensor itself (a detached alias), so that a
  DCP load writes into it; under tensor parallelism, the DTensor of the owner's TP chunks (each
  TP rank's local tensor its master); for an expert stack, a value of the stack's shape holding
  the pieces this rank owns (see [Note: sharded stacks]).
- Elsewhere there is no entry: the key is absent, as it is for a key another rank writes.

No entry is ever the 0-element placeholder. DCP writes each matrix once, from its owner, and
reads a checkpoint of any layout (a stock FSDP2 run's shards included) into it. In one process
the entries are the full fp32 values.

The entry is in place *before* the module saves its tensors: the state-dict pre-hook puts it in
the module's parameter slot (None where there is no entry: torch skips a None parameter) and
the post-hook puts back what was there. So every state-dict post-hook of the module and of its
ancestors (a fused QKV projection splitting ``wqkv.weight`` into ``wq`` / ``wk`` / ``wv``, the
activation-checkpoint wrapper dropping its segment from the keys) sees a real tensor, or no
key, exactly as under FSDP2. ``dmuon.checkpoint`` reads through the same hooks; its full state
dicts gather each value from its owner inside its entry maker, a collective every rank reaches
in the same module order.

A caller that needs full values from a plain ``state_dict()`` on a distributed model —
``torch.distributed.checkpoint.state_dict.get_model_state_dict(..., full_state_dict=True)``,
which would keep whichever entries a rank happens to hold — gets an error naming
``dmuon.checkpoint``.

[Note: loading into a dedicated parameter]
``model.load_state_dict``'s pre-hook on the module that holds a dedicated parameter takes its
key after the hooks registered before it (a fused projection's merge of ``wq`` / ``wk`` / ``wv``
runs first: it is its parent's, or was registered when the module was built):

- the owner copies the value into its master (its TP chunk, its pieces' experts): a full
  tensor, a replicated DTensor, or the entry ``state_dict()`` gave, which a DCP load has already
  filled in place;
- elsewhere the value is not needed, and a key absent there is not missing (a sharded dict is
  per rank); the owner reports its missing key as torch does;
- the key then holds the placeholder, so that torch itself loads nothing.

The copies that serve forward (the owner's segment, the HSDP replicas') follow at the next
forward. A hook cannot publish them: the replicas' copies need a collective, and a collective
issued from a hook is only safe if every rank reaches it, which nothing guarantees of one
module's hook (its key may be on some ranks only). So loading marks the masters as changed on
every rank that runs ``load_state_dict`` (whatever its dict holds), and the first boundary's
pre-forward refreshes the segments from the masters and publishes them across replicas
(``DedicatedState.publish_loaded_masters``): every rank runs forward. ``dmuon.checkpoint``
(collective anyway) publishes before it returns. Hence every rank must call
``load_state_dict`` (as DCP-based trainers do, after loading in place: a DCP load alone updates
the masters, not the copies that serve forward).

[Note: sharded stacks]
The pieces of an expert stack are contiguous expert ranges placed by the partition, not the
even chunks of a ``Shard(0)`` placement, so a plain DTensor cannot describe them, and
``ShardedTensor`` is deprecated (every torch function on it warns). A sharded stack is a
``DTensor`` over the ownership grid's ranks whose local tensor is torch's ``LocalShardsWrapper``
(the checkpoint protocol's holder of arbitrary local chunks): DCP takes its chunks, offsets
included, from the wrapper, writes and reads them in place, and sees the DTensor's global shape.
Nothing but DCP and ``piece_value`` should compute with it. torch's wrapper takes the identity
view that ``DTensor.from_local`` makes only for 1-D and 2-D chunks when a rank holds several, so
stacks use ``_torch_internals.ExpertShards``, which takes it for (e, m, n) chunks too.

What trainers do with a state dict besides DCP works on the entry as on any tensor entry
(``_torch_internals.ExpertShards`` and ``ExpertStackEntry`` say how): its storage's
``data_ptr`` (torchtitan's ``ModelWrapper`` caches the state dict and compares storages each
save; two entries over the same masters share it), ``copy_`` from an entry of the same layout
(the cache's refresh), ``.to(dtype)`` (the final export) and ``full_tensor()``, which gathers
the stack over the entry's mesh (every rank of the ownership grid: the partition gives each
rank a slice of a stack it splits, ``min(E, S)`` slices, when the balance allows; a rank
without one has no entry to call it on, and ``dmuon.checkpoint``'s full state dict is the
collective that needs none).
"""

from __future__ import annotations

import functools
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from dmuon._torch_internals import expert_stack_entry, local_shards
from dmuon.experts import ExpertStack
from dmuon.param import DedicatedParam

if TYPE_CHECKING:
    from dmuon.hooks import DedicatedState

Dedicated = DedicatedParam | ExpertStack
EntryMaker = Callable[[Dedicated], "torch.Tensor | None"]
# What dmuon's load_state_dict pre-hooks read of torch's eight arguments:
# (module, state_dict, prefix, error_msgs).
LoadPreHook = Callable[[nn.Module, dict, str, list[str]], None]

FULL_VALUES_NEED_CHECKPOINT = (
    "{caller} asks model.state_dict() for full values, but dmuon keeps the full value of the "
    "dedicated parameter {fqn} on its owner rank ({owner}) only (in tensor-parallel chunks "
    "under TP): a plain state_dict is sharded, each rank holding the entries it owns, so a full "
    "state dict built from it would miss the others. Use dmuon.checkpoint.get_model_state_dict("
    "model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) (collective; one "
    "full dict on the first rank), or dmuon.checkpoint.get_model_state_dict(model) for the "
    "sharded dict that torch.distributed.checkpoint.save writes."
)

_TORCH_STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"


@dataclass(eq=False, slots=True)
class _HeldParams:
    """The dedicated parameters (and stacks) one module holds, and its slots while it saves."""

    params: list[Dedicated]
    saved_slots: list[tuple[str, object]] = field(default_factory=list)


def register_state_dict_hooks(state: DedicatedState) -> list[torch.utils.hooks.RemovableHandle]:
    by_module: dict[nn.Module, list[Dedicated]] = defaultdict(list)
    for p in state.params.values():
        if p.stack is None:
            by_module[p.module].append(p)
    for stack in state.stacks.values():  # one entry for all of a stack's expert pieces
        by_module[stack.module].append(stack)
    handles = []
    for module, params in by_module.items():
        held = _HeldParams(params)
        handles += [
            module.register_state_dict_pre_hook(
                functools.partial(_state_dict_pre_hook, state, held)
            ),
            module.register_state_dict_post_hook(functools.partial(_state_dict_post_hook, held)),
            register_load_pre_hook(
                module, functools.partial(_load_state_dict_pre_hook, state, held)
            ),
        ]
    return handles


# ---- saving -----------------------------------------------------------------------------------


def _state_dict_pre_hook(
    state: DedicatedState, held: _HeldParams, module: nn.Module, prefix: str, keep_vars: bool
) -> None:
    if not state.is_adopted:  # the original parameters are still registered
        return
    _restore_slots(module, held)  # a previous state_dict() that raised midway
    make_entry = state.checkpoint_reading or functools.partial(_plain_entry, state, prefix)
    held.saved_slots = [(p.attr, module._parameters[p.attr]) for p in held.params]
    try:
        for p in held.params:
            module._parameters[p.attr] = make_entry(p)
    except BaseException:
        _restore_slots(module, held)
        raise


def _state_dict_post_hook(
    held: _HeldParams, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict
) -> None:
    _restore_slots(module, held)


def _restore_slots(module: nn.Module, held: _HeldParams) -> None:
    for attr, value in held.saved_slots:
        module._parameters[attr] = value
    held.saved_slots = []


def _plain_entry(state: DedicatedState, prefix: str, p: Dedicated) -> torch.Tensor | None:
    if state.mesh.num_slots > 1 or getattr(p, "is_tp_sharded", False):
        caller = _full_values_caller()
        if caller is not None:
            owner = p.pieces[0].owner if isinstance(p, ExpertStack) else p.owner
            raise RuntimeError(
                FULL_VALUES_NEED_CHECKPOINT.format(
                    caller=caller, fqn=prefix + p.attr, owner=state.mesh.global_rank(owner)
                )
            )
    return local_entry(state, p)


def _full_values_caller() -> str | None:
    """The torch function that reads ``state_dict()`` for full values, if one is on the stack:
    ``get_model_state_dict(..., full_state_dict=True)`` of
    ``torch.distributed.checkpoint.state_dict``, whose ``_get_model_state_dict(model, info)``
    calls ``model.state_dict()`` and gathers what it returns."""
    frame = sys._getframe(2)
    while frame is not None:
        if (
            frame.f_code.co_name == "_get_model_state_dict"
            and frame.f_globals.get("__name__") == _TORCH_STATE_DICT_MODULE
        ):
            info = frame.f_locals.get("info")
            if getattr(info, "full_state_dict", False):
                return f"{_TORCH_STATE_DICT_MODULE}.get_model_state_dict(full_state_dict=True)"
            return None
        frame = frame.f_back
    return None


def local_entry(state: DedicatedState, p: Dedicated) -> torch.Tensor | None:
    """This rank's entry for ``p`` (see [Note: a dedicated parameter's state-dict entry]);
    None where it has none."""
    if isinstance(p, ExpertStack):
        owned = {piece: piece.master.detach() for piece in p.owned_pieces()}
        return stack_entry(p, owned, state.mesh.world_group)
    if p.master is None:
        return None
    master = p.master_value().detach()  # an offloaded master's CPU home (``dmuon.offload``)
    return p.tp.as_dtensor(master) if p.is_tp_sharded else master


def stack_entry(
    stack: ExpertStack, owned: dict[DedicatedParam, torch.Tensor], group: dist.ProcessGroup | None
) -> torch.Tensor | None:
    """The (E, ...) value holding ``owned`` (piece -> its tensor, this rank's pieces); see
    [Note: sharded stacks]. None where this rank owns no piece."""
    if not owned:
        return None
    if len(owned) == len(stack.every_piece):  # every piece is here: the plain value
        tensors = [owned[piece] for piece in stack.pieces]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    pieces = sorted(owned, key=lambda piece: piece.experts[0])
    tensors = [owned[piece] for piece in pieces]
    trailing = (0,) * (tensors[0].ndim - 1)
    offsets = [(piece.experts[0], *trailing) for piece in pieces]
    mesh = DeviceMesh.from_group(group, tensors[0].device.type)
    shape = torch.Size([stack.num_experts, *tensors[0].shape[1:]])
    return expert_stack_entry(tensors, offsets, mesh, shape)


def piece_value(piece: DedicatedParam, value: torch.Tensor) -> torch.Tensor:
    """Experts ``[start, stop)`` of a stack's value: a slice of a full tensor, or this rank's
    shard of a sharded value built on this layout."""
    start, stop = piece.experts
    local = local_shards(value)
    if local is None:
        if isinstance(value, DTensor):
            value = value.to_local()  # replicated: the whole stack
        return value[start:stop]
    for shard, offsets in zip(local.local_shards(), local.local_offsets()):
        if offsets[0] == start and len(shard) == stop - start:
            return shard
    raise ValueError(
        f"dmuon.checkpoint: the sharded value given for {piece.stack.fqn} holds no shard of "
        f"experts [{start}, {stop}) on this rank; load sharded checkpoints into the state dict "
        "dmuon.checkpoint.get_state_dict returns on this layout, or pass a full tensor."
    )


# ---- loading ----------------------------------------------------------------------------------


def register_load_pre_hook(
    module: nn.Module, hook: LoadPreHook
) -> torch.utils.hooks.RemovableHandle:
    """Register ``hook(module, state_dict, prefix, error_msgs)`` as a ``load_state_dict``
    pre-hook of ``module`` (torch passes eight arguments; the other four are unused here)."""

    def torch_hook(
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        hook(module, state_dict, prefix, error_msgs)

    return module.register_load_state_dict_pre_hook(torch_hook)


def _load_state_dict_pre_hook(
    state: DedicatedState,
    held: _HeldParams,
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    error_msgs: list[str],
) -> None:
    if not state.is_adopted or state.checkpoint_loading:
        return
    state.note_masters_loaded()  # on every rank alike, whatever its dict holds
    for p in held.params:
        key = prefix + p.attr
        if key not in state_dict:
            if not owns_part(p):  # not this rank's entry, so not missing here
                state_dict[key] = p.placeholder
            continue  # the owner: torch reports the missing key
        value = state_dict[key]
        # The placeholder then "loads" a 0-element tensor (or, with assign=True, itself).
        state_dict[key] = p.placeholder
        error = value_error(key, p, value)
        if error is None and owns_part(p):
            try:
                _load_into_masters(p, value)
            except ValueError as failure:  # a sharded stack value of another layout
                error = str(failure)
        if error is not None:
            error_msgs.append(error)


def owns_part(p: Dedicated) -> bool:
    """Whether this rank holds part of ``p``'s value: its master, or pieces of the stack."""
    if isinstance(p, ExpertStack):
        return bool(p.owned_pieces())
    return p.master is not None


def value_error(key: str, p: Dedicated, value: object) -> str | None:
    """Why ``value`` cannot be loaded into ``p`` by ``load_state_dict`` on this rank, or None."""
    if not isinstance(value, torch.Tensor):
        return (
            f"{key} is a dedicated parameter and needs a tensor of shape {tuple(p.shape)}, got "
            f"{type(value).__name__}."
        )
    if tuple(value.shape) != tuple(p.shape):
        return (
            f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
            f"checkpoint, the shape in current model is {tuple(p.shape)}."
        )
    if not isinstance(value, DTensor) or _is_replicated(value):
        return None
    if isinstance(p, ExpertStack):
        fits = local_shards(value) is not None
    else:  # this rank's TP chunk, as ``state_dict()`` gave it
        fits = p.tp is not None and value.device_mesh == p.tp.mesh
        fits = fits and tuple(value.placements) == (p.tp.placement,)
    if fits:
        return None
    return (
        f"{key} is a dedicated parameter and takes a full tensor, or the entry model.state_dict() "
        f"gave on this layout; got a DTensor with placements {tuple(value.placements)} on mesh "
        f"{value.device_mesh}. Load other layouts with "
        "dmuon.checkpoint.set_model_state_dict(model, state_dict) (collective)."
    )


def _is_replicated(value: DTensor) -> bool:
    return all(isinstance(placement, Replicate) for placement in value.placements)


def _load_into_masters(p: Dedicated, value: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(p, ExpertStack):
            for piece in p.owned_pieces():
                _copy(piece.master_value(), piece_value(piece, value))
            return
        _copy(p.master_value(), _local_part(p, value))


def _local_part(p: DedicatedParam, value: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``value`` (checked by ``value_error``): the chunk a TP DTensor holds
    here, or this rank's chunk of a full value."""
    if isinstance(value, DTensor):
        if not _is_replicated(value):
            return value.to_local()
        value = value.to_local()
    return p.tp.local_part(value) if p.is_tp_sharded else value


def _copy(master: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` into ``master``, unless it is ``master`` (a DCP load wrote it there)."""
    if value.data_ptr() == master.data_ptr() and value.shape == master.shape:
        return
    master.copy_(value)
