"""Scenarios of mixture-of-experts stacks (E, m, n), run on every rank of a gloo pool.

Each trains the tiny MoE decoder (``models_moe``) with its projections and expert stacks
dedicated, on FSDP2 (1-D or HSDP) or DDP, against the single-process reference that updates each
expert slice as its own matrix (``ReferenceMuonAdamW(expert_stacks=...)``), and reports what the
test asserts: per-step errors, the expert slices' owners, and the matrices each rank
orthogonalised.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import dmuon
import dmuon.checkpoint as dckpt
import dmuon.inspect
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.models import batches, loss_fn, rank_rows
from tests.distributed.models_moe import MoEDecoder, expert_stack_names, moe_predicate
from tests.distributed.shared_reference import plain_reference_step, step_on_first_rank
from tests.reference_optim import ReferenceMuonAdamW

LR, WEIGHT_DECAY = 0.02, 0.01


@dataclass(kw_only=True)
class MoEConfig:
    replicas: int = 1  # > 1: HSDP with a ("replicate", "shard") mesh
    steps: int = 4  # the first step, steady ones, and the momentum carried between them
    reshard_after_forward: bool = True
    micro_batches: int = 1  # > 1: accumulation under dmuon.no_sync
    checkpoint_layers: bool = False
    ddp: bool = False  # DistributedDataParallel instead of fully_shard
    compile_backend: str | None = None  # torch.compile each block after fully_shard
    clip_max_norm: float | None = None  # dmuon.clip_grad_norm_ before each step
    normuon: bool = False  # dmuon.Muon(normuon=True); the reference's normuon_beta2=0.95


def make_model(config: MoEConfig) -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(checkpoint_layers=config.checkpoint_layers)


def build(config: MoEConfig):
    """The dmuon model as a user writes it; returns (model, module to call, optimizer, owners)."""
    model = make_model(config)
    world = dist.get_world_size()
    if config.ddp:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        owners = dmuon.dedicate_params(model, mesh, moe_predicate)
        runner = DistributedDataParallel(model, process_group=mesh.get_group())
    else:
        if config.replicas > 1:
            mesh = init_device_mesh(
                "cpu",
                (config.replicas, world // config.replicas),
                mesh_dim_names=("replicate", "shard"),
            )
            shard_mesh, replicate_mesh, fsdp_mesh = mesh["shard"], mesh["replicate"], mesh
        else:
            shard_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
            replicate_mesh, fsdp_mesh = None, shard_mesh
        owners = dmuon.dedicate_params(
            model,
            shard_mesh,
            moe_predicate,
            replicate_mesh=replicate_mesh,
            reshard_after_forward=config.reshard_after_forward,
        )
        for layer in model.layers:
            fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=config.reshard_after_forward)
        fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=config.reshard_after_forward)
        runner = model
    if config.compile_backend is not None:
        for layer in model.layers:
            layer.compile(backend=config.compile_backend)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        normuon=config.normuon,
    )
    return model, runner, optimizer, owners


def build_reference(config: MoEConfig):
    reference = make_model(config)
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        moe_predicate,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
        expert_stacks=expert_stack_names(reference),
        normuon_beta2=0.95 if config.normuon else None,
    )
    return reference, optimizer


def train_step(model, runner, optimizer, batch: torch.Tensor, config: MoEConfig) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = rank_rows(batch, rank, world).chunk(config.micro_batches)
    for index, chunk in enumerate(micro):
        last = index == len(micro) - 1
        with dmuon.no_sync(model) if not last else contextlib.nullcontext():
            (loss_fn(runner, chunk) / len(micro)).backward()
    if config.clip_max_norm is not None:
        dmuon.clip_grad_norm_(model, optimizer, config.clip_max_norm)
    optimizer.step()
    optimizer.zero_grad()


def owned_errors(model, reference) -> dict[str, float]:
    """Relative error of every weight this rank holds in full: owned masters (an expert piece
    against its experts of the reference stack) and the parameters FSDP2 or DDP keep."""
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
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        weights[name] = (value, expected[name])
    return {
        name: ((value.detach() - ref.detach()).norm() / ref.detach().norm()).item()
        for name, (value, ref) in weights.items()
    }


def train_against_reference(**kwargs) -> dict:
    """Train dmuon and the reference side by side; per-step max relative error, the owners, and
    the (rows, cols) of every matrix this rank orthogonalised in the first step."""
    config = MoEConfig(**kwargs)
    model, runner, optimizer, owners = build(config)
    reference, reference_optimizer = build_reference(config)
    orthogonalised = _record_newton_schulz(optimizer)
    max_errors = []
    for step, batch in enumerate(batches(config.steps, dist.get_world_size())):
        train_step(model, runner, optimizer, batch, config)
        if step == 0:
            first_step_matrices = list(orthogonalised)
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
        "owners": {name: (c.shard, c.replicate) for name, c in owners.items()},
        "expert_slices": dict(state.plan.expert_slices),
        "orthogonalised": first_step_matrices,
        "routing": optimizer.routing(),
        "summary": dmuon.summarize_param_groups(model, optimizer)["params"]["layers.0.w_in"],
        "stack_view": dmuon.inspect.view(model).expert_stacks["layers.0.w_in"],
        "stack_is_leaf_in_forward": _stack_seen_in_forward(model, runner),
    }


def _record_newton_schulz(optimizer) -> list[tuple[int, int]]:
    """Record the (short, long) shape of every matrix each Newton-Schulz call receives."""
    shapes: list[tuple[int, int]] = []
    newton_schulz = optimizer.newton_schulz
    iterate = newton_schulz.iterate_normalized

    def recording(inputs, **options):
        shapes.extend(tuple(matrix.shape) for matrix in inputs)
        return iterate(inputs, **options)

    newton_schulz.iterate_normalized = recording
    return shapes


def _stack_seen_in_forward(model, runner) -> dict:
    """What the block's forward sees of ``w_in``: its shape and whether it is an autograd leaf."""
    seen = {}
    block = model.layers[0]

    def look(module, args):
        seen["shape"] = tuple(module.w_in.shape)
        seen["is_leaf"] = module.w_in.is_leaf and module.w_in.requires_grad

    handle = block.register_forward_pre_hook(look)
    with torch.no_grad():
        runner(batches(1, dist.get_world_size())[0][:1])
    handle.remove()
    return seen


