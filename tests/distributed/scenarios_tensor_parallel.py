"""Scenarios of dmuon on tensor-parallel models: ``parallelize_module`` on a "tp" mesh dim.

Each runs on every rank of a gloo pool. The tiny decoder of ``models`` is parallelized with
torch's own plans (ColwiseParallel / RowwiseParallel, optionally with SequenceParallel norms and
a vocabulary-parallel embedding and head), its projections are dedicated over the data-parallel
dims, the rest goes to FSDP2 (2-D with TP), and every weight is compared after each step with
the single-process reference on the full model and the full batch (the data split over the
data-parallel dims only: TP peers see the same rows).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel._data_parallel_utils import _unflatten_tensor

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard_on
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.scenarios_protocol import (
    TrainConfig,
    build_reference,
    make_model,
    reference_step,
    relative_errors,
)
from tests.distributed.shared_reference import step_on_first_rank


def tensor_parallel_plan(sequence_parallel: bool) -> dict:
    """torch's plans for the tiny decoder. ``gate_proj`` is 1 x n: colwise, its one row lives on
    TP rank 0 and the other ranks hold an empty chunk."""
    if not sequence_parallel:
        block = {
            "q_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel(),
            "gate_proj": ColwiseParallel(output_layouts=Replicate()),
            "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel(),
        }
        return {f"layers.*.{name}": style for name, style in block.items()}
    block = {
        "attn_norm": SequenceParallel(),
        "mlp_norm": SequenceParallel(),
        "q_proj": ColwiseParallel(input_layouts=Shard(1)),
        "o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "gate_proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
        "up_proj": ColwiseParallel(input_layouts=Shard(1)),
        "down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        **{f"layers.*.{name}": style for name, style in block.items()},
    }


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every weight this rank can see, whole: owned dedicated masters (their TP chunks gathered
    over the owner's TP ranks) and every FSDP2 parameter."""
    state = get_dedicated_state(model)
    weights = {}
    for p in state.iter_owned_masters():
        master = p.master.detach()
        weights[p.fqn] = p.tp.as_dtensor(master).full_tensor() if p.tp is not None else master
    for name, param in model.named_parameters():
        if name in state.params:
            continue
        if hasattr(param, "_st_info"):  # a DTensor handed to DDP as its local tensor
            param = _unflatten_tensor(param, param._st_info)
        weights[name] = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    return weights


def train_tensor_parallel(
    *,
    dp: int,
    tp: int,
    replicas: int = 1,
    sequence_parallel: bool = False,
    steps: int = 4,
    replicate_async: bool = True,
    reshard_after_forward: bool = True,
    two_steps_without_forward: bool = False,
    clip_max_norm: float | None = None,
) -> dict:
    """dp x tp (or replicate x shard x tp with ``replicas`` > 1) against the reference."""
    if replicas > 1:
        mesh = init_device_mesh(
            "cpu", (replicas, dp // replicas, tp), mesh_dim_names=("replicate", "shard", "tp")
        )
        dp_mesh, replicate_mesh = mesh["shard"], mesh["replicate"]
        fsdp_mesh = mesh["replicate", "shard"]
        dp_rank = mesh["replicate", "shard"]._flatten().get_local_rank()
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, replicate_mesh, fsdp_mesh = mesh["dp"], None, mesh["dp"]
        dp_rank = dp_mesh.get_local_rank()
    config = TrainConfig(
        steps=steps,
        two_steps_without_forward=two_steps_without_forward,
        clip_max_norm=clip_max_norm,
    )
    model = make_model(config)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel))
    owners = dedicate_and_shard_on(
        model,
        dp_mesh,
        replicate_mesh=replicate_mesh,
        fsdp_mesh=fsdp_mesh,
        reshard_after_forward=reshard_after_forward,
    )
    max_errors, losses = _train_against_reference(
        model, model, config, dp_rank, dp, replicate_async=replicate_async
    )
    state = get_dedicated_state(model)
    return {
        "max_errors": max_errors,
        "losses": losses,
        "owners": {name: [o.shard, o.replicate, o.tp] for name, o in owners.items()},
        "tp_ranks": list(state.mesh.tp_ranks),
        "num_tp": state.plan.num_tp,
        "is_dtensor": {p.fqn: isinstance(p.unsharded, DTensor) for p in state.params.values()},
        "rank": dist.get_rank(),
    }


def unnamed_tp_mesh_error() -> str:
    """A TP model whose mesh has no names: the seed's error, with the fix."""
    world = dist.get_world_size()
    named = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = make_model(TrainConfig())
    parallelize_module(
        model, init_device_mesh("cpu", (world,)), {"layers.*.q_proj": ColwiseParallel()}
    )
    try:
        dmuon.dedicate_params(model, named["dp"], proj_predicate)
    except ValueError as error:
        return str(error)
    return "no error"


