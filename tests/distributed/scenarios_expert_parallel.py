"""Scenarios of expert parallelism, run on every rank of a gloo pool.

The tiny MoE decoder (``models_moe``) with its experts split over an ``ep`` dim
(``models_moe.shard_experts``: each rank keeps its EP slot's experts, tokens go through a real
all-to-all over ep) is dedicated with ``dedicate_params(..., ep_mesh=, expert_mesh=)`` and
trained against the single-process reference on the full model, which updates each expert as
its own matrix (``ReferenceMuonAdamW(expert_stacks=...)``). The meshes are built as torchtitan
builds them: a dense ("replicate", "shard") mesh for FSDP2 and the other dedicated matrices,
and a sparse ("replicate", "efsdp", "ep") one over the same ranks, ``ep`` varying fastest.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import dmuon
import dmuon.checkpoint as dckpt
import dmuon.inspect
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.models import batches, loss_fn, rank_rows
from tests.distributed.models_moe import (
    MoEDecoder,
    expert_stack_names,
    moe_predicate,
    shard_experts,
)
from tests.distributed.shared_reference import plain_reference_step, step_on_first_rank
from tests.reference_optim import ReferenceMuonAdamW

LR, WEIGHT_DECAY = 0.02, 0.01


@dataclass(kw_only=True)
class EPConfig:
    ep: int = 2
    replicas: int = 1  # > 1: HSDP replicas of both the dense and the expert grids
    steps: int = 4
    as_dtensor: bool = True  # the stacks as DTensors Shard(0) over ep, else local tensors
    reshard_after_forward: bool = True
    # step -> experts the router may not choose on that step (they get no token anywhere)
    blocked: dict[int, tuple[int, ...]] | None = None
    overlap_step: bool = False  # dmuon.Muon(overlap_step=True)
    clip_max_norm: float | None = None  # dmuon.clip_grad_norm_ before each step


def make_model() -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder()


def meshes(config: EPConfig):
    """The dense (replicate, shard) and sparse (replicate, efsdp, ep) meshes over the world."""
    world = dist.get_world_size()
    shards = world // config.replicas
    dense = init_device_mesh(
        "cpu", (config.replicas, shards), mesh_dim_names=("replicate", "shard")
    )
    sparse = init_device_mesh(
        "cpu",
        (config.replicas, shards // config.ep, config.ep),
        mesh_dim_names=("replicate", "efsdp", "ep"),
    )
    return dense, sparse


def build(config: EPConfig, *, optimizer: bool = True, meta: bool = False):
    """The expert-parallel dmuon model as a user writes it; returns (model, optimizer, owners)
    (no optimizer: None). ``meta``: built on the meta device, then ``to_empty`` and the plain
    model's weights written in after dedicate_params and fully_shard, as torchtitan does."""
    if meta:
        with torch.device("meta"):
            model = MoEDecoder()
    else:
        model = make_model()
    dense, sparse = meshes(config)
    shard_experts(model, sparse["ep"], as_dtensor=config.as_dtensor)
    replicate = dense["replicate"] if config.replicas > 1 else None
    owners = dmuon.dedicate_params(
        model,
        dense["shard"],
        moe_predicate,
        replicate_mesh=replicate,
        reshard_after_forward=config.reshard_after_forward,
        ep_mesh=sparse["ep"],
        expert_mesh=sparse["efsdp"],
    )
    fsdp_mesh = dense if config.replicas > 1 else dense["shard"]
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=config.reshard_after_forward)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=config.reshard_after_forward)
    if meta:
        model.to_empty(device="cpu")
        _write_plain_weights(model)
    if not optimizer:
        return model, None, owners
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        overlap_step=config.overlap_step,
    )
    return model, optimizer, owners


def _write_plain_weights(model: MoEDecoder) -> None:
    """The plain model's weights into a materialised one: an EP stack takes its slot's experts,
    FSDP2's DTensors their shards."""
    plain = dict(make_model().named_parameters())
    stacks = set(expert_stack_names(make_model()))
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = plain[name].detach()
            if name in stacks:
                block = model.layers[int(name.split(".")[1])]
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(value[block.first_expert : block.first_expert + local.shape[0]])
            elif isinstance(param, DTensor):
                param.copy_(
                    distribute_tensor(
                        value, param.device_mesh, param.placements, src_data_rank=None
                    )
                )
            else:
                param.copy_(value)


def build_reference():
    reference = make_model()
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        moe_predicate,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
        expert_stacks=expert_stack_names(reference),
    )
    return reference, optimizer


def set_blocked(model, experts: tuple[int, ...]) -> None:
    for block in model.layers:
        block.blocked_experts = experts


