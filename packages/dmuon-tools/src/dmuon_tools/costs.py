"""Cost models of the simulator: collectives, Newton-Schulz calls, element-wise passes, FLOPs.

Owns the formulas, each a pure function of sizes and a ``Machine`` figure, so each can be checked
by hand (``tests/tools/test_simulator_costs.py`` does). It must not decide what runs when
(``simulator`` builds the step) nor read files. Times are milliseconds, sizes bytes or elements as
named. The assumptions behind them are written out in ``docs/simulator.md``.

[Note: ring collectives]
A collective over ``n`` ranks on a link of bandwidth ``bw`` and per-step latency ``alpha`` costs,
with ``B`` the full buffer (the gathered output, the scattered input, the broadcast tensor):

- all-gather, reduce-scatter: ``(n - 1) alpha + (n - 1)/n B / bw`` (each rank sends n - 1 pieces);
- all-reduce: twice that (a reduce-scatter, then an all-gather);
- broadcast, reduce: ``(n - 1) alpha + B / bw``: NCCL pipelines them along a ring, so every rank
  but the last forwards the whole tensor once and the time is that of one pass.

One rank sends ``(n - 1)/n B`` on average in each of them (``wire_bytes``), so an owner
broadcast moves what FSDP2's all-gather moves for the same tensor; a group of one rank costs
nothing.

[Note: Newton-Schulz of a batch]
The machine's table gives the time of one call on one matrix for a few shapes. A call on a batch
of ``k`` matrices of one shape costs what one call of ``k`` times the FLOPs costs: the GPU is
filled by the work, not by the count of matrices. Times between table points are interpolated
linearly in log(FLOPs)-log(time), below the smallest point extrapolated along the first segment,
above the largest scaled in proportion to FLOPs (the GPU is saturated there). Checked on the one
batched measurement committed: 8 x (1024, 4096) in one call, 1.036 ms measured, 1.04 ms from the
single-matrix table.

[Note: a cooperative Newton-Schulz]
Not implemented in dmuon: the cost of one design (``docs/cooperative-newton-schulz.md``). The
Gram iteration on ``X`` (n x m, n <= m) splits into work on ``X`` (the Gram products ``X Xᵀ`` and
the restarts' ``Q X``: ``6 n^2 m`` FLOPs) and work on n x n matrices (the polynomial in ``R``:
``14 n^3``). With ``X`` cut into ``k`` column blocks, one per cooperating rank, the X-side work
divides by ``k`` and each Gram matrix is the all-reduce of ``k`` partial ones; the n x n work either
runs whole on every rank (``replicated``) or is cut into row blocks, each product's result
all-gathered for the next (``split``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping

from dmuon.inspect import ns_cost
from dmuon_tools.machine import Link

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce")
# Bytes an element costs in the element-wise passes of one optimizer step (fp32 unless said):
# fused AdamW reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq.
ADAMW_BYTES_PER_ELEMENT = 7 * 4
# dmuon's Muon route around Newton-Schulz (whose table time starts from the fp32 input and ends
# with the fp16 output written): read the reduced gradient (4), read and write the momentum (8);
# the last product reads and writes the fp32 master in its epilogue instead of writing the output
# (8 - 2, [Note: the update epilogue] in dmuon_kernels.update_epilogue); the compute-dtype copy
# the owner broadcasts reads the master and writes bf16 (4 + 2). (The written-out update moved
# 28: its separate pass read the output and read and wrote the master, 2 + 8; the count of 24
# used until 2026-12-06 left out the copy's read of the master.)
MUON_BYTES_PER_ELEMENT = 4 + 8 + (8 - 2) + (4 + 2)
# The overlapped step's commit in step(): read and write the fp32 master (8), read the stored
# orthogonalised update (2), write the compute-dtype copy (2); the rest of the route (gradient,
# momentum into its scratch buffer) runs during backward.
OVERLAP_COMMIT_BYTES_PER_ELEMENT = 8 + 2 + 2
# torch.optim.Muon: the same without the compute-dtype copy (FSDP2 casts in its all-gather).
REFERENCE_MUON_BYTES_PER_ELEMENT = 4 + 8 + 8 + 2
# dmuon.muon_state's NS_CALL_BYTES: fp16 Newton-Schulz input of one batched call (a mirror: core has
# no public name for it yet).
NS_CALL_BYTES = 256 * 2**20
NS_INPUT_BYTES_PER_ELEMENT = 2
# Attention FLOPs: backward over forward for FlashAttention-style kernels (they recompute the
# scores: five products against two).
ATTENTION_BACKWARD_FACTOR = 2.5
MATMUL_BACKWARD_FACTOR = 2.0  # grad input and grad weight: two products per forward product


# ---- collectives (see [Note: ring collectives]) --------------------------------------------


def collective_ms(kind: str, num_bytes: float, group_size: int, link: Link) -> float:
    """Milliseconds of one ring collective of a ``num_bytes`` buffer over ``group_size`` ranks."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; one of {', '.join(COLLECTIVES)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if group_size == 1 or num_bytes == 0:
        return 0.0
    steps = group_size - 1
    fraction = steps / group_size
    if kind in ("all_gather", "reduce_scatter"):
        return steps * link.latency_ms + link.transfer_ms(fraction * num_bytes)
    if kind == "all_reduce":
        return 2 * steps * link.latency_ms + link.transfer_ms(2 * fraction * num_bytes)
    return steps * link.latency_ms + link.transfer_ms(num_bytes)


