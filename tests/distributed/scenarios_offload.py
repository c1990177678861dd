"""Scenarios of ``dmuon.Muon(offload_masters=True)`` on every rank of a gloo pool: the tiny
decoder computing in bf16 (dmuon's ``param_policy`` and FSDP2's ``MixedPrecisionPolicy``), so
each owner's fp32 master is a copy of its own, trained with and without offload on the same
batches, against each other (bit for bit), against the single-process fp32 reference, and
through checkpoints and torch's state dicts in both directions.

On gloo the masters' "device" is the CPU: the copies are CPU to CPU, but the mechanism (one
Newton-Schulz call's masters brought in ahead, updated, copied into the segment and home, the
stand-in between steps) runs as on CUDA. Every run here uses one matrix per Newton-Schulz call
(``one_matrix_per_call``), so a step moves its masters in many chunks.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import dmuon
import dmuon.checkpoint as dckpt
import dmuon.optim
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard_on
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.layouts import data_parallel_meshes
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_protocol import relative_errors
from tests.distributed.scenarios_tensor_parallel import tensor_parallel_plan
from tests.reference_optim import ReferenceMuonAdamW

LR, WEIGHT_DECAY = 0.02, 0.01
GLOBAL_ROWS = 8  # divisible by the world sizes used (2, 4)
STEPS, SAVE_AT = 4, 2
BF16 = {"defaults": {"param_dtype": torch.bfloat16}}
FULL = StateDictOptions(full_state_dict=True)


@contextlib.contextmanager
def one_matrix_per_call():
    """Newton-Schulz calls of one matrix each: the offloaded step then runs in as many chunks
    as it has matrices (the pool's processes outlive a scenario, so the limit is restored)."""
    saved = dmuon.muon_state.NS_CALL_BYTES
    dmuon.muon_state.NS_CALL_BYTES = 1
    try:
        yield
    finally:
        dmuon.muon_state.NS_CALL_BYTES = saved


def build(replicas: int, offload: bool):
    torch.manual_seed(0)
    model = TinyDecoder()
    shard_mesh, replicate_mesh, fsdp_mesh = data_parallel_meshes(replicas)
    dmuon.dedicate_params(
        model, shard_mesh, proj_predicate, replicate_mesh=replicate_mesh, param_policy=BF16
    )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        offload_masters=offload,
    )
    return model, optimizer


def build_reference():
    torch.manual_seed(0)
    reference = TinyDecoder()
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        proj_predicate,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
    )
    return reference, optimizer