def gradients_against_reference(**kwargs) -> dict:
    """One forward and backward of the dmuon model (no optimizer) and of the reference on the
    full batch: each owned master's gradient against the reference's gradient of the same
    experts (relative error; 0-norm references compared absolutely), and which expert pieces
    got a gradient at all."""
    meta = kwargs.pop("meta", False)
    config = EPConfig(**kwargs)
    model, _, owners = build(config, optimizer=False, meta=meta)
    reference = make_model()
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = batches(1, world)[0]
    blocked = (config.blocked or {}).get(0, ())
    set_blocked(model, blocked)
    set_blocked(reference, blocked)
    loss_fn(model, rank_rows(batch, rank, world)).backward()
    loss_fn(reference, batch).backward()
    expected = {name: param.grad for name, param in reference.named_parameters()}
    errors, zero_experts = {}, {}
    for p in get_dedicated_state(model).iter_owned_masters():
        if p.master.grad is None:
            errors[p.fqn] = float("inf")
            continue
        ref = expected[p.fqn] if p.experts is None else expected[p.stack.fqn][slice(*p.experts)]
        difference = (p.master.grad - ref).norm()
        errors[p.fqn] = (difference / ref.norm() if ref.norm() > 0 else difference).item()
        if p.experts is not None:
            for index, expert in enumerate(range(*p.experts)):
                if p.master.grad[index].norm() == 0:
                    zero_experts.setdefault(p.stack.fqn, []).append(expert)
    state = get_dedicated_state(model)
    segments = [
        (segment.root_rank, [(part.owner_rank, part.params) for part in segment.slices])
        for boundary in dmuon.inspect.view(model).boundaries
        for segment in boundary.segments
    ]
    return {
        "segments": segments,
        "errors": errors,
        "zero_experts": zero_experts,
        "owners": {name: state.mesh.global_rank(c) for name, c in owners.items()},
        "pieces": sorted(state.params),
        "owned": sorted(p.fqn for p in state.iter_owned_masters()),
    }


def owned_errors(model, reference) -> dict[str, float]:
    """Relative error of every weight this rank holds in full: its owned masters (an expert
    piece against the same global experts of the reference stack) and FSDP2's parameters."""
    state = get_dedicated_state(model)
    expected = dict(reference.named_parameters())
    weights = {}
    for p in state.iter_owned_masters():
        if p.experts is not None:
            start, stop = p.experts
            weights[p.fqn] = (p.master, expected[p.stack.fqn][start:stop])
        else:
            weights[p.fqn] = (p.master, expected[p.fqn])
    for name, param in model.named_parameters():
        if name in state.params or name in state.stacks:
            continue
        weights[name] = (param.full_tensor(), expected[name])
    return {
        name: ((value.detach() - ref.detach()).norm() / ref.detach().norm()).item()
        for name, (value, ref) in weights.items()
    }


def _record_newton_schulz(optimizer) -> list[list[tuple[int, int]]]:
    """Per Newton-Schulz call, the (short, long) shapes of the matrices it received."""
    calls: list[list[tuple[int, int]]] = []
    iterate = optimizer.newton_schulz.iterate_normalized

    def recording(inputs, **options):
        calls.append([tuple(matrix.shape) for matrix in inputs])
        return iterate(inputs, **options)

    optimizer.newton_schulz.iterate_normalized = recording
    return calls


