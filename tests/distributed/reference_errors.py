"""Each weight's relative error against a single-process reference, without gathering weights.

``relative_errors(current_weights(model), reference)`` gathers every FSDP2 parameter whole
(one all-gather and a DTensor redistribution each) on every step of a scenario: about a fifth of
a small scenario's time. The same figure, ``||w - w_ref|| / ||w_ref||``, needs only two sums of
squares per parameter: each rank sums them over its local shard against the same slice of the
reference, and one all-reduce per group adds them up.

The sums run over the mesh dims a parameter is *sharded* on, never its replicated dims: under
HSDP each replica reports its own error, so one replica drifting from the others is not averaged
away. Parameters this cannot slice exactly (strided shards of FSDP2 over TP, several sharded mesh
dims) are gathered whole as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from dmuon.hooks import get_dedicated_state


def relative_errors_to(model, reference) -> dict[str, float]:
    """``{name: relative error}`` of every weight this rank can see (owned dedicated masters and
    every FSDP2 parameter) against ``reference``'s parameter of that name. Collective over each
    FSDP2 parameter's shard group: every rank of the model calls it."""
    expected = dict(reference.named_parameters())
    state = get_dedicated_state(model)
    errors = {p.fqn: _relative(_whole(p), expected[p.fqn]) for p in state.iter_owned_masters()}
    pending: dict[dist.ProcessGroup, list[tuple[str, torch.Tensor]]] = {}
    for name, param in model.named_parameters():
        if name in state.params:
            continue
        group = _shard_group(param)
        if group is None:
            errors[name] = _relative(param.full_tensor(), expected[name])
            continue
        local = param.to_local().detach()
        piece = _local_piece(expected[name].detach(), param)
        sums = torch.stack([(local - piece).square().sum(), piece.square().sum()]).double()
        pending.setdefault(group, []).append((name, sums))
    for group, entries in pending.items():
        sums = torch.stack([s for _, s in entries])
        dist.all_reduce(sums, group=group)
        for (name, _), (error, norm) in zip(entries, sums.tolist()):
            errors[name] = (error / max(norm, 1e-60)) ** 0.5
    return errors


def _whole(p) -> torch.Tensor:
    """An owned master, its TP chunks gathered over the owner's TP ranks."""
    master = p.master.detach()
    return p.tp.as_dtensor(master).full_tensor() if p.tp is not None else master


def _relative(value: torch.Tensor, expected: torch.Tensor) -> float:
    return ((value - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _shard_group(param: torch.Tensor) -> dist.ProcessGroup | None:
    """The group of ranks holding the distinct pieces of this rank's copy of ``param``, when it
    is sharded plainly (``Shard``) on exactly one mesh dim; ``None`` otherwise."""
    if not isinstance(param, DTensor):
        return None
    placements = param.placements
    if any(type(p) not in (Shard, Replicate) for p in placements):
        return None  # strided or partial placements: gathered whole
    sharded = [dim for dim, p in enumerate(placements) if isinstance(p, Shard)]
    if len(sharded) != 1:
        return None
    return param.device_mesh.get_group(sharded[0])


def _local_piece(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """The slice of ``full`` that ``param``'s local shard holds: ``Shard(d)`` splits dim ``d``
    into ``torch.chunk`` pieces over its mesh dim, an empty piece past the last chunk."""
    mesh = param.device_mesh
    piece = full
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            size = mesh.size(mesh_dim)
            chunks = piece.chunk(size, dim=placement.dim)
            index = mesh.get_local_rank(mesh_dim)
            empty = piece.narrow(placement.dim, 0, 0)
            piece = chunks[index] if index < len(chunks) else empty
    if piece.shape != param.to_local().shape:
        raise AssertionError(
            f"{param.placements} slice of shape {tuple(piece.shape)} does not match the local "
            f"shard's {tuple(param.to_local().shape)}"
        )
    return piece
