"""``summarize_comm_plan`` of an expert-parallel model, run on every rank of a gloo pool.

The model is ``scenarios_expert_parallel``'s (experts split over an ``ep`` dim, dedicated with
``dedicate_params(..., ep_mesh=, expert_mesh=)``). One training step is counted after a warm-up
one, and every broadcast and reduce is sorted by the group it ran on, named from the meshes the
model was built with (not from dmuon): the dense shard group, the EP slot's expert-FSDP group,
or the replicate group. The summary comes back as JSON text, as in ``scenarios_tools``.
"""

from __future__ import annotations

import json

import torch.distributed as dist

import dmuon
from dmuon_tools.comm_plan import COLLECTIVE_KINDS, summarize_comm_plan
from tests.distributed import scenarios_expert_parallel
from tests.distributed.comm_counter import count_collectives
from tests.distributed.models import batches, loss_fn, rank_rows

FIELDS = ("collectives", "payload_bytes", "sent_bytes", "received_bytes")


def _ranks_of(mesh) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(mesh.get_group()))


def _train_step(model, optimizer, batch) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn(model, rank_rows(batch, rank, world)).backward()
    optimizer.step()
    optimizer.zero_grad()


def one_step_against_the_comm_plan(**kwargs) -> dict:
    """The comm plan and the collectives of one step, per kind: the estimate's kinds, each
    measured on the group it must run on (``shard_*`` on the dense shard group for the other
    matrices and on the EP slot's expert-FSDP group for the experts, ``replicate_*`` on the
    replicate group, the same ranks for both)."""
    config = scenarios_expert_parallel.EPConfig(**kwargs)
    model, optimizer, _ = scenarios_expert_parallel.build(config)
    dense, sparse = scenarios_expert_parallel.meshes(config)
    groups = {
        "dense_shard": _ranks_of(dense["shard"]),
        "expert_shard": _ranks_of(sparse["efsdp"]),
        "replicate": _ranks_of(dense["replicate"]),
    }
    first, second = batches(2, dist.get_world_size())
    _train_step(model, optimizer, first)
    with count_collectives() as log:
        _train_step(model, optimizer, second)
        dmuon.wait_all_replicate_broadcasts(model)
    kinds = {
        ("broadcast", groups["dense_shard"]): "shard_broadcast",
        ("reduce", groups["dense_shard"]): "shard_reduce",
        ("broadcast", groups["expert_shard"]): "shard_broadcast",
        ("reduce", groups["expert_shard"]): "shard_reduce",
        ("broadcast", groups["replicate"]): "replicate_publish",
        ("reduce", groups["replicate"]): "replicate_reduce",
    }
    measured = {kind: dict.fromkeys(FIELDS, 0) for kind in COLLECTIVE_KINDS}
    unexpected = []
    for call in log.calls:
        if call.kind not in ("broadcast", "reduce"):
            continue  # FSDP2's all-gathers and reduce-scatters, the tokens' all-to-all
        kind = kinds.get((call.kind, call.group_ranks))
        if kind is None:
            unexpected.append((call.kind, call.group_ranks))
            continue
        entry = measured[kind]
        entry["collectives"] += 1
        entry["payload_bytes"] += call.nbytes
        if call.kind == "broadcast":
            entry["sent_bytes" if call.is_root else "received_bytes"] += call.nbytes
        elif call.is_root:
            entry["received_bytes"] += call.nbytes * (len(call.group_ranks) - 1)
        else:
            entry["sent_bytes"] += call.nbytes
    return {
        "rank": dist.get_rank(),
        "groups": groups,
        "comm_plan": json.dumps(summarize_comm_plan(model)),
        "measured": measured,
        "unexpected": unexpected,
    }
