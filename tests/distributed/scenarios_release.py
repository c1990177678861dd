"""Scenarios of a dropped dmuon model: trained, checkpointed, then let go by the program.

Each builds one layout, trains two steps, takes the model's and the optimizer's state dicts,
drops every reference it holds and returns whether the model, the optimizer or any of the
rank's masters outlived a garbage collection. A leak here is a model's weights and optimizer state held until
the process exits: one per run of a sweep, a benchmark or a test session.
"""

from __future__ import annotations

import functools
import gc
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
import dmuon.checkpoint
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_qk_clip import attention_heads, build_distributed, loss_of

LAYOUTS = ("fsdp2", "hsdp", "ddp", "overlap", "qk_clip")


def _build(layout: str):
    """(model, optimizer, loss of a batch) of one layout."""
    ns = NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas")
    world = dist.get_world_size()
    if layout == "qk_clip":
        model, dp_rank, dp = build_distributed("tp", {}, k_on_adamw=False)
        optimizer = dmuon.Muon(model, ns_backend=ns)
        clip = dmuon.QKClip(model, optimizer, attention_heads(model), threshold=1e-3)
        for i, layer in enumerate(model.layers):
            layer.attn.record = functools.partial(clip.record, f"layers.{i}.attn")
        return model, optimizer, lambda batch: loss_of(model, rank_rows(batch, dp_rank, dp))
    model = TinyDecoder()
    if layout == "ddp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        ddp = dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
        optimizer = dmuon.Muon(model, ns_backend=ns)
        rank = dist.get_rank()
        return model, optimizer, lambda batch: loss_fn(ddp, rank_rows(batch, rank, world))
    dedicate_and_shard(model, "cpu", 2 if layout == "hsdp" else 1, True)
    optimizer = dmuon.Muon(model, ns_backend=ns, overlap_step=layout == "overlap")
    rank = dist.get_rank()
    return model, optimizer, lambda batch: loss_fn(model, rank_rows(batch, rank, world))


def _train_and_checkpoint(layout: str) -> tuple[weakref.ref, ...]:
    torch.manual_seed(0)
    model, optimizer, loss_of_batch = _build(layout)
    for batch in batches(2, dist.get_world_size()):
        loss_of_batch(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    dmuon.checkpoint.get_state_dict(model, optimizer)
    model.state_dict()
    dmuon.wait_all_replicate_broadcasts(model)
    masters = [weakref.ref(p.master) for p in get_dedicated_state(model).iter_owned_masters()]
    return weakref.ref(model), weakref.ref(optimizer), *masters


def outlives_the_program(layout: str) -> dict[str, bool]:
    """Which of the model, the optimizer and the rank's masters are alive after a collection."""
    model, optimizer, *masters = _train_and_checkpoint(layout)
    gc.collect()
    return {
        "model": model() is not None,
        "optimizer": optimizer() is not None,
        "an owned master": any(master() is not None for master in masters),
    }
