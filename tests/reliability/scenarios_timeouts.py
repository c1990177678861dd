"""Scenarios of the timeouts of the process groups dmuon creates; run on every rank of a gloo pool.

Each returns what the test checks (the timeouts torch applies, or what a rank whose peer stalled
raised, and after how long).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.hooks import get_dedicated_state
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate


def timeout_seen_by_torch(group: dist.ProcessGroup) -> float:
    """The timeout gloo applies to ``group``'s collectives, read from torch, in seconds."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def group_timeouts(
    *,
    timeout_s: float | None = None,
    dims: tuple[str, ...] = ("replicate", "shard"),
    shape: tuple[int, ...] = (2, 2),
) -> dict:
    """Timeouts of the groups dmuon creates under HSDP ("isolated" policy), and the default's.

    ``dims`` may hold more than "replicate" and "shard" (e.g. a "tp" dim): dmuon then owns
    over the ("replicate", "shard") slice of the mesh that holds this rank.
    """
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    model = TinyDecoder()
    dmuon.dedicate_params(
        model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"], timeout=timeout
    )
    ownership = get_dedicated_state(model).mesh
    groups = {
        "shard": ownership.shard_group,
        "replicate": ownership.replicate_group,
        "world": ownership.world_group,
    }
    return {
        "rank_grid": [list(row) for row in ownership.rank_grid],
        "default": timeout_seen_by_torch(dist.group.WORLD),
        **{name: timeout_seen_by_torch(group) for name, group in groups.items()},
        "world_group_ranks": dist.get_process_group_ranks(ownership.world_group),
    }


def stalled_peer_fails_the_step_checks(*, stalled_rank: int, check: str) -> dict:
    """Both ranks run forward and backward; then ``stalled_rank`` stops and the other enters the
    all-reduce of ``check``: the non-finite check of ``step()`` or ``dmuon.clip_grad_norm_``."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, lambda name, p: True)  # nothing left for DDP or FSDP2
    optimizer = dmuon.Muon(model, nonfinite="raise")
    loss_fn(model, batches(1, world)[0]).backward()
    if dist.get_rank() == stalled_rank:
        return {"stalled": True}
    started = time.monotonic()
    try:
        if check == "nonfinite":
            optimizer.step()
        else:
            dmuon.clip_grad_norm_(model, optimizer, 1.0)
    except Exception as error:
        return {"seconds": time.monotonic() - started, "error": f"{type(error).__name__}: {error}"}
    return {"seconds": time.monotonic() - started, "error": None}


def stalled_peer_fails_the_forward_broadcast(*, stalled_rank: int) -> dict:
    """``stalled_rank`` never joins the forward's broadcasts; the others time out in them.

    No ``fully_shard``: the forward's only collectives are dmuon's broadcasts from the owners
    (every layer has owners on every rank), so nothing else can be what times out.
    """
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    if dist.get_rank() == stalled_rank:
        return {"stalled": True}
    started = time.monotonic()
    try:
        loss_fn(model, batches(1, world)[0])
    except Exception as error:
        return {"seconds": time.monotonic() - started, "error": f"{type(error).__name__}: {error}"}
    return {"seconds": time.monotonic() - started, "error": None}


def boundary_skipped_on_one_rank(*, skipping_rank: int) -> dict:
    """Every parameter dedicated (dmuon's collectives are the only ones), one normal step, then
    a forward in which ``skipping_rank`` skips ``layers.1`` (data-dependent control flow) and the
    others run it; each rank reports its warnings, its error and whether its masters are finite.
    """
    import warnings

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = TinyDecoder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unlayered embedding and head
        dmuon.dedicate_params(model, mesh, lambda name, p: True)
    optimizer = dmuon.Muon(model)
    rank = dist.get_rank()
    started, error = time.monotonic(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step, batch in enumerate(batches(2, world)):
                model.skip_layer = 1 if step == 1 and rank == skipping_rank else None
                loss_fn(model, batch[rank::world]).backward()
                optimizer.step()
                optimizer.zero_grad()
        except RuntimeError as raised:
            error = str(raised)
    masters = [p.master for p in get_dedicated_state(model).iter_owned_masters()]
    return {
        "warnings": [str(w.message) for w in caught if str(w.message).startswith("dmuon:")],
        "error": error,
        "seconds": time.monotonic() - started,
        "finite": all(bool(torch.isfinite(master).all()) for master in masters),
    }
