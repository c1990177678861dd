"""What ``model.state_dict()`` and ``model.load_state_dict()`` see for dedicated parameters.

Owns the two module hooks that stand in for the 0-element placeholders (see
[Note: placeholder and unsharded parameter] in ``param``), so that torch's own saving and loading
never goes through with an empty tensor:

- ``state_dict()``: where every dedicated value is on this rank (one process, or an ownership
  grid of one slot) the entry is the real value, the fp32 master cast to the parameter's dtype.
  Elsewhere the full value lives on one owner rank and a plain ``state_dict()`` cannot collect it
  without a collective, so it raises, naming ``dmuon.checkpoint``. While ``dmuon.checkpoint``
  reads the model, each entry is a ``DedicatedEntry`` marker it replaces.
- ``load_state_dict()``: a full tensor for a dedicated key is copied into the owner's master and
  into every local segment that holds it (no collective: every rank is given the full value);
  a wrong shape is reported like torch reports one. While ``dmuon.checkpoint`` loads, it has
  already applied the dedicated values and the entries are skipped.

It must not issue collectives.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon.experts import ExpertStack
from dmuon.param import DedicatedParam

if TYPE_CHECKING:
    from dmuon.hooks import DedicatedState

STATE_DICT_NEEDS_CHECKPOINT = (
    "model.state_dict() cannot return {fqn}: dmuon keeps that dedicated parameter's full value on "
    "its owner rank ({owner}) (in tensor-parallel chunks under TP) and this model spans {slots} "
    "owner slots, so a plain state_dict would hold a 0-element tensor or one chunk. Use "
    "dmuon.checkpoint.get_model_state_dict(model) (sharded, "
    "for torch.distributed.checkpoint.save) or dmuon.checkpoint.get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) for one full dict on the "
    "first rank."
)


@dataclass(frozen=True, slots=True)
class DedicatedEntry:
    """Stands for a dedicated parameter in a ``state_dict()`` taken by ``dmuon.checkpoint``."""

    param: DedicatedParam | ExpertStack


def register_state_dict_hooks(state: DedicatedState) -> list[torch.utils.hooks.RemovableHandle]:
    by_module: dict[nn.Module, list[DedicatedParam | ExpertStack]] = defaultdict(list)
    for p in state.params.values():
        if p.stack is None:
            by_module[p.module].append(p)
    for stack in state.stacks.values():  # one entry for all of a stack's expert pieces
        by_module[stack.module].append(stack)
    handles = []
    for module, params in by_module.items():
        handles.append(
            module.register_state_dict_pre_hook(functools.partial(_state_dict_pre_hook, params))
        )
        handles.append(
            module.register_state_dict_post_hook(
                functools.partial(_state_dict_post_hook, state, params)
            )
        )
        handles.append(
            module.register_load_state_dict_pre_hook(
                functools.partial(_load_state_dict_pre_hook, state, params)
            )
        )
    return handles


def entries_as_markers(state: DedicatedState) -> contextlib.AbstractContextManager[None]:
    """Inside, ``state_dict()`` gives a ``DedicatedEntry`` for each dedicated parameter."""
    return _flag_set(state, "checkpoint_reading")


def dedicated_entries_applied(state: DedicatedState) -> contextlib.AbstractContextManager[None]:
    """Inside, ``load_state_dict()`` skips dedicated entries (the caller has applied them)."""
    return _flag_set(state, "checkpoint_loading")


@contextlib.contextmanager
def _flag_set(state: DedicatedState, flag: str) -> Iterator[None]:
    previous = getattr(state, flag)
    setattr(state, flag, True)
    try:
        yield
    finally:
        setattr(state, flag, previous)


def _state_dict_pre_hook(
    params: list[DedicatedParam], module: nn.Module, prefix: str, keep_vars: bool
) -> None:
    for p in params:
        p.placeholder.in_state_dict = True


def _state_dict_post_hook(
    state: DedicatedState,
    params: list[DedicatedParam],
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
) -> None:
    for p in params:
        p.placeholder.in_state_dict = False
    if not state.is_adopted:  # the original parameters are still registered
        return
    for p in params:
        key = prefix + p.attr
        if key not in state_dict:
            continue
        if state.checkpoint_reading:
            state_dict[key] = DedicatedEntry(p)
        elif state.mesh.num_slots == 1 and not getattr(p, "is_tp_sharded", False):
            state_dict[key] = _full_value_here(p).to(p.placeholder.dtype)
        else:
            raise RuntimeError(
                STATE_DICT_NEEDS_CHECKPOINT.format(
                    fqn=key, owner=state.mesh.global_rank(p.owner), slots=state.mesh.num_slots
                )
            )


def _load_state_dict_pre_hook(
    state: DedicatedState,
    params: list[DedicatedParam],
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    if not state.is_adopted:
        return
    for p in params:
        key = prefix + p.attr
        if key not in state_dict:
            continue
        value = state_dict[key]
        # The placeholder then "loads" a 0-element tensor (or, with assign=True, itself).
        state_dict[key] = p.placeholder
        if state.checkpoint_loading:
            continue
        if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            error_msgs.append(
                f"{key} is a dedicated parameter and needs its full value as a plain tensor of "
                f"shape {tuple(p.shape)}, got {type(value).__name__}; load sharded checkpoints "
                "with dmuon.checkpoint.set_model_state_dict."
            )
        elif tuple(value.shape) != tuple(p.shape):
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                f"checkpoint, the shape in current model is {tuple(p.shape)}."
            )
        elif isinstance(p, ExpertStack):
            for piece in p.pieces:
                state.load_full_value(piece, value[piece.experts[0] : piece.experts[1]])
        else:
            state.load_full_value(p, value)


def _full_value_here(p: DedicatedParam | ExpertStack) -> torch.Tensor:
    """The full fp32 value of ``p`` on an ownership grid of one slot (this rank owns it all)."""
    if isinstance(p, ExpertStack):
        return torch.cat([piece.master.detach() for piece in p.pieces])
    return p.master.detach()
