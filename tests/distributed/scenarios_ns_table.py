"""The Newton-Schulz counts gathered from their owners (``dmuon.inspect.
owners_newton_schulz_counts``) and the table printed beside the routing table (``dmuon.inspect.
newton_schulz_table``), after a few optimizer steps on every rank of a gloo pool.

Each scenario returns this rank's own counts with the gathered ones and the table, so the test
compares the gathered counts with the sum of every rank's own (the reference) and with the steps
taken.
"""

from __future__ import annotations

import torch.distributed as dist

import dmuon.inspect
from tests.distributed import scenarios_update_rules
from tests.distributed.models import batches, loss_fn, rank_rows


def gathered(steps: int, replicas: int = 1, row_blocks: bool = False) -> dict:
    """``steps`` optimizer steps of ``scenarios_update_rules``'s model (its row blocks if
    ``row_blocks``): this rank's counts, the gathered counts and the table."""
    model, optimizer = scenarios_update_rules.build(replicas, row_blocks)
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in batches(steps, world, per_rank=2):
        loss_fn(model, rank_rows(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "own": dmuon.inspect.newton_schulz_counts(optimizer),
        "gathered": dmuon.inspect.owners_newton_schulz_counts(optimizer),
        "table": dmuon.inspect.newton_schulz_table(optimizer),
        "muon": [row.fqn for row in optimizer.routing() if row.route == "muon"],
    }
