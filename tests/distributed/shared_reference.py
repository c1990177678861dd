"""The single-process reference trained once per scenario instead of once per rank.

Where every rank trains the same reference on the same batch, the first rank alone runs the
step and the others receive the reference's weights: one broadcast of all of them over the
default group, exact, so every rank then compares against bit-identical reference weights. The
CPU goes to the ranks under test instead of to a copy of the reference on each (a third of a
4-rank scenario's CPU time). Only the weights travel, and what the step returns when asked: what
else a step leaves (optimizer state, gradients) stays on the first rank.

Also here: the plain reference step (loss, optional clip, optimizer step) that scenarios share.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.models import loss_fn


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


def plain_reference_step(
    reference: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    clip_max_norm: float | None = None,
) -> None:
    """One training step of ``reference`` on ``batch`` (``models.loss_fn``), its gradients clipped
    to ``clip_max_norm`` first when given."""
    loss_fn(reference, batch).backward()
    if clip_max_norm is not None:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_max_norm)
    optimizer.step()
    optimizer.zero_grad()
