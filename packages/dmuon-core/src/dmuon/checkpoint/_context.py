"""What every ``dmuon.checkpoint`` call shares: its options, its ranks, and how one tensor moves.

Owns the validation of ``StateDictOptions``, the choice of the receiving rank of a full state
dict, the gathering of one full tensor (from the one owner that holds it, or from a DTensor's
shards), and the agreement that makes an error on one rank an error on every rank. It must not
know the layout of model or optimizer state dicts.

[Note: one tensor at a time]
A full state dict is assembled key by key, in the same order on every rank (the order of
``model.state_dict()`` / ``model.named_parameters()``): a dedicated tensor goes from its owner to
the receiving rank (``cpu_offload=True``: point to point; otherwise broadcast to every rank), a
DTensor is gathered with ``full_tensor()``. Only one full tensor is in flight on any rank at a
time, so the extra device memory is at most the largest single tensor.

[Note: a full state dict is a snapshot]
A full state dict is what a user keeps (``torch.save``, a comparison after more steps), so none
of its tensors is live state: not an owner's fp32 master, not a momentum buffer, not a plain
parameter or buffer that the next step or forward changes in place. torch's FSDP2 path gives
the same (``full_tensor()`` gathers into new storage). The owner that is also the receiving rank
(and every rank in one process) would otherwise hand out its own tensors, as ``.cpu()`` and
``.to()`` return the tensor itself where nothing moves; so a value that still shares its storage
with the state it came from is copied once, and only then (a value moved to the CPU or
converted to another dtype is a copy already). A sharded state dict is the other way round: it
is the live state, as FSDP2's local shards are, so that ``torch.distributed.checkpoint`` writes
it without a copy and loads into it in place (see [Note: a dedicated parameter's state-dict
entry] in ``dmuon.module_state``); under ``cpu_offload`` it is moved to the CPU, which is the
tensor itself on a CPU run, as torch's is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from dmuon.hooks import DedicatedState, get_dedicated_state
from dmuon.param import DedicatedParam

_DEFAULT_OPTIONS = StateDictOptions()


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointContext:
    state: DedicatedState
    options: StateDictOptions
    group: dist.ProcessGroup | None  # every rank of the ownership grid; None for one slot
    rank: int  # this rank's global rank
    # Global rank that gets the full state dict under cpu_offload, and the one that holds it
    # under broadcast_from_rank0: the lowest of the grid and, under tensor parallelism, of its
    # TP peers' grids (they hold the same model).
    receiver: int
    receiver_in_grid: bool  # this rank's grid holds the receiver (else it sends nothing)
    device: torch.device  # where tensors travel (the device of the dedicated weights)

    @property
    def full(self) -> bool:
        return self.options.full_state_dict

    @property
    def keeps_full(self) -> bool:
        """This rank keeps the full tensors of a full state dict."""
        return not self.options.cpu_offload or self.rank == self.receiver

    def owner_rank(self, p: DedicatedParam) -> int:
        return self.state.mesh.global_rank(p.owner)

    def full_from_owner(
        self,
        owner: int,
        owned: torch.Tensor | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """The full value, in ``dtype``, of a tensor only global rank ``owner`` holds (``owned``
        there, None elsewhere), on the ranks that keep full tensors; None on the others.
        ``owned`` may be live state (a master, a momentum buffer): what this returns never
        shares its storage (see [Note: a full state dict is a snapshot])."""
        if self.group is None:
            return self._snapshot(owned.to(dtype), owned) if self.keeps_full else None
        if self.options.cpu_offload:
            if not self.receiver_in_grid:
                return None
            if self.rank == owner == self.receiver:
                return self._snapshot(owned.to(dtype), owned)
            if self.rank == owner:
                sent = owned.to(self.device, dtype).contiguous()
                dist.send(sent, dst=self.receiver, group=self.group)
            elif self.rank == self.receiver:
                received = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(received, src=owner, group=self.group)
                return self._placed(received)
            return None
        if self.rank == owner:
            buffer = owned.to(self.device, dtype).contiguous()
            buffer = buffer.clone() if _shares_storage(buffer, owned) else buffer
        else:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buffer, src=owner, group=self.group)
        return buffer

    def full_from_shards(self, value: DTensor) -> torch.Tensor | None:
        full = value.full_tensor()  # collective over the DTensor's mesh
        # A replicated DTensor's full tensor is its local tensor.
        return self._snapshot(full, value.to_local()) if self.keeps_full else None

    def full_value(self, value: object) -> object:
        """A plain (not sharded, not dedicated) value of a full state dict on a rank that keeps
        it: a tensor of its own, on the CPU under ``cpu_offload``; other objects as they are."""
        if not isinstance(value, torch.Tensor):
            return value
        return self._snapshot(value, value)

    def offloaded(self, value):
        """A sharded state dict's value, on the CPU under ``cpu_offload``: the live tensor where
        it is there already (see [Note: a full state dict is a snapshot])."""
        if not self.options.cpu_offload or not isinstance(value, torch.Tensor):
            return value
        if isinstance(value, DTensor):
            return DTensor.from_local(
                value.to_local().cpu(),
                value.device_mesh,
                value.placements,
                shape=value.shape,
                stride=value.stride(),
            )
        return value.cpu()

    def _placed(self, value: torch.Tensor) -> torch.Tensor:
        return value.cpu() if self.options.cpu_offload else value

    def _snapshot(self, value: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """``value`` placed, copied if it still shares ``live``'s storage."""
        placed = self._placed(value).detach()
        return placed.clone() if _shares_storage(placed, live) else placed

    def raise_if_any_rank_failed(self, errors: list[str], what: str) -> None:
        """Raise ``ValueError`` on every rank if any rank found ``errors`` (one collective)."""
        everyone = [errors]
        if self.group is not None:
            everyone = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, errors, group=self.group)
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else [self.rank]
        lines = [f"rank {rank}: {error}" for rank, found in zip(ranks, everyone) for error in found]
        if lines:
            shown = "\n  ".join(lines[:20])
            more = f"\n  ... {len(lines) - 20} more" if len(lines) > 20 else ""
            raise ValueError(f"dmuon.checkpoint: {what}:\n  {shown}{more}")

    def all_gather(self, value: object) -> list[object]:
        if self.group is None:
            return [value]
        everyone: list[object] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, value, group=self.group)
        return everyone


