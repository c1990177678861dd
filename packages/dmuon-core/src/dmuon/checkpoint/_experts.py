"""Expert stacks in ``dmuon.checkpoint``: one entry of the stack's FQN and (E, m, n) shape.

A stack is dedicated as expert pieces with different owners ([Note: expert stacks are pieces] in
``dmuon.experts``); a checkpoint keeps the plain model's key and shape for it, in the model state
dict and for each tensor of its optimizer state (Muon's momentum, AdamW's moments):

- sharded: a value of the stack's full shape whose local shards are the pieces' tensors this
  rank owns, ``[start, stop)`` along the expert dim (see [Note: sharded stacks] in
  ``dmuon.module_state``: it is the model's own state-dict entry, built here from offloaded
  tensors when the options ask). Every owner writes its experts once, and
  ``torch.distributed.checkpoint.load`` reads the experts of any saved layout (other slices, one
  process) straight into them. A rank that owns every piece holds the plain tensor. A 0-dim
  entry (AdamW's ``step``, the same for every piece) is the first owned piece's.
- full: each piece gathered from its owner (one piece in flight at a time), concatenated on the
  ranks that keep full tensors; under expert parallelism every EP slot's pieces, each from its
  owner (``ExpertStack.every_piece``).

It must not know the layout of the state dicts around the entries (``_model`` and ``_optim``).
"""

from __future__ import annotations

import torch

from dmuon.checkpoint._context import CheckpointContext
from dmuon.experts import ExpertStack
from dmuon.module_state import piece_value, stack_entry
from dmuon.param import DedicatedParam

# ---- the model's weights --------------------------------------------------------------------


def stack_model_entry(ctx: CheckpointContext, stack: ExpertStack) -> object | None:
    """The stack's entry in a model state dict on this rank (None: no entry here)."""
    dtype = stack.placeholder.dtype
    if ctx.full:
        return _gathered(
            ctx,
            stack,
            {piece: piece.master.detach().to(dtype) for piece in stack.owned_pieces()},
            shape_of=lambda entry: (entry.stop - entry.start, *stack.shape[1:]),
            dtype=dtype,
        )
    return _sharded(ctx, stack, {piece: piece.master.detach() for piece in stack.owned_pieces()})


def stack_value_error(key: str, stack: ExpertStack, value: object) -> str | None:
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    if shape != tuple(stack.shape):
        return (
            f"size mismatch for {key}: the state dict has shape {shape}, the model "
            f"{tuple(stack.shape)}"
        )
    return None


def load_stack_values(values: list[tuple[ExpertStack, torch.Tensor]]) -> None:
    """Copy each stack's value into the masters of the pieces this rank owns."""
    with torch.no_grad():
        for stack, value in values:
            for piece in stack.owned_pieces():
                piece.master_value().copy_(piece_value(piece, value))


# ---- the optimizer's state ------------------------------------------------------------------


def stack_optimizer_entries(
    ctx: CheckpointContext,
    stack: ExpertStack,
    optimizer_state: dict,
    schema: dict[str, list[tuple[str, tuple[int, ...], torch.dtype, bool]]],
) -> dict[str, object] | None:
    """The stack's entries in an optimizer state dict on this rank (None: no entry here).

    ``schema`` is every owner's ``(name, shape, dtype, on_cpu)`` of each piece's state, by piece
    name (full state dicts only: the ranks that own nothing learn the shapes from it).
    """
    owned = {
        piece: optimizer_state[piece.master]
        for piece in stack.owned_pieces()
        if piece.master in optimizer_state
    }
    entries: dict[str, object] = {}
    if ctx.full:
        first = schema.get(stack.every_piece[0].fqn, [])
        for name, _, dtype, on_cpu in first:
            shapes = {
                entry.fqn: dict((n, s) for n, s, _, _ in schema.get(entry.fqn, []))[name]
                for entry in stack.every_piece
            }
            full = _gathered(
                ctx,
                stack,
                {piece: state[name] for piece, state in owned.items()},
                shape_of=lambda entry, shapes=shapes: shapes[entry.fqn],
                dtype=dtype,
            )
            if full is not None:
                entries[name] = full.cpu() if on_cpu else full
        return entries or None
    if not owned:
        return None
    for name, tensor in next(iter(owned.values())).items():
        if tensor.ndim == 0:
            entries[name] = ctx.offloaded(tensor)
        else:
            entries[name] = _sharded(ctx, stack, {p: state[name] for p, state in owned.items()})
    return entries


def load_piece_state(piece: DedicatedParam, target: dict, entries: dict) -> None:
    """Copy a piece's experts of each saved entry of its stack into its state ``target``."""
    for name, tensor in target.items():
        value = entries[name]
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, dtype=tensor.dtype)
        tensor.copy_(value if tensor.ndim == 0 else piece_value(piece, value))


# ---- building the values --------------------------------------------------------------------


def _gathered(
    ctx: CheckpointContext,
    stack: ExpertStack,
    owned: dict[DedicatedParam, torch.Tensor],
    *,
    shape_of,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The full (E, ...) tensor from each piece's owner, on the ranks that keep full tensors:
    every piece of the stack, under expert parallelism those of every EP slot (``every_piece``,
    the same order on every rank)."""
    parts = []
    owned_by_name = {piece.fqn: tensor for piece, tensor in owned.items()}
    for entry in stack.every_piece:
        part = ctx.full_from_owner(
            entry.owner_rank, owned_by_name.get(entry.fqn), shape_of(entry), dtype
        )
        if part is not None:
            parts.append(part)
    if not parts:
        return None
    if parts[0].ndim == 0:  # a per-piece scalar (AdamW's step): the same in every piece
        return parts[0]
    return torch.cat(parts)


def _sharded(
    ctx: CheckpointContext, stack: ExpertStack, owned: dict[DedicatedParam, torch.Tensor]
) -> torch.Tensor | None:
    """The (E, ...) value whose local shards are ``owned`` (piece -> its tensor), offloaded as
    the options say."""
    return stack_entry(
        stack, {piece: ctx.offloaded(tensor) for piece, tensor in owned.items()}, ctx.group
    )
