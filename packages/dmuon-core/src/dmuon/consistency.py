"""One-time checks that every rank made the same choices, so a mismatch fails loudly, never hangs.

Owns the comparison and its message; one small ``all_gather_object`` per check. It must not be
called on a hot path.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_FIX = (
    "Every rank must build the same model, call dedicate_params with the same predicate, and "
    "construct dmuon.Muon with the same ns_backend."
)


def check_ranks_agree(group: dist.ProcessGroup | None, facts: dict[str, tuple[str, Any]]) -> None:
    """Raise ValueError on every rank if any fact differs between ranks of ``group``.

    ``facts`` maps a key to (what it is, for the message; this rank's value).
    """
    if group is None:
        return
    mine = {key: value for key, (_, value) in facts.items()}
    everyone: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    for key, (what, _) in facts.items():
        reference = everyone[0][key]
        differing = [rank for rank, seen in zip(ranks, everyone) if seen[key] != reference]
        if differing:
            mismatch = everyone[ranks.index(differing[0])][key]
            raise ValueError(
                f"dmuon: ranks {differing} use different {what} from rank {ranks[0]}: "
                f"rank {ranks[0]} has {_short(reference)}, rank {differing[0]} has "
                f"{_short(mismatch)}. {_FIX}"
            )


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