def wire_bytes(kind: str, num_bytes: float, group_size: int) -> float:
    """Bytes one rank sends on average in the collective (see [Note: ring collectives])."""
    if group_size <= 1:
        return 0.0
    fraction = (group_size - 1) / group_size
    return (2 if kind == "all_reduce" else 1) * fraction * num_bytes


# ---- Newton-Schulz (see [Note: Newton-Schulz of a batch]) ----------------------------------


def ns_batch_ms(
    table: Mapping[tuple[int, int], float], shape: tuple[int, int], count: int
) -> float:
    """Milliseconds of one Newton-Schulz call on ``count`` matrices of ``shape``."""
    if count < 1:
        return 0.0
    return ns_time_of_flops(table, count * ns_cost(shape))


def ns_time_of_flops(table: Mapping[tuple[int, int], float], flops: float) -> float:
    points = sorted((ns_cost(shape), ms) for shape, ms in table.items())
    if len(points) == 1:
        (known_flops, known_ms), = points  # fmt: skip
        return known_ms * flops / known_flops
    flop_points = [f for f, _ in points]
    if flops >= flop_points[-1]:
        last_flops, last_ms = points[-1]
        return last_ms * flops / last_flops
    index = max(1, bisect.bisect_right(flop_points, flops))
    (f0, t0), (f1, t1) = points[index - 1], points[index]
    slope = math.log(t1 / t0) / math.log(f1 / f0)
    return t0 * (flops / f0) ** slope


def ns_calls(count: int, numel: int) -> Iterator[int]:
    """Sizes of the batched calls dmuon makes for ``count`` same-shape matrices of ``numel``
    elements: equal runs of at most ``NS_CALL_BYTES`` of fp16 input (dmuon.muon_state's rule)."""
    if count < 1:
        return
    per_call = max(1, NS_CALL_BYTES // (NS_INPUT_BYTES_PER_ELEMENT * numel))
    calls = -(-count // per_call)
    size = -(-count // calls)
    for start in range(0, count, size):
        yield min(size, count - start)


def owner_ns_ms(
    table: Mapping[tuple[int, int], float], shape_counts: Mapping[tuple[int, int], int]
) -> float:
    """Newton-Schulz milliseconds of an owner holding ``shape_counts`` (NS shape -> how many),
    in dmuon's batched calls."""
    return math.fsum(
        ns_batch_ms(table, shape, size)
        for shape, count in shape_counts.items()
        for size in ns_calls(count, shape[0] * shape[1])
    )


def elementwise_ms(numel: float, bytes_per_element: float, copy_gbps: float) -> float:
    """Milliseconds of memory-bound passes over ``numel`` elements."""
    return numel * bytes_per_element / (copy_gbps * 1e9) * 1e3


# ---- forward and backward FLOPs -----------------------------------------------------------


def layer_forward_flops_per_token(matrix_numel: int, attention_width: int, seq_len: int) -> float:
    """Forward FLOPs a token costs in one decoder layer: its projections (2 per weight) and
    causal attention (scores and values, ``2 * 2 * seq * width``, halved by the mask)."""
    return 2.0 * matrix_numel + 2.0 * seq_len * attention_width


def layer_backward_flops_per_token(matrix_numel: int, attention_width: int, seq_len: int) -> float:
    """Backward FLOPs of one decoder layer per token (without recomputation)."""
    return (
        MATMUL_BACKWARD_FACTOR * 2.0 * matrix_numel
        + ATTENTION_BACKWARD_FACTOR * 2.0 * seq_len * attention_width
    )


# ---- a cooperative Newton-Schulz (see [Note: a cooperative Newton-Schulz]) -----------------

# n x n exchanges of one split Gram iteration: about four products an iteration (R², Z Q and the
# two of (aI + Z) R (aI + Z)), five iterations, each product's row blocks all-gathered.
COOPERATIVE_SQUARE_EXCHANGES = 20
COOPERATIVE_GRAM_ALL_REDUCES = 2  # the first Gram matrix and the one after the restart


def cooperative_ns_ms(
    table: Mapping[tuple[int, int], float],
    shape: tuple[int, int],
    ranks: int,
    link: Link,
    *,
    split_square_work: bool,
) -> float:
    """Milliseconds of one matrix's Newton-Schulz shared by ``ranks`` ranks on ``link``:
    each rank's share of the FLOPs at the table's rate for that much work, plus the exchanges
    (fp16, as the iteration)."""
    short, long = min(shape), max(shape)
    x_side = 6.0 * short * short * long
    square_side = 14.0 * short**3
    if ranks == 1:
        return ns_time_of_flops(table, x_side + square_side)
    gram_bytes = NS_INPUT_BYTES_PER_ELEMENT * short * short
    exchanges = COOPERATIVE_GRAM_ALL_REDUCES * collective_ms("all_reduce", gram_bytes, ranks, link)
    if split_square_work:
        flops = (x_side + square_side) / ranks
        exchanges += COOPERATIVE_SQUARE_EXCHANGES * collective_ms(
            "all_gather", gram_bytes, ranks, link
        )
    else:
        flops = x_side / ranks + square_side
    return ns_time_of_flops(table, flops) + exchanges
