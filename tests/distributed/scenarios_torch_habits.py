"""Scenarios of torch's habits on a dmuon model, run on every rank of a gloo pool.

Each step a rank calls one of torch's clipping functions over ``model.parameters()`` as a torch
loop does, records what it raised, then clips with ``dmuon.clip_grad_norm_`` and steps; the
single-process reference clips with torch's ``clip_grad_norm_`` on the full model. A refusal
that left a rank inside a collective, or that scaled a gradient before raising, shows as a hang
or as weights off the reference. Collectives run for real; nothing is mocked.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.hooks import get_dedicated_state
from tests.distributed.models import batches, rank_rows
from tests.distributed.reference_errors import relative_errors_to
from tests.distributed.scenarios_protocol import (
    TrainConfig,
    build,
    build_reference,
    forward_backward,
    make_model,
)
from tests.distributed.shared_reference import step_on_first_rank

# torch's functions that read ``p.grad`` of the parameters they are given, as a loop calls them.
TORCH_CLIPPING = {
    "clip_grad_norm_": lambda params, max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm),
    "clip_grads_with_norm_": lambda params, max_norm: torch.nn.utils.clip_grads_with_norm_(
        params, max_norm, torch.tensor(1.0)
    ),
    "clip_grad_value_": lambda params, max_norm: torch.nn.utils.clip_grad_value_(params, max_norm),
}
# ... and a torch optimizer built over them, stepped.
TORCH_HABITS = {
    **TORCH_CLIPPING,
    "AdamW": lambda params, _: torch.optim.AdamW(params, lr=1e-3).step(),
}


def _reference_step(reference, optimizer, batch: torch.Tensor, config: TrainConfig) -> float:
    forward_backward(reference, batch, config)
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.clip_max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return norm.item()


def torch_clipping_then_dmuons(function: str, replicas: int = 1, steps: int = 3) -> dict:
    """Per step: torch's ``function`` (a ``TORCH_HABITS`` key) over ``model.parameters()`` (its
    error message, or None
    when it returned), then ``dmuon.clip_grad_norm_`` at a max_norm that scales, and the step.
    Returns the messages, (dmuon's norm, the reference's) per step and the max relative error
    of the weights after each step."""
    config = TrainConfig(replicas=replicas, steps=steps, clip_max_norm=0.05)
    model, optimizer, _ = build(config)
    reference, reference_optimizer = build_reference(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    messages, norms, max_errors = [], [], []
    for batch in batches(steps, world):
        forward_backward(model, rank_rows(batch, rank, world), config)
        try:
            TORCH_HABITS[function](model.parameters(), config.clip_max_norm)
            messages.append(None)
        except RuntimeError as error:
            messages.append(str(error))
        norm = dmuon.clip_grad_norm_(model, optimizer, config.clip_max_norm).item()
        optimizer.step()
        optimizer.zero_grad()
        expected = step_on_first_rank(
            reference,
            _reference_step,
            reference,
            reference_optimizer,
            batch,
            config,
            share_result=True,
        )
        norms.append((norm, expected))
        max_errors.append(max(relative_errors_to(model, reference).values()))
    return {"messages": messages, "norms": norms, "max_errors": max_errors}


def torch_clipping_of_a_plain_fsdp2_model(steps: int = 2) -> dict:
    """A model without dmuon (FSDP2 only), clipped with torch's ``clip_grad_norm_`` at a
    max_norm that scales: (its norm, the reference's) per step, and the weights' max relative
    error against the reference after the last step."""
    config = TrainConfig(steps=steps, clip_max_norm=0.05)
    model = make_model(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = make_model(config)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    norms = []
    for batch in batches(steps, world):
        forward_backward(model, rank_rows(batch, rank, world), config)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_max_norm).item()
        optimizer.step()
        optimizer.zero_grad()
        expected = step_on_first_rank(
            reference,
            _reference_step,
            reference,
            reference_optimizer,
            batch,
            config,
            share_result=True,
        )
        norms.append((norm, expected))
    expected = dict(reference.named_parameters())
    errors = [
        ((param.full_tensor() - expected[name]).norm() / expected[name].norm()).item()
        for name, param in model.named_parameters()
    ]
    return {"norms": norms, "max_error": max(errors), "finite": all(map(math.isfinite, errors))}


def torch_clip_grad_value_over_the_optimizers_parameters(clip_value: float = 1e-3) -> dict:
    """The fix the refusal gives for clipping by value: torch's ``clip_grad_value_`` over the
    optimizer's parameters (owned masters, FSDP2's shards). Returns, before and after, the
    largest absolute gradient this rank holds, and how many owned masters had a gradient."""
    config = TrainConfig()
    model, optimizer, _ = build(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    forward_backward(model, rank_rows(batches(1, world)[0], rank, world), config)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def largest_abs() -> float:
        values = []
        for p in params:
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                if grad.numel():
                    values.append(grad.abs().max().item())
        return max(values)

    before = largest_abs()
    torch.nn.utils.clip_grad_value_(params, clip_value, foreach=False)  # plain and DTensors
    return {
        "before": before,
        "after": largest_abs(),
        "masters": sum(1 for p in get_dedicated_state(model).iter_owned_masters()),
    }