def train(model, optimizer, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    every = batches(STEPS, 1, per_rank=GLOBAL_ROWS)
    losses = []
    for step in steps:
        loss = loss_fn(model, rank_rows(every[step], rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def weights(model) -> dict[str, torch.Tensor]:
    """The values this rank updates: its owned masters (through ``master_value``, the CPU home
    when offloaded) and every FSDP2 parameter, full."""
    state = get_dedicated_state(model)
    values = {p.fqn: p.master_value().detach().clone() for p in state.iter_owned_masters()}
    for name, param in model.named_parameters():
        if name not in state.params:
            values[name] = param.full_tensor().detach().clone()
    return values


def segments(model) -> list[torch.Tensor]:
    """The local segments: the bf16 weights forward broadcasts (and HSDP replicas received)."""
    state = get_dedicated_state(model)
    return [
        segment.buffer.clone()
        for group in state.boundaries
        for segment in group.segments
        if segment.is_local
    ]


def momenta(model, optimizer) -> dict[str, torch.Tensor]:
    state = get_dedicated_state(model)
    return {
        p.fqn: optimizer.state[p.master]["momentum_buffer"].clone()
        for p in state.iter_owned_masters()
        if p.route == "muon" and p.master in optimizer.state
    }


def identical(mine: dict | list, theirs: dict | list) -> bool:
    if isinstance(mine, dict):
        return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    return len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs))


def between_steps(model) -> dict:
    """What an offloaded master is between steps: its home on the CPU, the parameter a 4-byte
    NaN stand-in on the device."""
    owned = [p for p in get_dedicated_state(model).iter_owned_masters() if p.offload is not None]
    return {
        "offloaded": len(owned),
        "homes_on_cpu": all(p.master_value().device.type == "cpu" for p in owned),
        "stand_ins": all(
            p.master.untyped_storage().nbytes() == 4 and bool(p.master.isnan().all()) for p in owned
        ),
    }


# ---- the scenarios -------------------------------------------------------------------------


def offloaded_against_resident(replicas: int = 1, steps: int = STEPS) -> dict:
    """The same training with and without offload, and the fp32 reference: whether losses,
    masters, every weight, the segments and the momenta are bit-identical after every step,
    the offloaded run's worst relative error of an owned master against the reference per
    step, and the masters' state between steps."""
    with one_matrix_per_call():
        resident, resident_optimizer = build(replicas, offload=False)
        model, optimizer = build(replicas, offload=True)
        reference, reference_optimizer = build_reference()
        every = batches(STEPS, 1, per_rank=GLOBAL_ROWS)
        checks, max_errors, states = [], [], []
        for step in range(steps):
            expected_loss = train(resident, resident_optimizer, range(step, step + 1))
            loss = train(model, optimizer, range(step, step + 1))
            loss_fn(reference, every[step]).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            mine = weights(model)
            checks.append(
                {
                    "losses": loss == expected_loss,
                    "weights": identical(mine, weights(resident)),
                    "segments": identical(segments(model), segments(resident)),
                    "momenta": identical(
                        momenta(model, optimizer), momenta(resident, resident_optimizer)
                    ),
                }
            )
            owned = {p.fqn for p in get_dedicated_state(model).iter_owned_masters()}
            errors = relative_errors({k: v for k, v in mine.items() if k in owned}, reference)
            max_errors.append(max(errors.values(), default=0.0))
            states.append(between_steps(model))
    return {"checks": checks, "max_errors": max_errors, "between_steps": states}


def checkpoints_across_offload(path: str, replicas: int = 1, full: bool = False) -> dict:
    """Saved after ``SAVE_AT`` steps with offload on and resumed with it off, and the other way
    (sharded through ``dmuon.checkpoint.save`` / ``load`` under ``path``, or full state dicts
    in memory): whether each resumed run ends bit-identical to the uninterrupted one (offload
    off), and what each checkpoint held for an owned master."""
    with one_matrix_per_call():
        uninterrupted, uninterrupted_optimizer = build(replicas, offload=False)
        train(uninterrupted, uninterrupted_optimizer, range(STEPS))
        expected = weights(uninterrupted)
        result = {}
        for saved_with in (True, False):
            model, optimizer = build(replicas, offload=saved_with)
            train(model, optimizer, range(SAVE_AT))
            at_save = weights(model)
            resumed, resumed_optimizer = build(replicas, offload=not saved_with)
            if full:
                model_sd, optim_sd = dckpt.get_state_dict(model, optimizer, options=FULL)
                dckpt.set_state_dict(
                    resumed,
                    resumed_optimizer,
                    model_state_dict=model_sd,
                    optim_state_dict=optim_sd,
                    options=FULL,
                )
            else:
                where = f"{path}/saved-with-offload-{saved_with}"
                model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
                dckpt.save({"model": model_sd, "optim": optim_sd}, where)
                model_sd, optim_sd = dckpt.get_state_dict(resumed, resumed_optimizer)
                dckpt.load({"model": model_sd, "optim": optim_sd}, where)
                dckpt.set_state_dict(
                    resumed, resumed_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
                )
            loaded = weights(resumed)
            train(resumed, resumed_optimizer, range(SAVE_AT, STEPS))
            result[f"saved_with_offload_{saved_with}"] = {
                "loaded_as_saved": identical(loaded, at_save),
                "resumed_like_uninterrupted": identical(weights(resumed), expected),
            }
    return result


def torch_state_dicts_across_offload() -> dict:
    """``model.state_dict()`` / ``load_state_dict`` and ``optimizer.state_dict()`` /
    ``load_state_dict`` from a run with offload into one without, and the other way, after
    ``SAVE_AT`` steps: whether the twin then trains bit-identically to the original."""
    with one_matrix_per_call():
        result = {}
        for source_offload in (True, False):
            model, optimizer = build(1, offload=source_offload)
            train(model, optimizer, range(SAVE_AT))
            twin, twin_optimizer = build(1, offload=not source_offload)
            model_sd = {
                key: value if isinstance(value, DTensor) else value.clone()
                for key, value in model.state_dict().items()
            }
            twin.load_state_dict(model_sd)
            twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            losses = train(model, optimizer, range(SAVE_AT, STEPS))
            twin_losses = train(twin, twin_optimizer, range(SAVE_AT, STEPS))
            result[f"from_offload_{source_offload}"] = {
                "losses": losses == twin_losses,
                "weights": identical(weights(model), weights(twin)),
                "momenta": identical(momenta(model, optimizer), momenta(twin, twin_optimizer)),
            }
    return result


def tensor_parallel_refusal() -> str:
    """The message of ``offload_masters=True`` with tensor-parallel Muon matrices (dp x tp 2)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = TinyDecoder()
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=False))
    dedicate_and_shard_on(model, mesh["dp"])
    try:
        dmuon.Muon(model, offload_masters=True)
    except ValueError as error:
        return str(error)
    return "no error"
