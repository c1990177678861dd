"""Row blocks: matrices that Newton-Schulz orthogonalises block by block (per attention head,
or q / k / v of a fused projection) instead of whole.

Owns ``dedicate_params(row_blocks=...)``: which dedicated matrices are split, into which row
blocks, checked against their shapes and routes. Must not touch tensors or issue collectives:
the answer is a pure function of names, shapes and the option, so every rank decides alike (and
``dedicate_params`` compares it across ranks with its other inputs).

[Note: row blocks]
A Muon matrix W (m, n) with row blocks (b_1, ..., b_k), Σ b_i = m, is updated as if each block
W[r_i : r_i + b_i] were a parameter of its own: its momentum rows (momentum is element-wise, so
nothing changes there), its own Newton-Schulz, its own learning-rate scale of shape (b_i, n)
and, with NorMuon, its own rescale. For q_proj of h heads of d rows, ``row_blocks=d`` gives h
blocks of (d, n). For a fused QKV of (q_rows + 2·kv_rows, n), ``row_blocks=[q_rows, kv_rows,
kv_rows]`` splits q, k and v; a list of per-head sizes splits both. The cost of Newton-Schulz
falls from ``6·min²·max + 14·min³`` of the whole to the sum over the blocks: for h heads of a
square matrix between h and h² times less (32 heads of (128, 4096): 99x); the partition's cost
model counts the blocks (``partition.ParamSpec.row_blocks``). Not for expert stacks nor tensor-parallel matrices
(refused with a message); only rows (a head's columns of o_proj are not a row block).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence

from torch import nn

from dmuon.routing import MUON_ROUTE

RowBlocks = Mapping[str, int | Sequence[int]] | Callable[[str, nn.Parameter], object]
"""``dedicate_params(row_blocks=...)``: ``{fqn or glob pattern: rows per block | [sizes]}`` or
``(name, param) -> rows per block | [sizes] | None``."""


def resolve_row_blocks(
    row_blocks: RowBlocks | None,
    selected: Sequence[tuple[str, nn.Module, str, nn.Parameter]],
    overrides: Mapping[str, str],
    stacked: Sequence[str],
    tp_sharded: Sequence[str],
) -> dict[str, tuple[int, ...]]:
    """Canonical FQN -> its row-block sizes, for the selected matrices ``row_blocks`` splits
    into more than one block. Raises ValueError or TypeError naming the parameter and the fix."""
    if row_blocks is None:
        return {}
    if not callable(row_blocks) and not isinstance(row_blocks, Mapping):
        raise TypeError(
            "dedicate_params: row_blocks must be a dict {fqn or glob pattern: rows per block or "
            "[block sizes]} or a function (name, param) -> rows per block | [sizes] | None, got "
            f"{type(row_blocks).__name__}: {row_blocks!r}."
        )
    muon = {
        name: param
        for name, _, _, param in selected
        if overrides.get(name, MUON_ROUTE if param.ndim >= 2 else None) == MUON_ROUTE
    }
    wanted: dict[str, object] = {}
    if callable(row_blocks):
        for name, param in muon.items():
            spec = row_blocks(name, param)
            if spec is not None:
                wanted[name] = spec
    else:
        for pattern, spec in row_blocks.items():
            matches = [name for name in muon if fnmatch.fnmatchcase(name, pattern)]
            if not matches:
                raise ValueError(
                    f"dedicate_params: row_blocks pattern {pattern!r} matches no dedicated "
                    "matrix on the Muon route. Use canonical names as in "
                    "model.named_parameters() (glob patterns allowed: 'layers.*.q_proj.weight')."
                )
            for name in matches:
                wanted.setdefault(name, spec)  # the first matching pattern wins
    resolved = {}
    for name, spec in wanted.items():
        param = muon[name]
        if name in stacked:
            raise ValueError(
                f"dedicate_params: row_blocks splits {name}, an expert stack "
                f"{tuple(param.shape)}; row blocks apply to plain matrices only. Leave it out of "
                "row_blocks (each expert already gets its own Newton-Schulz)."
            )
        if name in tp_sharded:
            raise ValueError(
                f"dedicate_params: row_blocks splits {name}, a tensor-parallel matrix; row "
                "blocks are not supported with tensor parallelism yet. Leave it out of "
                "row_blocks."
            )
        blocks = block_sizes(name, tuple(param.shape), spec)
        if len(blocks) > 1:
            resolved[name] = blocks
    return resolved


def block_sizes(name: str, shape: tuple[int, ...], spec: object) -> tuple[int, ...]:
    """The row-block sizes ``spec`` (rows per block, or the sizes) gives a ``shape`` matrix."""
    rows = shape[0]
    where = f"dedicate_params: row_blocks of {name} {shape}"
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1 or rows % spec:
            raise ValueError(
                f"{where}: {spec} rows per block must be >= 1 and divide its {rows} rows; give "
                "the head dim, or a list of block sizes summing to the rows."
            )
        return (spec,) * (rows // spec)
    if isinstance(spec, (list, tuple)) and all(
        isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in spec
    ):
        if sum(spec) != rows:
            raise ValueError(
                f"{where}: the block sizes {list(spec)} sum to {sum(spec)}, not its {rows} rows."
            )
        return tuple(spec)
    raise TypeError(
        f"{where}: expected rows per block (an int) or a list of block sizes (ints >= 1), "
        f"got {spec!r}."
    )
