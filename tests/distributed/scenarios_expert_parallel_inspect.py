"""What ``optimizer.routing()`` and ``dmuon.inspect.newton_schulz_table`` say of an
expert-parallel model, on every rank of a gloo pool.

The model is ``scenarios_expert_parallel``'s (ep=2 x efsdp=2 on 4 ranks): a rank holds only its
EP slot's experts of each stack, while the routing table promises the same rows on every rank.
"""

from __future__ import annotations

import torch.distributed as dist

import dmuon.inspect
from dmuon.hooks import get_dedicated_state
from tests.distributed import scenarios_expert_parallel
from tests.distributed.models import batches, loss_fn, rank_rows


def routing_and_table(steps: int = 2) -> dict:
    """The routing rows (as plain tuples) and the Newton-Schulz table after ``steps`` steps."""
    config = scenarios_expert_parallel.EPConfig()
    model, optimizer, owners = scenarios_expert_parallel.build(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in batches(steps, world):
        loss_fn(model, rank_rows(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = get_dedicated_state(model)
    return {
        "rank": rank,
        "rows": [tuple(row) for row in optimizer.routing()],
        "table": dmuon.inspect.newton_schulz_table(optimizer),
        # this rank's pieces with their owners, as dedicate_params decided them
        "local_owners": {name: state.mesh.global_rank(c) for name, c in owners.items()},
    }
