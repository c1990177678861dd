"""One global gradient norm (and clip) over everything a ``dmuon.Muon`` optimizer updates.

Owns ``dmuon.clip_grad_norm_``, the dmuon counterpart of ``torch.nn.utils.clip_grad_norm_``
(dmuon-hf's Trainer logs and clips with it). It must not move weights or gradients between
ranks: it reads the gradients where they already are and scales them in place.

The gradients of a dmuon model live in three kinds of places, each counted exactly once:

- the owners' fp32 masters of the dedicated parameters: plain tensors, each on exactly one rank
  of dmuon's world group, so their squared norms are summed over that group; the master of a
  tensor-parallel matrix holds one chunk on each TP rank of its owner, so those are summed over
  the TP ranks too (a plain matrix's master is the same on every TP rank: counted once);
- FSDP2's sharded gradients: DTensors, whose norm each mesh reduces by itself;
- on the DDP + TP path, the local chunks of the parameters ``parallelize_module`` sharded:
  torch's DDP recipe (``_pre_dp_module_transform``) keeps them as plain tensors that remember
  their DTensor layout (``_st_info``), so their norm is taken as that DTensor's;
- plain tensors of parameters neither dedicated nor sharded: the same on every rank, counted
  once.

``model.parameters()`` alone would miss the masters (they are not module parameters), which is
why ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` is wrong for a dmuon model.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from dmuon import collectives
from dmuon.hooks import get_dedicated_state


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / total_norm)``; return the pre-clip norm.

    ``max_norm=float("inf")`` only computes the norm. With ``error_if_nonfinite=True`` a NaN or
    infinite total norm raises (on every rank: the norm is the same everywhere) before any
    gradient is scaled, as in ``torch.nn.utils.clip_grad_norm_``; that reads the norm on the
    host. Collective: every rank must call it.
    """
    state = get_dedicated_state(model)
    owned_master_ids = {id(p.master) for p in state.iter_owned_masters()}
    chunk_master_ids = {id(p.master) for p in state.iter_owned_masters() if p.is_tp_sharded}
    with_grad = [
        p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    ]
    device = _device_of(optimizer)

    owned: list[torch.Tensor] = []
    chunks: list[torch.Tensor] = []  # masters of TP chunks
    sharded: dict[object, list[torch.Tensor]] = defaultdict(list)  # DTensor mesh -> params
    replicated: list[torch.Tensor] = []
    for param in with_grad:
        if id(param) in chunk_master_ids:
            chunks.append(param)
        elif id(param) in owned_master_ids:
            owned.append(param)
        elif isinstance(param.grad, DTensor):
            sharded[param.grad.device_mesh].append(param)
        elif (spec := _tensor_parallel_spec(param)) is not None:
            sharded[spec.mesh].append(param)
        else:
            replicated.append(param)

    owned_squared = _squared_norm(owned, device)
    chunks_squared = _squared_norm(chunks, device)
    # Issued on every rank, also where this rank owns nothing with a gradient.
    if state.mesh.world_group is not None:
        collectives.all_reduce(owned_squared, state.mesh.world_group).wait()
        collectives.all_reduce(chunks_squared, state.mesh.world_group).wait()
    if state.mesh.tp_group is not None:
        collectives.all_reduce(chunks_squared, state.mesh.tp_group).wait()
    squared = [owned_squared, chunks_squared, _squared_norm(replicated, device)]
    for params in sharded.values():
        norm = get_total_norm([_grad_as_dtensor(p) for p in params])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squared.append(norm.to(device, torch.float32).square())
    total_norm = torch.stack(squared).sum().sqrt()
    if error_if_nonfinite and not torch.isfinite(total_norm).item():
        raise RuntimeError(
            f"dmuon.clip_grad_norm_: the total norm of the gradients is {total_norm.item()}, so "
            "they cannot be clipped. Set error_if_nonfinite=False to clip anyway (the gradients "
            "become NaN), or use dmuon.Muon(..., nonfinite='skip') to skip such steps."
        )

    if max_norm != float("inf"):
        # One call per kind of gradient: plain tensors and each mesh's DTensors do not mix.
        for params in (owned, chunks, replicated, *sharded.values()):
            if params:
                clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm


def _tensor_parallel_spec(param: torch.Tensor):
    """The DTensor layout of a TP parameter that torch's DDP + TP recipe made a plain tensor
    (None for any other parameter, and for a replicated one, counted once as it is)."""
    spec = getattr(param, "_st_info", None)
    if spec is None or not any(placement.is_shard() for placement in spec.placements):
        return None
    return spec


def _grad_as_dtensor(param: torch.Tensor) -> torch.Tensor:
    """``param.grad`` as the DTensor it is a chunk of (FSDP2's already is one)."""
    spec = None if isinstance(param.grad, DTensor) else _tensor_parallel_spec(param)
    if spec is None:
        return param.grad
    return DTensor.from_local(
        param.grad,
        spec.mesh,
        spec.placements,
        run_check=False,
        shape=spec.shape,
        stride=spec.stride,
    )


def _squared_norm(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not params:
        return torch.zeros((), dtype=torch.float32, device=device)
    return get_total_norm([p.grad for p in params]).to(device, torch.float32).square()


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")
