"""The Newton-Schulz counter (``dmuon.inspect.newton_schulz_counts``) after a few optimizer
steps on every rank of a gloo pool: gradient accumulation with and without ``dmuon.no_sync``, the
overlapped step, pipeline stages and expert stacks, also split over an ``ep`` dim.

Each scenario returns this rank's counts with what the routing table says of each matrix's owner,
so the test compares what was counted with who owns what.
"""

from __future__ import annotations

import contextlib
import warnings

import torch.distributed as dist

import dmuon
import dmuon.inspect
from tests.distributed import (
    scenarios_checkpoint,
    scenarios_expert_parallel,
    scenarios_moe,
    scenarios_pipeline,
    scenarios_update_rules,
)
from tests.distributed.models import batches, loss_fn, rank_rows

MICRO_BATCHES = 4


def _counted(optimizer) -> dict:
    return {
        "rank": dist.get_rank(),
        "counts": dmuon.inspect.newton_schulz_counts(optimizer),
        "owners": {row.fqn: row.owner_rank for row in optimizer.routing() if row.route == "muon"},
    }


def accumulated(
    steps: int,
    replicas: int = 1,
    no_sync: bool = True,
    overlap_step: bool = False,
    row_blocks: bool = False,
    nan_at_step: int | None = None,
) -> dict:
    """``steps`` optimizer steps of ``MICRO_BATCHES`` backwards each (the earlier ones under
    ``dmuon.no_sync`` if ``no_sync``); ``nan_at_step``: that step's first loss is NaN on rank 0
    (``nonfinite="skip"`` skips the step)."""
    model, optimizer = scenarios_update_rules.build(replicas, row_blocks, overlap_step=overlap_step)
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="dmuon.Muon: step")
        for step, batch in enumerate(batches(steps, world, per_rank=MICRO_BATCHES)):
            micro = rank_rows(batch, rank, world).chunk(MICRO_BATCHES)
            for index, chunk in enumerate(micro):
                quiet = no_sync and index < len(micro) - 1
                with dmuon.no_sync(model) if quiet else contextlib.nullcontext():
                    loss = loss_fn(model, chunk) / len(micro)
                    if step == nan_at_step and index == 0 and rank == 0:
                        loss = loss * float("nan")
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return {
        **_counted(optimizer),
        "stats": optimizer.overlap_stats() if overlap_step else None,
    }


def pipelined(steps: int, schedule: str = "1f1b", dp: int = 2) -> list[dict]:
    """``steps`` train steps of ``scenarios_pipeline``'s pipeline (its ``MICROBATCHES``
    micro-batches through the schedule, one clip over every stage): per stage of this rank."""
    config = scenarios_pipeline.PipelineConfig(schedule=schedule, dp=dp, steps=steps)
    pipeline = scenarios_pipeline.build_pipeline(config)
    for batch in scenarios_pipeline.data(config):
        pipeline.train_step(rank_rows(batch, pipeline.dp_rank, config.dp))
    return [_counted(optimizer) for optimizer in pipeline.optimizers]


def expert_stacks(steps: int, replicas: int = 1) -> dict:
    """``steps`` steps of ``scenarios_moe``'s model (expert stacks dedicated as one matrix per
    expert), each of ``MICRO_BATCHES`` backwards under ``dmuon.no_sync`` but the last."""
    config = scenarios_moe.MoEConfig(replicas=replicas, micro_batches=MICRO_BATCHES)
    model, runner, optimizer, _ = scenarios_moe.build(config)
    for batch in batches(steps, dist.get_world_size(), per_rank=MICRO_BATCHES):
        scenarios_moe.train_step(model, runner, optimizer, batch, config)
    return _counted(optimizer)


def tensor_parallel(steps: int, tp: int = 2) -> dict:
    """``steps`` steps of ``scenarios_checkpoint``'s dp x tp model (torch's colwise / rowwise
    plan on "tp", dmuon and FSDP2 on "dp")."""
    model, optimizer = scenarios_checkpoint.build(tp=tp)
    scenarios_checkpoint.train(model, optimizer, range(steps))
    return _counted(optimizer)


def expert_parallel(steps: int, no_sync: bool = True) -> dict:
    """``steps`` steps of ``scenarios_expert_parallel``'s model (ep=2 x efsdp=2 on 4 ranks: each
    rank holds its EP slot's experts), each of ``MICRO_BATCHES`` backwards (the earlier ones under
    ``dmuon.no_sync`` if ``no_sync``)."""
    model, optimizer, _ = scenarios_expert_parallel.build(scenarios_expert_parallel.EPConfig())
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in batches(steps, world, per_rank=MICRO_BATCHES):
        micro = rank_rows(batch, rank, world).chunk(MICRO_BATCHES)
        for index, chunk in enumerate(micro):
            quiet = no_sync and index < len(micro) - 1
            with dmuon.no_sync(model) if quiet else contextlib.nullcontext():
                (loss_fn(model, chunk) / len(micro)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _counted(optimizer)
