"""Scenarios for the dmuon-tools summaries, run on every rank of a gloo pool.

Each trains the tiny decoder of ``tests/distributed/models.py`` exactly like the protocol tests
(dedicate_params + fully_shard + dmuon.Muon), counts the c10d ops one training step really
issues, and returns them beside what the summaries say. Summaries come back as JSON text made by
``json.dumps`` without a ``default``: that they arrive at all proves they are plain JSON.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon
import dmuon.inspect
from dmuon.inspect import FORWARD_PROFILE_ENV
from dmuon.testing import TinyDecoder, proj_predicate
from tests.distributed.comm_counter import CollectiveLog
from tests.distributed.scenarios_protocol import TrainConfig, build, counted_second_step


def _measured_per_kind(log: CollectiveLog, shard_ranks: tuple, replicate_ranks: tuple) -> dict:
    """The broadcasts and reduces this rank issued, by axis, in summarize_comm_plan's terms."""
    kinds = {
        ("broadcast", shard_ranks): "shard_broadcast",
        ("reduce", shard_ranks): "shard_reduce",
        ("broadcast", replicate_ranks): "replicate_publish",
        ("reduce", replicate_ranks): "replicate_reduce",
    }
    per_kind = {
        kind: {"collectives": 0, "payload_bytes": 0, "sent_bytes": 0, "received_bytes": 0}
        for kind in kinds.values()
    }
    unexpected = []
    for call in log.calls:
        if call.kind not in ("broadcast", "reduce"):
            continue  # FSDP2's all-gathers, reduce-scatters and all-reduces
        kind = kinds.get((call.kind, call.group_ranks))
        if kind is None:
            unexpected.append((call.kind, call.group_ranks))
            continue
        entry = per_kind[kind]
        entry["collectives"] += 1
        entry["payload_bytes"] += call.nbytes
        if call.kind == "broadcast":
            entry["sent_bytes" if call.is_root else "received_bytes"] += call.nbytes
        elif call.is_root:
            entry["received_bytes"] += call.nbytes * (len(call.group_ranks) - 1)
        else:
            entry["sent_bytes"] += call.nbytes
    return {"per_kind": per_kind, "unexpected": unexpected}


def one_step_against_the_summaries(**kwargs) -> dict:
    """Summaries of a trained model and the collectives of one step (after a warm-up step)."""
    os.environ[FORWARD_PROFILE_ENV] = "1"
    try:
        config = TrainConfig(**kwargs)
        model, optimizer, _ = build(config)
    finally:
        del os.environ[FORWARD_PROFILE_ENV]  # the worker process serves later scenarios
    log = counted_second_step(model, optimizer, config)
    grid = dmuon.inspect.view(model).grid
    shard_ranks = tuple(grid.rank_grid[grid.coord.replicate])
    replicate_ranks = tuple(row[grid.coord.shard] for row in grid.rank_grid)
    return {
        "rank": dist.get_rank(),
        "comm_plan": json.dumps(dmuon.summarize_comm_plan(model)),
        "param_groups": json.dumps(dmuon.summarize_param_groups(model, optimizer)),
        "profile": json.dumps(dmuon.collect_forward_unshard_profile(model)),
        "measured": _measured_per_kind(log, shard_ranks, replicate_ranks),
    }


def fsdp2_compute_dtypes_of_a_mixed_precision_model() -> dict:
    """The tiny decoder with its layers computed in bf16 by FSDP2's mixed precision and its root
    in the parameters' fp32: what ``dmuon.inspect.fsdp2_compute_dtypes`` and the param-group
    summary say of each FSDP2 parameter."""
    torch.manual_seed(0)
    model = TinyDecoder()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dmuon.dedicate_params(model, mesh, proj_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.01)
    name_of = {id(param): name for name, param in model.named_parameters()}
    summary = dmuon.summarize_param_groups(model, optimizer)
    return {
        "inspect": {
            name_of[key]: str(dtype)
            for key, dtype in dmuon.inspect.fsdp2_compute_dtypes(model).items()
        },
        "summary": {
            name: entry["param_dtype"]
            for name, entry in summary["params"].items()
            if entry["fsdp2"]
        },
    }