# ---- checkpoints --------------------------------------------------------------------------

GLOBAL_ROWS = 12  # divisible by every world size the checkpoint tests use (1, 2, 3, 4)
# Saved after CHECKPOINT_SAVE_AT steps (momentum past its first step), resumed for the rest: the
# first resumed step reads the loaded state, the second the state the resumed run made itself.
CHECKPOINT_STEPS = 4
CHECKPOINT_SAVE_AT = 2
FULL_ON_FIRST_RANK = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _checkpoint_build(replicas: int, normuon: bool = False):
    """The MoE model on ``replicas`` (0: one process, ``mesh=None``), fully sharded."""
    if dist.is_initialized():
        model, _, optimizer, _ = build(MoEConfig(replicas=replicas, normuon=normuon))
        return model, optimizer
    model = make_model(MoEConfig())
    dmuon.dedicate_params(model, None, moe_predicate)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        normuon=normuon,
    )
    return model, optimizer


def _checkpoint_train(model, optimizer, steps: range) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    every = batches(CHECKPOINT_STEPS, 1, per_rank=GLOBAL_ROWS)
    for step in steps:
        loss_fn(model, rank_rows(every[step], rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full_state(model, optimizer) -> dict:
    """The full model and optimizer state on the first rank ({} elsewhere)."""
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer, options=FULL_ON_FIRST_RANK)
    return {"model": model_sd, "optim": optim_sd.get("state", {})}


def save_midway_and_finish(
    path: str, replicas: int = 1, save_at: int = CHECKPOINT_SAVE_AT, normuon: bool = False
) -> dict:
    """Train, save a sharded checkpoint at ``save_at``, train on: the uninterrupted run."""
    model, optimizer = _checkpoint_build(replicas, normuon)
    _checkpoint_train(model, optimizer, range(save_at))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)
    _checkpoint_train(model, optimizer, range(save_at, CHECKPOINT_STEPS))
    return _full_state(model, optimizer)


def resume_and_finish(
    path: str, replicas: int = 1, save_at: int = CHECKPOINT_SAVE_AT, normuon: bool = False
) -> dict:
    """A fresh model and optimizer loaded from ``path`` (any layout), trained to the end."""
    model, optimizer = _checkpoint_build(replicas, normuon)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every entry loads: no optimizer state starts fresh
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _checkpoint_train(model, optimizer, range(save_at, CHECKPOINT_STEPS))
    return _full_state(model, optimizer)