def train_against_reference(**kwargs) -> dict:
    """Train dmuon and the reference side by side; per-step max relative error, the owners, this
    rank's expert pieces and owned pieces, and its Newton-Schulz calls of the first step."""
    config = EPConfig(**kwargs)
    model, optimizer, owners = build(config)
    reference, reference_optimizer = build_reference()
    calls = _record_newton_schulz(optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    max_errors = []
    for step, batch in enumerate(batches(config.steps, world)):
        blocked = (config.blocked or {}).get(step, ())
        set_blocked(model, blocked)
        set_blocked(reference, blocked)
        loss_fn(model, rank_rows(batch, rank, world)).backward()
        if config.clip_max_norm is not None:
            dmuon.clip_grad_norm_(model, optimizer, config.clip_max_norm)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            first_step_calls = [list(call) for call in calls]
        step_on_first_rank(
            reference,
            plain_reference_step,
            reference,
            reference_optimizer,
            batch,
            config.clip_max_norm,
        )
        max_errors.append(max(owned_errors(model, reference).values()))
    state = get_dedicated_state(model)
    return {
        "max_errors": max_errors,
        "owners": {name: state.mesh.global_rank(c) for name, c in owners.items()},
        "pieces": sorted(state.params),
        "owned": sorted(p.fqn for p in state.iter_owned_masters()),
        "newton_schulz_calls": first_step_calls,
    }


# ---- communication --------------------------------------------------------------------------


def count_step_communication(**kwargs) -> dict:
    """Every broadcast and reduce of one forward and backward (after a warm-up one, no
    optimizer): its kind, its group's ranks, its bytes and whether this rank was its root; and
    the numels of this rank's expert pieces and of its other dedicated matrices."""
    from tests.distributed.comm_counter import count_collectives

    config = EPConfig(**kwargs)
    model, _, _ = build(config, optimizer=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    first, second = batches(2, world)
    loss_fn(model, rank_rows(first, rank, world)).backward()
    model.zero_grad()
    with count_collectives() as log:
        loss_fn(model, rank_rows(second, rank, world)).backward()
    state = get_dedicated_state(model)
    return {
        "calls": [
            (call.kind, call.group_ranks, call.nbytes, call.is_root)
            for call in log.calls
            if call.kind in ("broadcast", "reduce")
        ],
        "all_to_all": log.count("all_to_all"),
        "expert_numels": [p.numel for p in state.params.values() if p.stack is not None],
        "other_numels": [p.numel for p in state.params.values() if p.stack is None],
    }


# ---- checkpoints ----------------------------------------------------------------------------

GLOBAL_ROWS = 12  # as scenarios_moe's checkpoints: the same data on every layout
CHECKPOINT_STEPS = 4
CHECKPOINT_SAVE_AT = 2


def _train(model, optimizer, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    every = batches(CHECKPOINT_STEPS, 1, per_rank=GLOBAL_ROWS)
    for step in steps:
        loss_fn(model, rank_rows(every[step], rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _owned_state(model, optimizer) -> dict:
    """This rank's owned masters and their momentum, by piece or matrix name."""
    state = get_dedicated_state(model)
    return {
        "weights": {p.fqn: p.master.detach().clone() for p in state.iter_owned_masters()},
        "momentum": {
            p.fqn: optimizer.state[p.master]["momentum_buffer"].clone()
            for p in state.iter_owned_masters()
            if p.master in optimizer.state and "momentum_buffer" in optimizer.state[p.master]
        },
    }


def full_model_state(cpu_offload: bool, **kwargs) -> dict:
    """The full model state dict of a freshly dedicated EP model (the first rank's with
    ``cpu_offload``, every rank's without), and the plain model's weights it must equal."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, _, _ = build(EPConfig(**kwargs), optimizer=False)
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    full = dckpt.get_model_state_dict(model, options=options)
    plain = {name: param.detach() for name, param in make_model().named_parameters()}
    return {"full": full, "plain": plain}


def train_and_gather_full_state(**kwargs) -> dict:
    """Train on the EP layout for the checkpoint tests' steps; the full model and optimizer
    state on the first rank ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, optimizer, _ = build(EPConfig(**kwargs))
    _train(model, optimizer, range(CHECKPOINT_STEPS))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd.get("state", {})}


def save_midway_and_finish(path: str, **kwargs) -> dict:
    """Train on the EP layout, save a sharded checkpoint midway, train on; the owned state."""
    model, optimizer, _ = build(EPConfig(**kwargs))
    _train(model, optimizer, range(CHECKPOINT_SAVE_AT))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    _train(model, optimizer, range(CHECKPOINT_SAVE_AT, CHECKPOINT_STEPS))
    return _owned_state(model, optimizer)


def resume_and_finish(path: str, **kwargs) -> dict:
    """A fresh EP model and optimizer loaded from ``path`` (any layout), trained to the end."""
    model, optimizer, _ = build(EPConfig(**kwargs))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every entry loads: no optimizer state starts fresh
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _train(model, optimizer, range(CHECKPOINT_SAVE_AT, CHECKPOINT_STEPS))
    return _owned_state(model, optimizer)


# ---- errors ---------------------------------------------------------------------------------


def error_messages() -> dict[str, str]:
    """What dedicate_params says for an EP stack without ep_mesh, and for meshes that do not
    split the shard dim."""
    messages = {}
    dense, sparse = meshes(EPConfig())
    model = make_model()
    shard_experts(model, sparse["ep"], as_dtensor=True)
    try:
        dmuon.dedicate_params(model, dense["shard"], moe_predicate)
        messages["no_ep_mesh"] = "no error"
    except ValueError as error:
        messages["no_ep_mesh"] = str(error)
    model = make_model()
    shard_experts(model, sparse["ep"], as_dtensor=False)
    try:
        dmuon.dedicate_params(
            model, dense["shard"], moe_predicate, ep_mesh=sparse["ep"], expert_mesh=sparse["ep"]
        )
        messages["same_dims"] = "no error"
    except ValueError as error:
        messages["same_dims"] = str(error)
    try:
        dmuon.dedicate_params(model, dense["shard"], moe_predicate, ep_mesh=sparse["ep"])
        messages["one_dim"] = "no error"
    except ValueError as error:
        messages["one_dim"] = str(error)
    return messages