def train_ddp_tensor_parallel(
    *,
    dp: int,
    tp: int,
    steps: int = 4,
    sequence_parallel: bool = False,
    clip_max_norm: float | None = None,
) -> dict:
    """dp x tp with DistributedDataParallel over the dp dim (dedicate_params_ddp)."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_mesh = mesh["dp"]
    dp_rank = dp_mesh.get_local_rank()
    config = TrainConfig(steps=steps, clip_max_norm=clip_max_norm)
    model = make_model(config)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel))
    ddp_model = dmuon.dedicate_params_ddp(model, dp_mesh, proj_predicate)
    max_errors, _ = _train_against_reference(ddp_model, model, config, dp_rank, dp)
    return {"max_errors": max_errors, "rank": dist.get_rank()}


def _train_against_reference(
    forward, model, config: TrainConfig, dp_rank: int, dp: int, **muon_options
) -> tuple[list[float], list[float]]:
    """``config.steps`` steps of ``dmuon.Muon`` on ``model`` (through ``forward``, its wrapper
    if any) beside the single-process reference: the worst relative weight error after each
    step, and this rank's losses."""
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=config.weight_decay,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
        **muon_options,
    )
    reference, reference_optimizer = build_reference(config)
    max_errors, losses = [], []
    for batch in batches(config.steps, dp):
        loss = loss_fn(forward, rank_rows(batch, dp_rank, dp))
        loss.backward()
        if config.clip_max_norm is not None:
            dmuon.clip_grad_norm_(model, optimizer, config.clip_max_norm)
        optimizer.step()
        if config.two_steps_without_forward:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        step_on_first_rank(reference, reference_step, reference, reference_optimizer, batch, config)
        max_errors.append(max(relative_errors(full_weights(model), reference).values()))
    return max_errors, losses


def count_tensor_parallel_step(*, dp: int, tp: int) -> dict:
    """The c10d ops of one dp x tp training step (after a warm-up step), and what the protocol
    says they carry: this rank's dedicated chunks and the padded chunks of its TP exchanges."""
    from tests.distributed.comm_counter import count_collectives

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = make_model(TrainConfig())
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=False))
    dedicate_and_shard_on(model, mesh["dp"])
    optimizer = dmuon.Muon(
        model, lr=0.02, ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas")
    )
    for batch in batches(2, dp):  # the log of the second step is kept
        with count_collectives() as log:
            loss_fn(model, rank_rows(batch, mesh["dp"].get_local_rank(), dp)).backward()
            optimizer.step()
            optimizer.zero_grad()
    state = get_dedicated_state(model)
    exchanged = [p for p in state.iter_owned_masters() if p.is_tp_sharded]
    return {
        "broadcast_received": log.broadcast_bytes_received(),
        "reduce_sent": log.reduce_bytes_sent(),
        "gather_sent": log.total_bytes("gather"),
        "scatter_received": log.total_bytes("scatter"),
        "gathers": log.count("gather"),
        "received_numels": [p.numel for p in state.params.values() if not p.is_owner],
        "exchanged_padded_numels": [math.prod(p.tp.padded_shape()) for p in exchanged],
        "runners": sorted({p.owner.tp for p in exchanged}),
    }


def misplaced_tp_parameter_errors() -> dict[str, str]:
    """On 2 ranks: a DTensor over the data-parallel dim, one over two mesh dims, and a Partial
    one; each raises at dedicate_params, naming the parameter and the fix."""
    from torch.distributed.tensor import Partial, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("dp", "tp", "cp"))
    cases = {
        "over_dp": lambda w: distribute_tensor(w, mesh["dp", "tp"], [Replicate(), Shard(0)]),
        "two_dims": lambda w: distribute_tensor(w, mesh["tp", "cp"], [Shard(0), Shard(1)]),
        "partial": lambda w: DTensor.from_local(w / 2, mesh["tp"], [Partial()]),
    }
    messages = {}
    for case, make in cases.items():
        model = make_model(TrainConfig())
        q_proj = model.layers[0].q_proj
        q_proj.weight = torch.nn.Parameter(make(q_proj.weight.detach()))
        try:
            dmuon.dedicate_params(model, mesh["dp"], proj_predicate)
            messages[case] = "no error"
        except ValueError as error:
            messages[case] = str(error)
    return messages


def nan_in_one_tp_chunk_is_skipped_everywhere() -> dict:
    """dp 2 x tp 2, nonfinite="skip": rank 1 alone finds a NaN in one of its TP chunks; every
    rank must skip the step (its TP peers included), leaving every weight as it was."""
    import warnings

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = make_model(TrainConfig())
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=False))
    dedicate_and_shard_on(model, mesh["dp"])
    optimizer = dmuon.Muon(
        model,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        nonfinite="skip",
    )
    batch = batches(1, 2)[0]
    loss_fn(model, rank_rows(batch, mesh["dp"].get_local_rank(), 2)).backward()
    if dist.get_rank() == 1:
        chunk = next(p for p in get_dedicated_state(model).iter_owned_masters() if p.is_tp_sharded)
        chunk.master.grad.view(-1)[0] = float("nan")
    before = full_weights(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    after = full_weights(model)
    return {
        "unchanged": all(torch.equal(before[name], after[name]) for name in before),
        "warned": any("skipped on every rank" in str(w.message) for w in caught),
    }
