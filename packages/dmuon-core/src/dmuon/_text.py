"""Text helpers for messages: a leaf module (no dmuon imports)."""

from __future__ import annotations

from collections.abc import Iterable


def preview_names(names: Iterable[str], limit: int = 5) -> str:
    """``a, b, c, ... N more``: the first ``limit`` names of a list shown in a message."""
    names = list(names)
    more = f", ... {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
