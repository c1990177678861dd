"""Partition what-ifs: who would own what for a model config on a G x R mesh, and how long the
optimizer's Newton-Schulz would take on each rank.

Owns the ``dmuon-tools plan`` report: the decoder's matrices (an (E, m, n) expert stack planned as
dmuon plans it: E matrices (m, n), cut into expert slices), ``dmuon.inspect.plan_ownership`` on
the owner grid (the same pure function ``dedicate_params`` runs), the per-owner load and, with a
measured NS time table, the predicted NS time per rank. Pure and fast: no model, no tensors, no
process group, so 10,000-rank what-ifs take well under a second.

The plan keeps a list per owner slot, so a mesh of more than ``MAX_OWNER_SLOTS`` owners is refused
before any work (a billion-slot what-if would need tens of GB): no real cluster comes near it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from dmuon.inspect import (
    DEFAULT_SMALL_PARAM_NUMEL,
    WHAT_IF_RANK_FORMULA,
    OwnershipPlan,
    ParamSpec,
    layer_id_of,
    ns_cost,
    plan_ownership,
    what_if_grid,
)
from dmuon_tools.model_shapes import DecoderShape
from dmuon_tools.ns_table import NSTimeTable, format_shape, shape_key
from dmuon_tools.owner_load import params_per_slot, summarize_owner_loads

MAX_OWNER_SLOTS = 1_000_000  # G x R above this is refused (a 1M-slot plan takes ~4 s, 0.6 GB)
_MESH = re.compile(r"\s*([0-9]+)\s*(?:[x×*]\s*([0-9]+)\s*)?")
PREDICTION_NOTE = (
    "Sum of the measured median Newton-Schulz time of each matrix a rank owns, one call per "
    "matrix: batched same-shape calls run faster, and momentum, the update and communication are "
    "not included. The step waits for the slowest owner (max_ms)."
)


def parse_mesh(text: str) -> tuple[int, int]:
    """``"8x16"`` -> (8 shards, 16 replicas); ``"8"`` -> (8, 1)."""
    match = _MESH.fullmatch(text)
    if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
        raise ValueError(
            f"--mesh {text!r} is not GxR or G with positive integers: use e.g. --mesh 8x16 "
            "(8 shards per replica, 16 replicas) or --mesh 64 (one replica of 64 shards)."
        )
    num_shards, num_replicas = int(match.group(1)), int(match.group(2) or 1)
    if num_shards * num_replicas > MAX_OWNER_SLOTS:
        raise ValueError(
            f"--mesh {text!r} has {num_shards * num_replicas:,} owners (G={num_shards:,} x "
            f"R={num_replicas:,}), more than the {MAX_OWNER_SLOTS:,} a what-if plans (the plan "
            "keeps a list per owner); use a mesh of at most that many GPUs."
        )
    return num_shards, num_replicas


def plan_decoder(
    shape: DecoderShape,
    num_shards: int,
    num_replicas: int = 1,
    *,
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL,
) -> OwnershipPlan:
    """The ownership plan ``dedicate_params`` would make for the decoder's projections and
    expert stacks."""
    specs = [
        ParamSpec(name=name, shape=dims, layer_id=layer_id_of(name), expert_stack=len(dims) == 3)
        for name, dims in shape.matrices()
    ]
    return plan_ownership(specs, num_shards, num_replicas, small_param_numel=small_param_numel)


def matrix_counts(shapes: Mapping[str, Sequence[int]]) -> Counter[tuple[int, ...]]:
    """How many matrices of each shape: an (E, m, n) expert stack counts as E matrices (m, n)."""
    counts: Counter[tuple[int, ...]] = Counter()
    for dims in shapes.values():
        if len(dims) == 3:
            counts[tuple(dims[1:])] += dims[0]
        else:
            counts[tuple(dims)] += 1
    return counts


def _owned_matrices(
    plan: OwnershipPlan, shapes: Mapping[str, Sequence[int]]
) -> list[tuple[int, tuple[int, ...], int]]:
    """``(slot, matrix shape, number of matrices)`` of every entry of ``plan.owners``.

    ``plan.owners`` follows the order of the planned specs (``shapes``' order), an expert stack
    replaced by its slices (``<name>[start:stop]``) in expert order, so the two are walked
    together; an entry out of step means ``shapes`` is not what was planned.
    """
    entries = iter(plan.owners.items())
    owned = []
    for name, dims in shapes.items():
        slices = plan.expert_slices.get(name)
        for start, stop in slices or ((0, 1),):
            planned, owner = next(entries, (None, None))
            in_step = planned == name if slices is None else str(planned).startswith(f"{name}[")
            if owner is None or not in_step:
                raise ValueError(
                    f"the plan's entry {planned!r} does not match the matrix {name!r}; pass the "
                    "shapes in the order they were planned (DecoderShape.matrices())."
                )
            matrix = tuple(dims[1:]) if slices is not None else tuple(dims)
            owned.append((plan.slot_of(owner), matrix, stop - start))
    return owned


def predict_optimizer_ms(
    plan: OwnershipPlan,
    shapes: Mapping[str, Sequence[int]],
    table: NSTimeTable,
    *,
    heaviest: int = 5,
) -> dict[str, Any]:
    """Predicted Newton-Schulz milliseconds per owner rank: the sum over the matrices it owns
    (an expert slice of k experts: k matrices)."""
    counts: Counter[tuple[int, int]] = Counter()
    for dims, count in matrix_counts(shapes).items():
        counts[shape_key(dims)] += count
    lookups = {key: table.lookup(key) for key in counts}
    per_slot_ms = [0.0] * plan.num_slots
    for slot, matrix, count in _owned_matrices(plan, shapes):
        per_slot_ms[slot] += lookups[shape_key(matrix)].ms * count
    owned = params_per_slot(plan)
    grid = what_if_grid(plan.num_shards, plan.num_replicas)
    order = sorted(range(plan.num_slots), key=lambda slot: (-per_slot_ms[slot], slot))
    one_rank_ms = math.fsum(lookups[key].ms * count for key, count in counts.items())
    slowest = max(per_slot_ms)
    shape_entries = [
        {
            "shape": format_shape(key),
            "count": counts[key],
            "ms_each": lookups[key].ms,
            "table_shape": format_shape(lookups[key].table_shape),
            "scaled": lookups[key].scaled,
            "flop_ratio": ns_cost(key) / ns_cost(lookups[key].table_shape),
        }
        for key in sorted(counts)
    ]
    return {
        "note": PREDICTION_NOTE,
        "table": table.source,
        "candidate": table.candidate,
        "device": table.device,
        "max_ms": slowest,
        "mean_ms": math.fsum(per_slot_ms) / plan.num_slots,
        "min_ms": min(per_slot_ms),
        # Naive Muon runs every matrix's Newton-Schulz on every rank.
        "every_matrix_on_one_rank_ms": one_rank_ms,
        "speedup_over_redundant": one_rank_ms / slowest if slowest > 0 else None,
        "heaviest": [
            {
                "slot": slot,
                "rank": grid.owner_rank(plan.owner_of_slot(slot)),
                "shard": plan.owner_of_slot(slot).shard,
                "replicate": plan.owner_of_slot(slot).replicate,
                "ms": per_slot_ms[slot],
                "num_params": len(owned[slot]),
            }
            for slot in order[: max(heaviest, 0)]
        ],
        "shapes": shape_entries,
        "scaled_shapes": [entry["shape"] for entry in shape_entries if entry["scaled"]],
    }


def plan_report(
    shape: DecoderShape,
    num_shards: int,
    num_replicas: int = 1,
    *,
    table: NSTimeTable | None = None,
    heaviest: int = 5,
    every_owner: bool = False,
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL,
) -> dict[str, Any]:
    """The ``dmuon-tools plan`` report as plain JSON."""
    matrices = dict(shape.matrices())
    plan = plan_decoder(shape, num_shards, num_replicas, small_param_numel=small_param_numel)
    shape_counts = matrix_counts(matrices)
    return {
        "model": {
            "name": shape.name,
            "description": shape.describe(),
            "num_matrices": sum(shape_counts.values()),
            "num_expert_stacks": sum(1 for dims in matrices.values() if len(dims) == 3),
            "numel": sum(math.prod(dims) for dims in matrices.values()),
            "shapes": [
                {"shape": format_shape(dims), "count": count}
                for dims, count in shape_counts.items()
            ],
        },
        "mesh": {
            "num_shards": num_shards,
            "num_replicas": num_replicas,
            "num_slots": num_shards * num_replicas,
            "rank_formula": WHAT_IF_RANK_FORMULA,
        },
        "partition": plan.describe(),
        "load": summarize_owner_loads(plan, heaviest=heaviest, every_owner=every_owner),
        "predicted_ns": (
            predict_optimizer_ms(plan, matrices, table, heaviest=heaviest)
            if table is not None
            else None
        ),
    }


def format_report(report: Mapping[str, Any]) -> str:
    """The report as the lines ``dmuon-tools plan`` prints."""
    model, mesh, load = report["model"], report["mesh"], report["load"]
    shapes = ", ".join(f"{s['count']} x {s['shape']}" for s in model["shapes"])
    lines = [
        f"model {model['description']}",
        f"  {model['num_matrices']} matrices"
        + (
            f" ({stacks} expert stacks of E matrices each)"
            if (stacks := model["num_expert_stacks"])
            else ""
        )
        + f", {model['numel'] / 1e9:.2f} B elements: {shapes}",
        f"mesh G={mesh['num_shards']} shards x R={mesh['num_replicas']} replicas = "
        f"{mesh['num_slots']} owners; {mesh['rank_formula']}",
        report["partition"],
        f"owner load (GFLOP): min {load['min_gflop']:,.1f}, mean {load['mean_gflop']:,.1f}, "
        f"max {load['max_gflop']:,.1f}; imbalance {load['imbalance']:.3f}; "
        f"{load['owners_without_params']} owners own nothing",
        "heaviest owners:",
    ]
    for entry in load["heaviest"]:
        names = entry["params"]
        shown = ", ".join(names[:3]) + (f", ... {len(names) - 3} more" if len(names) > 3 else "")
        lines.append(
            f"  rank {entry['rank']} (shard {entry['shard']}, replicate {entry['replicate']}): "
            f"{entry['gflop']:,.1f} GFLOP, {entry['num_params']} params: {shown or '-'}"
        )
    predicted = report.get("predicted_ns")
    if predicted is not None:
        measured = ", ".join(str(x) for x in (predicted["candidate"], predicted["device"]) if x)
        source = "; ".join(x for x in (measured, str(predicted["table"])) if x)
        speedup = predicted["speedup_over_redundant"]
        lines += [
            f"predicted Newton-Schulz time per rank ({source}):",
            f"  max {predicted['max_ms']:.2f} ms, mean {predicted['mean_ms']:.2f} ms, "
            f"min {predicted['min_ms']:.2f} ms; every matrix on one rank "
            f"{predicted['every_matrix_on_one_rank_ms']:.2f} ms"
            + (f" ({speedup:.1f}x the slowest owner)" if speedup else ""),
        ]
        for entry in predicted["heaviest"]:
            lines.append(
                f"  rank {entry['rank']} (shard {entry['shard']}, replicate "
                f"{entry['replicate']}): {entry['ms']:.2f} ms, {entry['num_params']} params"
            )
        for entry in predicted["shapes"]:
            origin = (
                f"SCALED from {entry['table_shape']} by FLOPs x{entry['flop_ratio']:.3f}"
                if entry["scaled"]
                else "measured"
            )
            lines.append(
                f"  {entry['count']} x {entry['shape']}: {entry['ms_each']:.3f} ms each ({origin})"
            )
        lines.append(f"  note: {predicted['note']}")
    return "\n".join(lines)
