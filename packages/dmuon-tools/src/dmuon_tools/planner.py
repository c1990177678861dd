"""Partition what-ifs: who would own what for a model config on a G x R mesh, and how long the
optimizer's Newton-Schulz would take on each rank.

Owns the ``dmuon-tools plan`` report: the decoder's matrices, ``dmuon.inspect.plan_ownership`` on
the owner grid (the same pure function ``dedicate_params`` runs), the per-owner load and, with a
measured NS time table, the predicted NS time per rank. Pure and fast: no model, no tensors, no
process group, so 10,000-rank what-ifs take well under a second.
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
    make_param_specs,
    ns_cost,
    plan_ownership,
    what_if_grid,
)
from dmuon_tools.model_shapes import DecoderShape
from dmuon_tools.ns_table import NSTimeTable, format_shape, shape_key
from dmuon_tools.owner_load import params_per_slot, summarize_owner_loads

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
    return int(match.group(1)), int(match.group(2) or 1)


def plan_decoder(
    shape: DecoderShape,
    num_shards: int,
    num_replicas: int = 1,
    *,
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL,
) -> OwnershipPlan:
    """The ownership plan ``dedicate_params`` would make for the decoder's projections."""
    specs = make_param_specs(shape.matrices())
    return plan_ownership(specs, num_shards, num_replicas, small_param_numel=small_param_numel)


def predict_optimizer_ms(
    plan: OwnershipPlan,
    shapes: Mapping[str, Sequence[int]],
    table: NSTimeTable,
    *,
    heaviest: int = 5,
) -> dict[str, Any]:
    """Predicted Newton-Schulz milliseconds per owner rank: the sum over the matrices it owns."""
    lookups = {shape_key(shape): table.lookup(shape) for shape in shapes.values()}
    counts = Counter(shape_key(shape) for shape in shapes.values())
    per_slot_ms = [0.0] * plan.num_slots
    for name, owner in plan.owners.items():
        per_slot_ms[plan.slot_of(owner)] += lookups[shape_key(shapes[name])].ms
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
    shape_counts = Counter(tuple(dims) for dims in matrices.values())
    return {
        "model": {
            "name": shape.name,
            "description": shape.describe(),
            "num_matrices": len(matrices),
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
        f"  {model['num_matrices']} matrices, {model['numel'] / 1e9:.2f} B elements: {shapes}",
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
