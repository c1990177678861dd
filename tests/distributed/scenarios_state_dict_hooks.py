"""Other modules' state-dict hooks on a dmuon model: a fused QKV projection saved as three.

The decoder of ``models_fused`` has its fused ``wqkv`` matrix dedicated (with the other block
matrices); its module splits ``wqkv`` into ``wq`` / ``wk`` / ``wv`` keys when saved and merges
them when loaded. Every run trains on the global batches of ``scenarios_checkpoint`` (the same
data on any world size) and is compared with the single-process reference trained on the plain
model, whose own ``state_dict()`` goes through the same hooks.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions

import dmuon
import dmuon.checkpoint as dckpt
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.models import batches, loss_fn
from tests.distributed.models_fused import FusedDecoder, matrices
from tests.distributed.scenarios_checkpoint import GLOBAL_ROWS, SAVE_AT, STEPS, train
from tests.reference_optim import ReferenceMuonAdamW

FULL_ON_FIRST_RANK = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_EVERYWHERE = StateDictOptions(full_state_dict=True)


def build(replicas: int = 1):
    torch.manual_seed(0)
    model = FusedDecoder()
    if replicas == 0:
        dmuon.dedicate_params(model, None, matrices)
    else:
        dedicate_and_shard(model, "cpu", replicas, reshard_after_forward=True, predicate=matrices)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )
    return model, optimizer


def reference_state_dict(steps: int) -> dict[str, torch.Tensor]:
    """The plain fused model trained ``steps`` steps on the full batches by the reference
    optimizer: its ``state_dict()`` (split keys, through the module's own hook)."""
    torch.manual_seed(0)
    model = FusedDecoder()
    optimizer = ReferenceMuonAdamW(
        model.named_parameters(),
        matrices,
        lr=0.02,
        weight_decay=0.01,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    for batch in batches(STEPS, 1, per_rank=GLOBAL_ROWS)[:steps]:
        loss_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def full_weights(model) -> dict[str, torch.Tensor]:
    return dckpt.get_model_state_dict(model, options=FULL_ON_FIRST_RANK)


def state_dicts_after(steps: int, replicas: int = 1) -> dict:
    """After ``steps`` steps: the full state dict (first rank), the keys of this rank's sharded
    dmuon.checkpoint state dict and of its plain ``model.state_dict()``, and whether this rank
    owns the fused matrices."""
    model, optimizer = build(replicas)
    train(model, optimizer, range(steps))
    state = get_dedicated_state(model)
    return {
        "full": full_weights(model),
        "sharded_keys": sorted(dckpt.get_model_state_dict(model)),
        "plain_keys": sorted(model.state_dict()),
        "owns_wqkv": sorted(
            p.fqn for p in state.iter_owned_masters() if p.fqn.endswith("wqkv.weight")
        ),
    }


def save_midway_and_finish(path: str, replicas: int = 1, save_at: int = SAVE_AT) -> dict:
    """A sharded dmuon.checkpoint at ``save_at`` and, at ``save_at``, the full state dict every
    rank holds (``full_state_dict=True`` without offload); the weights after ``STEPS``."""
    model, optimizer = build(replicas)
    train(model, optimizer, range(save_at))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    full_model, full_optim = dckpt.get_state_dict(model, optimizer, options=FULL_EVERYWHERE)
    torch.save({"model": full_model, "optim": full_optim}, f"{path}.rank{dist.get_rank()}.pt")
    train(model, optimizer, range(save_at, STEPS))
    return {"weights": full_weights(model)}


def resume_and_finish(
    path: str, replicas: int = 1, save_at: int = SAVE_AT, full: bool = False
) -> dict:
    """A fresh model loaded from the sharded checkpoint at ``path`` (or, with ``full``, from
    the full state dicts saved beside it by rank 0), trained to ``STEPS``."""
    model, optimizer = build(replicas)
    if full:
        saved = torch.load(f"{path}.rank0.pt", weights_only=True)
        dckpt.set_state_dict(
            model,
            optimizer,
            model_state_dict=saved["model"],
            optim_state_dict=saved["optim"],
            options=FULL_EVERYWHERE,
        )
    else:
        model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(model, optimizer, range(save_at, STEPS))
    return {"weights": full_weights(model)}


def plain_dcp_round_trip(path: str, replicas: int = 1, save_at: int = SAVE_AT) -> dict:
    """What a DCP-based trainer does: ``dcp.save`` of ``model.state_dict()`` (split keys from
    the owners) and of the optimizer; a fresh model loads with ``dcp.load`` into its own
    ``model.state_dict()`` and ``model.load_state_dict`` (the merge hook runs first); both run
    to ``STEPS``."""
    model, optimizer = build(replicas)
    train(model, optimizer, range(save_at))
    dcp.save(
        {"model": model.state_dict(), "optim": dckpt.get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=path,
    )
    train(model, optimizer, range(save_at, STEPS))
    resumed, resumed_optimizer = build(replicas)
    loaded = {
        "model": dict(resumed.state_dict()),
        "optim": dckpt.get_optimizer_state_dict(resumed, resumed_optimizer),
    }
    dcp.load(loaded, checkpoint_id=path)
    resumed.load_state_dict(loaded["model"], strict=False)
    dckpt.set_optimizer_state_dict(resumed, resumed_optimizer, loaded["optim"])
    train(resumed, resumed_optimizer, range(save_at, STEPS))
    return {"resumed": full_weights(resumed), "uninterrupted": full_weights(model)}


def split_model_loads_the_full_state_dict(steps: int = 3) -> dict | None:
    """On the first rank: the full state dict loaded into the plain unfused model; its logits
    and the reference's on one batch."""
    model, optimizer = build()
    train(model, optimizer, range(steps))
    full = full_weights(model)
    if not full:
        return None
    split = FusedDecoder(fused=False)
    split.load_state_dict(full)
    torch.manual_seed(0)
    reference = FusedDecoder()
    reference.load_state_dict(reference_state_dict(steps))
    tokens = batches(1, 1, per_rank=4)[0]
    return {"split": split(tokens), "reference": reference(tokens)}
