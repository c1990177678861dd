"""One training step of the tiny decoder under ``torch.profiler`` on every rank of a gloo pool,
returning how many times each of dmuon's phase labels ([Note: profiler labels] in
``dmuon._profiler_labels``) was recorded, with what this rank's layout predicts of them: the
hook boundaries, which of them publish across replicas from this rank, the Newton-Schulz shapes
this rank owns and the optimizer's routes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.param import MUON_ROUTE
from tests.distributed import scenarios_update_rules
from tests.distributed.models import batches, loss_fn, rank_rows

STEPS = 2  # a first step (adoption, new optimizer state), then the profiled one


def profiled_step(replicas: int, overlap_step: bool = False, max_norm: float = 1.0) -> dict:
    """A first step unprofiled; then, profiled: forward, backward, ``dmuon.clip_grad_norm_``
    (``max_norm``: ``inf`` scales nothing, so the overlapped step commits what it speculated),
    ``step()``, ``zero_grad()`` and one forward without grad (the next forward, which waits for
    an asynchronous publish)."""
    model, optimizer = scenarios_update_rules.build(replicas, False, overlap_step=overlap_step)
    rank, world = dist.get_rank(), dist.get_world_size()
    first, second = (rank_rows(batch, rank, world) for batch in batches(STEPS, world))
    loss_fn(model, first).backward()
    optimizer.step()
    optimizer.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn(model, second).backward()
        ns_shapes = {
            (min(m.shape), max(m.shape))
            for group in optimizer.param_groups
            if group["route"] == MUON_ROUTE
            for m in group["params"]
            if m.grad is not None and m.numel() > 0
        }
        dmuon.clip_grad_norm_(model, optimizer, max_norm=max_norm)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            loss_fn(model, second)
    state = get_dedicated_state(model)
    return {
        "counts": {e.key: e.count for e in prof.key_averages() if e.key.startswith("dmuon::")},
        "boundaries": [group.name for group in state.boundaries],
        "publishing": [
            group.name
            for group in state.boundaries
            if any(s.is_local and s.mesh.replicate_group is not None for s in group.segments)
        ],
        "ns_shapes": len(ns_shapes),
        "routes": [group["route"] for group in optimizer.param_groups],
        "stats": optimizer.overlap_stats() if overlap_step else None,
    }
