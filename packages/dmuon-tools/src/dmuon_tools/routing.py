"""The routing table of a ``dmuon.Muon`` optimizer as text: one line per parameter.

Reads ``optimizer.routing()`` only (the same rows on every rank, no collective); it must not
decide anything itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

_HEADER = ("parameter", "shape", "route", "owner", "lr", "weight decay", "why")


def format_routing_table(rows: Iterable[Sequence]) -> str:
    """``optimizer.routing()``'s rows as an aligned text table (owner ``-`` when not dedicated)."""
    cells = [_HEADER] + [
        (
            fqn,
            "x".join(str(d) for d in shape) or "scalar",
            route,
            "-" if owner is None else str(owner),
            f"{lr:g}",
            f"{weight_decay:g}",
            why,
        )
        for fqn, shape, route, owner, lr, weight_decay, why in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_HEADER))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in cells]  # fmt: skip
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def print_routing(optimizer, file: TextIO | None = None) -> None:
    """Print ``optimizer``'s routing table (call it on rank 0: every rank has the same)."""
    print(format_routing_table(optimizer.routing()), file=file or sys.stdout)
