"""How many Newton-Schulz orthogonalisations each Muon matrix this rank owns has received.

Owns the counter behind ``dmuon.inspect.newton_schulz_counts``: ``dmuon.Muon`` reports every
Newton-Schulz output it applies to a master (``received``): the plain step, a commit of the
overlapped step's speculation, the offloaded masters' step and a tensor-parallel matrix's chunk,
each where it updates the master. It must not compute anything, issue collectives, or read a
plan: a count moves only when an update really reached the matrix.

[Note: one Newton-Schulz per matrix per step]
Under gradient accumulation the gradients of every micro-batch add into the masters (with or
without ``no_sync``) and ``step()`` orthogonalises each owned matrix once; systems that run
Newton-Schulz per micro-batch drift from that. The counter holds the promise up to users' eyes:
after k steps every matrix this rank owns shows k, every other 0. What counts is an applied
update, not a Newton-Schulz run: the overlapped step's speculation that ``step()`` discards
(its inputs changed) counts nothing (``Muon.overlap_stats()`` counts those), and a step
skipped for non-finite gradients (``nonfinite="skip"``) counts nothing, since it updates
nothing. A matrix with no gradient in a step (frozen, unused) is not stepped, and not counted.
The count is per Muon matrix: each expert of an expert piece, each row block of a matrix
dedicated with ``row_blocks=`` (each gets its own Newton-Schulz). Counting is a Python integer
per matrix and step: no device work, no synchronisation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from dmuon.muon_state import Piece

# Which matrix of a master: None (the master), ``i`` (expert i of an expert piece) or
# ``(start, stop)`` (a row block); ``dmuon.muon_state.Piece`` with the slice made hashable.
PieceKey = int | tuple[int, int] | None


class NewtonSchulzCounts:
    """Per (master, matrix of it): the Newton-Schulz outputs applied to it since construction."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[int, PieceKey]] = Counter()

    def received(self, entries: Iterable[tuple[torch.Tensor, Piece]]) -> None:
        """Each ``(master, piece)`` of ``entries`` was updated from one Newton-Schulz output."""
        for master, piece in entries:
            self._counts[(id(master), _key(piece))] += 1

    def of(self, master: torch.Tensor, piece: Piece = None) -> int:
        return self._counts[(id(master), _key(piece))]


def _key(piece: Piece) -> PieceKey:
    return (piece.start, piece.stop) if isinstance(piece, slice) else piece
