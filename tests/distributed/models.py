"""The tiny decoder of the protocol tests and its data: ``dmuon.testing``'s (its docstring says
what the uneven shapes are for), under the name the test modules import it by.

Its one copy lives in dmuon-core's ``dmuon.testing`` so the benchmarks share it without importing
the test suite; change it there.
"""

from dmuon.testing import (
    DIM,
    FFN,
    VOCAB,
    Block,
    TinyDecoder,
    batches,
    loss_fn,
    proj_predicate,
    rank_rows,
)

__all__ = [
    "DIM",
    "FFN",
    "VOCAB",
    "Block",
    "TinyDecoder",
    "batches",
    "loss_fn",
    "proj_predicate",
    "rank_rows",
]
