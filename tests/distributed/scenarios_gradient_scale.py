"""Scenarios of the gradient divide factor: gradients summed over the data-parallel ranks.

Each runs on every rank of a gloo pool. The loss is torchtitan's: each rank's cross-entropy
summed over its tokens and divided by the token count of the whole batch, so the gradients must
be *summed* over the ranks (FSDP2's ``set_gradient_divide_factor(1.0)``) to equal the
single-process reference's on the full batch (its loss, the sum over every token divided by the
same count, is the plain mean). Weights, the total gradient norm ``dmuon.clip_grad_norm_``
returns and the clipped step are compared with the reference after every step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.testing import dedicate_and_shard
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import batches, proj_predicate, rank_rows
from tests.distributed.reference_errors import relative_errors_to
from tests.distributed.scenarios_protocol import (
    TrainConfig,
    build_reference,
    make_model,
    relative_errors,
)
from tests.distributed.shared_reference import step_on_first_rank


def summed_loss(model, tokens: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """torchtitan's loss: the cross-entropy summed over ``tokens``, over the batch's count."""
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:].reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="sum")
    return total / global_tokens


def sum_over_ranks_in_fsdp(model) -> None:
    """FSDP2 sums (factor 1.0) on every module, as torchtitan's disable_fsdp_gradient_division.

    gloo has no PREMUL_SUM, which FSDP2 reduces with for a factor other than its group size:
    forcing plain SUM reductions (then a division by the factor, 1.0) is the CPU workaround."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _muon(model):
    return dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )


def train_summing_gradients(
    *,
    replicas: int = 1,
    micro_batches: int = 1,
    clip_max_norm: float | None = None,
    set_through: str = "fsdp",
    steps: int = 4,
) -> dict:
    """FSDP2 (or HSDP with ``replicas`` > 1) with gradients summed over the ranks, against the
    reference; ``set_through`` is "fsdp" (each FSDP module's own method, dmuon follows it) or
    "dmuon" (``dmuon.set_gradient_divide_factor(model, 1.0)``, which sets them too)."""
    config = TrainConfig(replicas=replicas, steps=steps, clip_max_norm=clip_max_norm)
    model = make_model(config)
    dedicate_and_shard(model, "cpu", replicas, reshard_after_forward=True)
    if set_through == "dmuon":
        dmuon.set_gradient_divide_factor(model, 1.0)
    sum_over_ranks_in_fsdp(model)
    optimizer = _muon(model)
    reference, reference_optimizer = build_reference(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    max_errors, norms = [], []
    for batch in batches(steps, world):
        global_tokens = batch[:, 1:].numel()
        micro = rank_rows(batch, rank, world).chunk(micro_batches)
        for index, chunk in enumerate(micro):
            last = index == len(micro) - 1
            with contextlib.nullcontext() if last else dmuon.no_sync(model):
                summed_loss(model, chunk, global_tokens).backward()
        if clip_max_norm is not None:
            norm = dmuon.clip_grad_norm_(model, optimizer, clip_max_norm)
        optimizer.step()
        optimizer.zero_grad()
        expected = step_on_first_rank(
            reference,
            _summed_reference_step,
            reference,
            reference_optimizer,
            batch,
            global_tokens,
            clip_max_norm,
            share_result=True,
        )
        if clip_max_norm is not None:
            norms.append((norm.item(), expected))
        max_errors.append(max(relative_errors_to(model, reference).values()))
    return {"max_errors": max_errors, "norms": norms}


def _summed_reference_step(
    reference, optimizer, batch, global_tokens: int, clip_max_norm
) -> float | None:
    """The reference's step on the summed loss; its gradient norm before clipping, if clipped."""
    summed_loss(reference, batch, global_tokens).backward()
    norm = None
    if clip_max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_max_norm).item()
    optimizer.step()
    optimizer.zero_grad()
    return norm


def train_ddp_summing_gradients(*, steps: int = 4) -> dict:
    """DDP whose comm hook sums, and ``dmuon.set_gradient_divide_factor(model, 1.0)``."""
    config = TrainConfig(steps=steps)
    model = make_model(config)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    dmuon.dedicate_params(model, mesh, proj_predicate)
    ddp_model = DistributedDataParallel(model, process_group=mesh.get_group())
    ddp_model.register_comm_hook(mesh.get_group(), _sum_comm_hook)
    dmuon.set_gradient_divide_factor(model, 1.0)
    optimizer = _muon(model)
    reference, reference_optimizer = build_reference(config)
    rank = dist.get_rank()
    max_errors = []
    for batch in batches(steps, world):
        global_tokens = batch[:, 1:].numel()
        summed_loss(ddp_model, rank_rows(batch, rank, world), global_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        summed_loss(reference, batch, global_tokens).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        max_errors.append(max(relative_errors(_ddp_weights(model), reference).values()))
    return {"max_errors": max_errors}


def _sum_comm_hook(group, bucket):
    """A DDP comm hook that sums the bucket over the group (DDP's default averages)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def _ddp_weights(model) -> dict[str, torch.Tensor]:
    from dmuon.hooks import get_dedicated_state

    state = get_dedicated_state(model)
    weights = {p.fqn: p.master.detach().clone() for p in state.iter_owned_masters()}
    for name, param in model.named_parameters():
        if name not in state.params:
            weights[name] = param.detach().clone()
    return weights


def mixed_divide_factors(case: str) -> str:
    """The factor set on some FSDP modules only, or conflicting with dmuon's: the message."""
    config = TrainConfig(replicas=1)
    model = make_model(config)
    dedicate_and_shard(model, "cpu", replicas=1, reshard_after_forward=True)
    try:
        if case == "root_only_before_muon":  # FSDP2's method does not recurse
            model.set_gradient_divide_factor(1.0)
            _muon(model)
        elif case == "layers_only_after_muon":
            optimizer = _muon(model)
            sum_over_ranks_in_fsdp(model.layers)
            batch = batches(1, dist.get_world_size())[0]
            rows = rank_rows(batch, dist.get_rank(), dist.get_world_size())
            summed_loss(model, rows, batch[:, 1:].numel()).backward()
            optimizer.step()
        elif case == "changed_after_dmuon":
            dmuon.set_gradient_divide_factor(model, 1.0)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(2.0)
            _muon(model)
        elif case == "not_positive":
            dmuon.set_gradient_divide_factor(model, 0.0)
    except ValueError as error:
        return str(error)
    return "no error"
