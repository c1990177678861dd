"""The tiny decoder of the CPU protocol tests, for a benchmark that still imports it from here.

Its one copy is ``dmuon.testing`` (with the reference optimizer); import it from there. This name
stays only until ``run_tensor_parallel_cuda.py`` does so too.
"""

from dmuon.testing import (
    TinyDecoder,
    batches,
    dedicate_and_shard,
    loss_fn,
    proj_predicate,
    rank_rows,
)

__all__ = ["TinyDecoder", "batches", "dedicate_and_shard", "loss_fn", "proj_predicate", "rank_rows"]