def checkpoint_context(
    model: nn.Module, options: StateDictOptions | None, *, loading: bool = False
) -> CheckpointContext:
    """Check the options, drain pending publishes, and describe this rank's part.
    ``loading``: for ``set_model_state_dict``, the one call that takes ``broadcast_from_rank0``."""
    options = _check_options(options, loading=loading)
    state = get_dedicated_state(model)
    state.ensure_adopted()
    # A publish in flight still writes the replicas' copies: let it land before reading or
    # overwriting any weight.
    state.wait_all_replicate_broadcasts()
    state.publish_loaded_masters()
    mesh = state.mesh
    rank = dist.get_rank() if dist.is_initialized() else 0
    grid_lowest = min(rank for row in mesh.rank_grid for rank in row)
    device = state.device
    receiver = grid_lowest
    one_rank_holds_it = options.cpu_offload or options.broadcast_from_rank0
    if options.full_state_dict and one_rank_holds_it and mesh.tp_group is not None:
        lowest = torch.tensor([grid_lowest], device=device)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=mesh.tp_group)
        receiver = int(lowest.item())
    return CheckpointContext(
        state=state,
        options=options,
        group=mesh.world_group,
        rank=rank,
        receiver=receiver,
        receiver_in_grid=receiver == grid_lowest,
        device=device,
    )


def _shares_storage(value: torch.Tensor, live: torch.Tensor) -> bool:
    return (
        value.device == live.device
        and value.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
    )


def _check_options(options: StateDictOptions | None, *, loading: bool) -> StateDictOptions:
    if options is None:
        return _DEFAULT_OPTIONS
    if not isinstance(options, StateDictOptions):
        raise TypeError(
            "options must be a torch.distributed.checkpoint.state_dict.StateDictOptions, got "
            f"{type(options).__name__} {options!r}; e.g. StateDictOptions(full_state_dict=True, "
            "cpu_offload=True)."
        )
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(
            "StateDictOptions(broadcast_from_rank0=True) needs full_state_dict=True (rank 0 "
            "holds a full state dict); set both."
        )
    if options.broadcast_from_rank0 and not loading:
        raise ValueError(
            "StateDictOptions(broadcast_from_rank0=True) is for loading a model state dict: "
            "dmuon.checkpoint.set_model_state_dict takes it (the full dict on the first rank, {} "
            "elsewhere). Reading full dicts, use cpu_offload=True (one copy on the first rank); "
            "optimizer state loads from a sharded checkpoint or a full dict on every rank."
        )
    if options.dsd_fqn_modifiers != _DEFAULT_OPTIONS.dsd_fqn_modifiers:
        raise ValueError(
            f"dmuon.checkpoint does not support StateDictOptions(dsd_fqn_modifiers="
            f"{options.dsd_fqn_modifiers!r}); keys are always the model's own FQNs."
        )
    return options
