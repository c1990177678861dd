"""Loading a full state dict that only the first rank holds (``broadcast_from_rank0=True``).

Every scenario builds the same model twice on the same layout: one loads the full dict given to
every rank (the reference), the other the same dict given to rank 0 alone (``{}`` elsewhere),
optionally built on the meta device and materialised with ``to_empty`` first. Both then train
the same steps. Each rank reports the full weights (on rank 0) after the load and after the
steps, and what it received during the load (``recording_received``) against what it keeps.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

import dmuon
import dmuon.checkpoint as dckpt
from dmuon.checkpoint._from_source import recording_received
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, proj_predicate
from tests.distributed.models_moe import MoEDecoder, moe_predicate
from tests.distributed.scenarios_checkpoint import _tensor_parallel, full_weights, train

FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
ON_EVERY_RANK = StateDictOptions(full_state_dict=True)
CHECKPOINT_SEED = 123  # the loaded values; the models are built from seed 0
STEPS = 2

MODELS = {"decoder": (TinyDecoder, proj_predicate), "moe": (MoEDecoder, moe_predicate)}


def checkpoint_values(kind: str) -> dict[str, torch.Tensor]:
    """The full dict to load: a plain model's weights, other than the ones the build draws."""
    torch.manual_seed(CHECKPOINT_SEED)
    return MODELS[kind][0]().state_dict()


def build(kind: str, replicas: int, tp: int, meta: bool, for_load: bool = False):
    """The model on the layout, dedicated and sharded; on the meta device then ``to_empty`` (or
    ``dmuon.checkpoint.to_empty_for_load``)."""
    model_class, predicate = MODELS[kind]
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = model_class()
    if tp > 1:
        _tensor_parallel(model, tp, predicate)
    else:
        dedicate_and_shard(model, "cpu", replicas, reshard_after_forward=True, predicate=predicate)
    if meta and for_load:
        dckpt.to_empty_for_load(model, device="cpu")
    elif meta:
        model.to_empty(device="cpu")
    return model


def dedicated_storage(model) -> int:
    """Bytes of storage behind the dedicated weights the modules hold before adoption."""
    storages = {}
    for p in get_dedicated_state(model).params.values():
        param = p.module._parameters[p.attr]
        local = param.to_local() if isinstance(param, DTensor) else param
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def weights(model) -> dict[str, torch.Tensor]:
    """The full weights on rank 0 ({} elsewhere), copied: on the CPU an owner's entry may be its
    master itself, which the steps then change."""
    return {key: value.clone() for key, value in full_weights(model).items()}


def optimizer_of(model):
    return dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=0.01,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )


def loaded_like_every_rank(
    kind: str = "decoder",
    replicas: int = 1,
    tp: int = 1,
    meta: bool = False,
    for_load: bool = False,
) -> dict:
    """The reference (full dict on every rank) and the broadcast-from-rank0 load, then STEPS
    steps of each; what rank 0 reports of both, and what each rank received."""
    full = checkpoint_values(kind)
    reference = build(kind, replicas, tp, meta=False)
    dckpt.set_model_state_dict(reference, full, options=ON_EVERY_RANK)

    model = build(kind, replicas, tp, meta, for_load)
    before_load = dedicated_storage(model)
    given = full if dist.get_rank() == 0 else {}
    with recording_received() as received:
        result = dckpt.set_model_state_dict(model, given, options=FROM_RANK0)
    del given
    report = {
        "incompatible": (result.missing_keys, result.unexpected_keys),
        "loaded": weights(model),
        "reference_loaded": weights(reference),
        "received": {"received": received.received, "peak": received.peak},
        "dedicated_storage": before_load,
        "largest_value": max(value.numel() * value.element_size() for value in full.values()),
        "whole_model": sum(value.numel() * value.element_size() for value in full.values()),
        **_what_this_rank_keeps(model, full),
    }
    optimizers = [optimizer_of(reference), optimizer_of(model)]
    train(reference, optimizers[0], range(STEPS))
    train(model, optimizers[1], range(STEPS))
    report["trained"] = weights(model)
    report["reference_trained"] = weights(reference)
    return report


