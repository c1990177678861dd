"""The routing table of a ``dmuon.Muon`` optimizer as text: one line per parameter.

Reads ``optimizer.routing()`` only (the same rows on every rank, no collective); it must not
decide anything itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

_HEADER = ("parameter", "shape", "route", "owner", "lr", "weight decay", "why", "update rule")
_SLICES_SHOWN = 4  # an expert stack's owner cell lists this many slices, then counts the rest


def format_routing_table(rows: Iterable[Sequence]) -> str:
    """``optimizer.routing()``'s rows as an aligned text table (owner ``-`` when not dedicated;
    for an expert stack, ``[start:stop]@rank`` for each slice of its experts; the last column is
    the update rule of the parameter's group: muon, normuon, their momentum dtype, adamw)."""
    cells = [_HEADER] + [_cells(*row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADER))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in cells]  # fmt: skip
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _cells(fqn, shape, route, owner, lr, weight_decay, why, update_rule="") -> tuple[str, ...]:
    # update_rule "": a row written before dmuon-core's rows had one (seven fields).
    return (
        fqn,
        "x".join(str(d) for d in shape) or "scalar",
        route,
        _owner_cell(owner),
        f"{lr:g}",
        f"{weight_decay:g}",
        why,
        update_rule,
    )


def _owner_cell(owner) -> str:
    if owner is None:
        return "-"
    if isinstance(owner, tuple):  # an expert stack: the owner of each slice of its experts
        cell = " ".join(f"[{s.start}:{s.stop}]@{s.rank}" for s in owner[:_SLICES_SHOWN])
        more = len(owner) - _SLICES_SHOWN
        return cell + (f" +{more} slices" if more > 0 else "")
    return str(owner)


def print_routing(optimizer, file: TextIO | None = None) -> None:
    """Print ``optimizer``'s routing table (call it on rank 0: every rank has the same)."""
    print(format_routing_table(optimizer.routing()), file=file or sys.stdout)
