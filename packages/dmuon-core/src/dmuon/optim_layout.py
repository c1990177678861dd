"""The layout a per-rank ``dmuon.Muon.state_dict()`` was written on, and the check that refuses it
on another rank or layout.

Owns the record a per-rank state dict carries (``LAYOUT_KEY``: world size, rank, the ownership
grid's shape, the owner of every trainable parameter) and the check ``Muon.load_state_dict``
runs before anything changes, agreed across every rank. It must not load,
read or change optimizer state, nor decide owners (it records ``dmuon.routing``'s facts).

[Note: per-rank state dicts]
torch's habit is ``torch.save(optimizer.state_dict())`` on every rank and each rank loading its
own file. torch keys the state by position in the rank's param groups, and a dmuon rank's groups
hold the masters it owns and FSDP2's local shards: the positions name other tensors on another
rank or layout. Unchecked, rank 0's file loaded on every rank trained on with other ranks'
momenta and AdamW shards (0.56 relative from the uninterrupted run after 2 steps), and the files
of 2 ranks loaded on 4 failed torch's group-size check (a bare ``ValueError``) on two ranks while
the other two loaded mismatched shapes and went on. So the dict records its layout, and
``check_layout`` compares it with the loading rank's: each rank finds its own difference, the
verdicts are gathered over the default group (one ``all_gather_object`` of a short string or
None), and every rank raises the same ``ValueError`` naming ``dmuon.checkpoint`` (which
reshards) if any rank differs, so none loads and none waits in a later collective for the
others. The default group, not the ownership grid: a TP peer or another pipeline stage sits in
another grid, and a rank that loaded while its grid's neighbour raised would wait for it in the
next step. So every rank loads its optimizers' dicts in the same order (as torch's habit and
the trainers do: each rank loads its own files), as for any collective. The normal resume (each rank its own file, same layout) loads exactly as torch's.

A dict without the record (written by a dmuon before it, or built by hand) is loaded as torch
would only where there is one layout: one process, every matrix owned here (torch's own
group-size check still catches another model). With several ranks it is refused on every rank,
since nothing tells which rank wrote it; the message says how to add the record when the user
knows the file is this rank's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from dmuon.mesh import OwnershipMesh
from dmuon.routing import ParamFacts

LAYOUT_KEY = "dmuon_layout"
"""The key of the layout record in a per-rank ``dmuon.Muon.state_dict()``."""

_FIX = (
    "A per-rank optimizer.state_dict() holds the state of what its rank owns, keyed by position, "
    "so it loads only on the rank and layout that wrote it. To resume on another rank or layout "
    "(or to be safe from mixing files up), save and load with dmuon.checkpoint, which reshards: "
    "model_sd, optim_sd = dmuon.checkpoint.get_state_dict(model, optimizer); "
    'dmuon.checkpoint.save({"model": model_sd, "optim": optim_sd}, path), and to resume '
    'dmuon.checkpoint.load({"model": model_sd, "optim": optim_sd}, path) then '
    "dmuon.checkpoint.set_state_dict(model, optimizer, model_state_dict=model_sd, "
    "optim_state_dict=optim_sd)."
)


def layout_record(mesh: OwnershipMesh, facts: Sequence[ParamFacts]) -> dict[str, Any]:
    """This rank's layout, in plain Python values (``torch.load(weights_only=True)`` reads them):
    world size, rank, the ownership grid (shards, replicas, TP size) and every trainable
    parameter's owner (a global rank, None when FSDP2 shards it, ``((start, stop, rank), ...)``
    for an expert stack's slices)."""
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "grid": (mesh.num_shards, mesh.num_replicas, mesh.tp_size),
        "owners": {f.fqn: _plain_owner(f.owner_rank) for f in facts},
    }


def check_layout(state_dict: Mapping[str, Any], here: dict[str, Any]) -> None:
    """Raise ValueError on every rank if the per-rank ``state_dict`` any rank loads was written
    on another rank or layout than its ``here`` (``layout_record``'s); see [Note: per-rank state
    dicts]. Collective over the default group when there are several ranks; reads nothing but
    the record."""
    problem = _difference(state_dict.get(LAYOUT_KEY), here)
    if here["world_size"] == 1:
        verdicts = [(here["rank"], problem)]
    else:
        verdicts = [None] * here["world_size"]
        dist.all_gather_object(verdicts, (here["rank"], problem))
    failed = [(rank, text) for rank, text in verdicts if text is not None]
    if not failed:
        return
    ranks = [rank for rank, _ in failed]
    lines = "".join(f"\n  rank {rank}: {text}" for rank, text in failed)
    raise ValueError(
        f"dmuon.Muon.load_state_dict: the per-rank optimizer state dict does not fit the layout "
        f"it is loaded on, on {'rank' if len(ranks) == 1 else 'ranks'} "
        f"{ranks[0] if len(ranks) == 1 else ranks} of {len(verdicts)}:{lines}\n"
        f"Nothing was loaded, on any rank. {_FIX}"
    )


def without_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` less its layout record: what torch's ``load_state_dict`` takes."""
    return {key: value for key, value in state_dict.items() if key != LAYOUT_KEY}


def _difference(saved: Any, here: dict[str, Any]) -> str | None:
    """What differs between the saved record and this rank's layout (the first thing found), or
    None when the dict loads here."""
    if saved is None:
        if here["world_size"] == 1:
            return None
        return (
            f"the state dict has no {LAYOUT_KEY!r} record (written by torch.optim, or by a dmuon "
            "before the record), so nothing tells which rank and layout wrote it. If this file "
            "is known to be this very rank's, from this layout, add the record and load again: "
            f"saved[{LAYOUT_KEY!r}] = optimizer.state_dict()[{LAYOUT_KEY!r}]."
        )
    if not isinstance(saved, Mapping) or not {"world_size", "rank", "grid", "owners"} <= set(saved):
        return (
            f"its {LAYOUT_KEY!r} record is not one dmuon.Muon.state_dict() writes: {saved!r:.200}."
        )
    if (saved["world_size"], saved["rank"]) != (here["world_size"], here["rank"]):
        return (
            f"it was written by rank {saved['rank']} of {saved['world_size']}, and is loaded on "
            f"rank {here['rank']} of {here['world_size']}."
        )
    if tuple(saved["grid"]) != here["grid"]:
        return (
            "it was written on an ownership grid of (shards, replicas, TP size) "
            f"{tuple(saved['grid'])}, and is loaded on {here['grid']}."
        )
    if saved["owners"] != here["owners"]:
        return _owner_difference(saved["owners"], here["owners"])
    return None


def _owner_difference(saved: Mapping[str, Any], here: Mapping[str, Any]) -> str:
    only_saved = [fqn for fqn in saved if fqn not in here]
    only_here = [fqn for fqn in here if fqn not in saved]
    if only_saved or only_here:
        return (
            f"it was written for other parameters: {len(only_saved)} only in the state dict "
            f"(first {only_saved[:3]}), {len(only_here)} only in this optimizer (first "
            f"{only_here[:3]})."
        )
    fqn = next(fqn for fqn in here if saved[fqn] != here[fqn])
    return (
        f"it was written with other owners: {fqn!r} was owned by {saved[fqn]!r} there and by "
        f"{here[fqn]!r} here (None: sharded by FSDP2)."
    )


def _plain_owner(owner: Any) -> Any:
    """An owner as plain ints and tuples (an expert stack's ``ExpertSliceOwner`` slices)."""
    if isinstance(owner, tuple):
        return tuple(tuple(int(v) for v in piece) for piece in owner)
    return owner