def _what_this_rank_keeps(model, full: dict[str, torch.Tensor]) -> dict:
    """``owned``: bytes of the dedicated values this rank owns (in the dict's dtype);
    ``not_dedicated``: bytes of every other value, which each rank receives whole (torch's way);
    ``own_share``: bytes this rank holds of the model (fp32 masters, FSDP2's local shards)."""
    state = get_dedicated_state(model)
    dedicated = {p.fqn for p in state.params.values() if p.stack is None} | set(state.stacks)
    owned = sum(
        math.prod(p.local_shape) * full[(p.stack or p).fqn].element_size()
        for p in state.params.values()
        if p.master is not None
    )
    not_dedicated = sum(
        value.numel() * value.element_size() for key, value in full.items() if key not in dedicated
    )
    masters = sum(
        p.master.numel() * p.master.element_size()
        for p in state.params.values()
        if p.master is not None
    )
    shards = sum(
        local.numel() * local.element_size()
        for param in model.parameters()
        if isinstance(param, DTensor)
        for local in [param.to_local()]
    )
    return {"owned": owned, "not_dedicated": not_dedicated, "own_share": masters + shards}


def errors() -> dict[str, str]:
    """What a mis-shaped value on rank 0, and broadcast_from_rank0 where it does not apply,
    raise on each rank."""
    messages = {}
    full = checkpoint_values("decoder")
    full["layers.0.q_proj.weight"] = torch.zeros(3, 5)
    model = build("decoder", 1, 1, meta=False)
    given = full if dist.get_rank() == 0 else {}
    for name, call in (
        ("mis-shaped", lambda: dckpt.set_model_state_dict(model, given, options=FROM_RANK0)),
        ("reading", lambda: dckpt.get_model_state_dict(model, options=FROM_RANK0)),
        (
            "set_state_dict",
            lambda: dckpt.set_state_dict(
                model,
                optimizer_of(model),
                model_state_dict={},
                optim_state_dict={},
                options=FROM_RANK0,
            ),
        ),
    ):
        try:
            call()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    return messages


def partial_dict_and_other_ranks_dicts() -> dict:
    """Rank 0's dict lacks two keys (``strict=False``); the other ranks pass a dict of zeros,
    which must be ignored. The keys missing on every rank, and the weights after."""
    full = checkpoint_values("decoder")
    lacking = ("layers.0.q_proj.weight", "embed.weight")
    if dist.get_rank() == 0:
        given = {key: value for key, value in full.items() if key not in lacking}
    else:
        given = {key: torch.zeros_like(value) for key, value in full.items()}
    model = build("decoder", 1, 1, meta=False)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    result = dckpt.set_model_state_dict(model, given, options=options)
    torch.manual_seed(0)
    built = TinyDecoder().state_dict()
    return {
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
        "weights": weights(model),
        "expected": {key: built[key] if key in lacking else full[key] for key in full},
    }


def expert_parallel_loaded_like_every_rank(ep: int = 2, as_dtensor: bool = True) -> dict:
    """The same comparison on an expert-parallel MoE model (each EP slot owning its experts'
    pieces), after the load: what rank 0 reports of both, and what each rank received."""
    from tests.distributed.scenarios_expert_parallel import EPConfig
    from tests.distributed.scenarios_expert_parallel import build as build_expert_parallel

    full = checkpoint_values("moe")
    config = EPConfig(ep=ep, as_dtensor=as_dtensor)
    reference, _, _ = build_expert_parallel(config, optimizer=False)
    dckpt.set_model_state_dict(reference, full, options=ON_EVERY_RANK)
    model, _, _ = build_expert_parallel(config, optimizer=False)
    given = full if dist.get_rank() == 0 else {}
    with recording_received() as received:
        dckpt.set_model_state_dict(model, given, options=FROM_RANK0)
    return {
        "loaded": weights(model),
        "reference_loaded": weights(reference),
        "received": received.received,
        "whole_model": sum(value.numel() * value.element_size() for value in full.values()),
    }
