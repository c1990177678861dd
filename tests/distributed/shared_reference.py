"""The single-process reference trained once per scenario instead of once per rank.

Where every rank trains the same reference on the same batch, the first rank alone runs the
step and the others receive the reference's weights: one broadcast of all of them over the
default group, exact, so every rank then compares against bit-identical reference weights. The
CPU goes to the ranks under test instead of to a copy of the reference on each (a third of a
4-rank scenario's CPU time). Only the weights travel, and what the step returns when asked: what else a step leaves
(optimizer state, gradients) stays on the first rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def step_on_first_rank(
    reference: nn.Module, step: Callable[..., object], *args, share_result: bool = False
) -> object:
    """Run ``step(*args)`` (a training step of ``reference``) on rank 0, then give every rank
    ``reference``'s weights, and with ``share_result`` what ``step`` returned (a loss, a norm;
    None without). Collective over the default group."""
    result = step(*args) if dist.get_rank() == 0 else None
    if share_result:
        shared = [result]
        dist.broadcast_object_list(shared, src=0)
        result = shared[0]
    params = list(reference.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    if dist.get_rank() != 0:
        with torch.no_grad():
            for param, value in zip(params, flat.split([p.numel() for p in params])):
                param.copy_(value.view_as(param))
    return result