def state_dict_layout(replicas: int = 1) -> dict:
    """What each kind of state dict holds for the expert stacks after two steps."""
    model, optimizer = _checkpoint_build(replicas)
    _checkpoint_train(model, optimizer, range(2))
    full = _full_state(model, optimizer)
    sharded_model, sharded_optim = dckpt.get_state_dict(model, optimizer)
    stacks = list(get_dedicated_state(model).stacks)
    return {
        "full_model": {key: tuple(value.shape) for key, value in full["model"].items()},
        "full_momentum": {
            name: tuple(full["optim"][name]["momentum_buffer"].shape)
            for name in stacks
            if name in full["optim"]
        },
        "sharded_model": {
            name: (
                # A DTensor (the entry's class is dmuon's subclass, whose full_tensor gathers).
                "DTensor" if isinstance(sharded_model[name], DTensor) else "plain",
                tuple(sharded_model[name].shape),
                _local_expert_ranges(sharded_model[name]),
            )
            for name in stacks
            if name in sharded_model
        },
        "sharded_momentum": {
            name: _local_expert_ranges(sharded_optim["state"][name]["momentum_buffer"])
            for name in stacks
            if name in sharded_optim["state"]
        },
        "owned": sorted(p.fqn for p in get_dedicated_state(model).iter_owned_masters()),
        "groups": [sorted(group["params"]) for group in sharded_optim["param_groups"]],
    }


def _local_expert_ranges(value) -> list[tuple[int, int]]:
    """The expert ranges a sharded value holds on this rank (its local shards' offsets)."""
    local = getattr(value, "_local_tensor", None)
    if hasattr(local, "local_shards"):
        return sorted(
            (offsets[0], offsets[0] + len(shard))
            for shard, offsets in zip(local.local_shards(), local.local_offsets())
        )
    return [(0, value.shape[0])]


# ---- errors ---------------------------------------------------------------------------------


def error_messages() -> dict[str, str]:
    """What dmuon says for a DTensor expert stack and for a sharded stack value of another
    layout (rank 0 asks its own sharded value for rank 1's experts)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from dmuon.checkpoint._experts import piece_value
    from dmuon.experts import expert_stack_names as stacks_among

    messages = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    stack = nn.Parameter(distribute_tensor(torch.randn(4, 6, 5), mesh, [Shard(1)]))
    try:
        stacks_among([("moe.w", nn.Module(), "w", stack)], None)
        messages["dtensor"] = "no error"
    except ValueError as error:
        messages["dtensor"] = str(error)

    model, _, _, _ = build(MoEConfig())
    sharded = dckpt.get_model_state_dict(model)["layers.0.w_in"]
    state = get_dedicated_state(model)
    other = next(p for p in state.stacks["layers.0.w_in"].pieces if p.master is None)
    try:
        piece_value(other, sharded)
        messages["other_layout"] = "no error"
    except ValueError as error:
        messages["other_layout"] = str(error)
    return messages


# ---- communication --------------------------------------------------------------------------


def count_step_communication(**kwargs) -> dict:
    """Bytes dmuon's collectives moved in one training step (after a warm-up step), and the
    numel of every dedicated piece or matrix."""
    from tests.distributed.comm_counter import count_collectives

    config = MoEConfig(**kwargs)
    model, runner, optimizer, _ = build(config)
    first, second = batches(2, dist.get_world_size())
    train_step(model, runner, optimizer, first, config)
    with count_collectives() as log:
        train_step(model, runner, optimizer, second, config)
        dmuon.wait_all_replicate_broadcasts(model)
    return {
        "broadcast_received": log.broadcast_bytes_received(),
        "reduce_sent": log.reduce_bytes_sent(),
        "numels": [p.numel for p in get_dedicated_state(model).params.values()],
        "element_size": 4,
    }


def rank_dependent_expert_stacks() -> str:
    """Rank 1 flattens ``layers.0.w_in`` instead of cutting it into experts: every rank must get
    the agreement error before any partition is made."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))

    def expert_stacks(name, param):
        return not (dist.get_rank() == 1 and name == "layers.0.w_in")

    try:
        dmuon.dedicate_params(MoEDecoder(), mesh, moe_predicate, expert_stacks=expert_stacks)
    except ValueError as error:
        return str(error)
    return "no error"
