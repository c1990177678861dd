"""Scenarios of the overlapped owner step (``dmuon.Muon(..., overlap_step=True)``), on gloo.

Each trains the tiny decoder twice on every rank, from the same weights and data: once with the
plain step, once with the overlapped one, and returns both runs' owned masters, optimizer state
and losses (which the tests compare bit for bit) with the overlapped optimizer's counters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, rank_rows


@dataclass(kw_only=True)
class OverlapConfig:
    replicas: int = 1
    reshard_after_forward: bool = True
    steps: int = 4
    ns_backend: str = "gram"
    ns_dtype: str = "float32"
    micro_batches: int = 1  # > 1: gradient accumulation
    no_sync: bool = True  # the accumulation's earlier backwards under dmuon.no_sync
    clip_max_norm: float | None = None
    nan_at_step: int | None = None  # this step's loss is NaN on rank 0
    nonfinite: str = "skip"
    lr_schedule: bool = False  # a LambdaLR stepped after every optimizer step
    momentum_change_at_step: int | None = None  # the group's momentum changed before this step
    layers: int = 3  # more than SPECULATION_CHUNKS: a chunk's unit waits for several layers


def _train(config: OverlapConfig, overlap_step: bool) -> dict:
    torch.manual_seed(0)
    model = TinyDecoder(config.layers)
    dedicate_and_shard(model, "cpu", config.replicas, config.reshard_after_forward)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(
            backend=config.ns_backend, dtype=getattr(torch, config.ns_dtype), kernel="cublas"
        ),
        nonfinite=config.nonfinite,
        overlap_step=overlap_step,
    )
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        if config.lr_schedule
        else None
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step, batch in enumerate(batches(config.steps, world)):
        micro = rank_rows(batch, rank, world).chunk(config.micro_batches)
        for index, chunk in enumerate(micro):
            last = index == len(micro) - 1
            quiet = config.no_sync and not last
            with dmuon.no_sync(model) if quiet else contextlib.nullcontext():
                loss = loss_fn(model, chunk) / len(micro)
                if step == config.nan_at_step and rank == 0:
                    loss = loss * float("nan")
                loss.backward()
            losses.append(loss.item())
        if config.clip_max_norm is not None:
            dmuon.clip_grad_norm_(model, optimizer, config.clip_max_norm)
        if step == config.momentum_change_at_step:
            for group in optimizer.param_groups:
                if group["route"] == "muon":
                    group["momentum"] = 0.9
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    state = get_dedicated_state(model)
    owned = {p.fqn: p.master.detach().clone() for p in state.iter_owned_masters()}
    momenta = {
        p.fqn: optimizer.state[p.master]["momentum_buffer"].clone()
        for p in state.iter_owned_masters()
        if "momentum_buffer" in optimizer.state.get(p.master, {})
    }
    others = {
        name: param.full_tensor().detach().clone()
        for name, param in model.named_parameters()
        if name not in state.params
    }
    return {
        "owned": owned,
        "momenta": momenta,
        "others": others,
        "losses": losses,
        "stats": optimizer.overlap_stats() if overlap_step else None,
    }


def plain_and_overlapped(**kwargs) -> dict:
    config = OverlapConfig(**kwargs)
    with _nan_warnings_allowed(config):
        plain = _train(config, overlap_step=False)
        overlapped = _train(config, overlap_step=True)
    return {"plain": plain, "overlapped": overlapped}


@contextlib.contextmanager
def _nan_warnings_allowed(config: OverlapConfig):
    if config.nan_at_step is None:
        yield
        return
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="dmuon.Muon: step")
        yield


def speculation_after_one_backward(**kwargs) -> dict:
    """One backward with overlap_step=True, then the counters before step(): the owner work
    ran during backward (the counters show it before step() is called)."""
    config = OverlapConfig(**kwargs)
    torch.manual_seed(0)
    model = TinyDecoder()
    dedicate_and_shard(model, "cpu", config.replicas, config.reshard_after_forward)
    optimizer = dmuon.Muon(
        model, lr=0.02, ns_backend=NewtonSchulz(dtype=torch.float32), overlap_step=True
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = batches(1, world)[0]
    loss_fn(model, rank_rows(batch, rank, world)).backward()
    before_step = optimizer.overlap_stats()
    owned_muon = sum(
        1
        for p in get_dedicated_state(model).iter_owned_masters()
        if p.route == "muon" and p.master.grad is not None
    )
    optimizer.step()
    return {
        "before_step": before_step,
        "after_step": optimizer.overlap_stats(),
        "owned": owned_muon,
    }
