"""Scenarios of dmuon on slices of larger meshes.

Each runs on every rank of a gloo pool. The training scenarios give dmuon one dim of a 2-D named
mesh (the other dim being tensor or pipeline parallelism that dmuon does not touch), or the two
dims of an HSDP mesh under any names, or torchtitan's dims (dp_replicate, dp_shard, cp, tp, with
``fsdp`` = dp_shard x cp flattened), and compare with the single-process reference of
``scenarios_protocol``, the data split over the data-parallel dims only. The others give dmuon
fewer data-parallel dims than FSDP2 has and return the message ``dmuon.Muon`` raised.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard_on
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.reference_errors import relative_errors_to
from tests.distributed.scenarios_protocol import (
    TrainConfig,
    build_reference,
    make_model,
    reference_step,
    train_step,
)
from tests.distributed.shared_reference import step_on_first_rank


def train_on_the_dp_dim_of_a_2d_mesh(
    *,
    dims: tuple[str, str],
    process_group_policy: str,
    layers_per_stage: tuple[int, int] = (3, 3),
    clip_max_norm: float | None = None,
    steps: int = 4,
) -> dict:
    """A 2x2 mesh named ``dims`` whose second dim is "dp": dmuon and FSDP2 get ``mesh["dp"]``.

    The first dim's index picks the model (``layers_per_stage``): pipeline stages may differ,
    tensor-parallel peers hold the same plain model and run the same data-parallel training.
    """
    outer, _ = dims
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    dp_mesh = mesh["dp"]
    stage = mesh[outer].get_local_rank()
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    config = TrainConfig(
        model={"num_layers": layers_per_stage[stage]}, steps=steps, clip_max_norm=clip_max_norm
    )

    model = make_model(config)
    dmuon.dedicate_params(model, dp_mesh, proj_predicate, process_group_policy=process_group_policy)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=config.weight_decay,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )
    reference, reference_optimizer = build_reference(config)

    max_errors = []
    for batch in batches(config.steps, dp_size):
        loss = loss_fn(model, rank_rows(batch, dp_rank, dp_size))
        loss.backward()
        if clip_max_norm is not None:
            dmuon.clip_grad_norm_(model, optimizer, clip_max_norm)
        optimizer.step()
        optimizer.zero_grad()
        reference_step(reference, reference_optimizer, batch, config)  # per stage: not shared
        max_errors.append(max(relative_errors_to(model, reference).values()))

    ownership = get_dedicated_state(model).mesh
    return {
        "stage": stage,
        "max_errors": max_errors,
        "rank_grid": [list(row) for row in ownership.rank_grid],
        "world_group_ranks": dist.get_process_group_ranks(ownership.world_group),
    }


# ---- HSDP by structure: any dim names, roles from the arguments -----------------------------


def train_hsdp_on_named_dims(
    *, dims: tuple[str, str], shard_dim: str, replicate_dim: str, steps: int = 4
) -> dict:
    """A 2x2 mesh named ``dims`` whose first dim is the replicate role (FSDP2's order); dmuon
    gets ``mesh[shard_dim]`` as mesh and ``mesh[replicate_dim]`` as replicate_mesh. The same
    training as ``scenarios_protocol.train_against_reference(replicas=2)``, and its results."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    config = TrainConfig(replicas=2, steps=steps)
    model = make_model(config)
    owners = dedicate_and_shard_on(
        model, mesh[shard_dim], replicate_mesh=mesh[replicate_dim], fsdp_mesh=mesh
    )
    optimizer = _muon(model, config)
    reference, reference_optimizer = build_reference(config)
    max_errors, losses = [], []
    for batch in batches(config.steps, dist.get_world_size()):
        losses.append(train_step(model, optimizer, batch, config))
        step_on_first_rank(reference, reference_step, reference, reference_optimizer, batch, config)
        max_errors.append(max(relative_errors_to(model, reference).values()))
    return {
        "max_errors": max_errors,
        "losses": losses,
        "owned": {
            p.fqn: p.master.detach().clone()
            for p in get_dedicated_state(model).iter_owned_masters()
        },
        "owners": {name: (c.shard, c.replicate) for name, c in owners.items()},
        "rank_grid": [list(row) for row in get_dedicated_state(model).mesh.rank_grid],
    }


def _muon(model, config: TrainConfig):
    return dmuon.Muon(
        model,
        lr=0.02,
        weight_decay=config.weight_decay,
        ns_backend=NewtonSchulz(backend="gram", dtype=torch.float32, kernel="cublas"),
    )


def forgotten_replicate_dim(wrapper: str = "fully_shard") -> str:
    """FSDP2 shards over a ("dp_replicate", "dp_shard") mesh (or a DDP averages over every
    rank); dmuon is given the shard dim alone. dmuon.Muon must refuse, on every rank."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = make_model(TrainConfig())
    if wrapper == "fully_shard":
        dedicate_and_shard_on(model, mesh["dp_shard"], fsdp_mesh=mesh)
        return _muon_error(model)
    dmuon.dedicate_params(model, mesh["dp_shard"], proj_predicate)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)  # over the default group
    try:
        return _muon_error(model)
    finally:
        del ddp_model


def _muon_error(model) -> str:
    try:
        _muon(model, TrainConfig())
    except ValueError as error:
        return str(error)
    return "no error"


def torchtitan_mesh(sizes: tuple[int, int, int, int]):
    """torchtitan's dense mesh (dp_replicate, dp_shard, cp, tp), with FSDP2's dim ``fsdp`` =
    dp_shard x cp flattened, as its parallel_dims builds them (there from a 1-D world mesh
    unflattened; here with init_device_mesh). Returns (mesh, fsdp)."""
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    return mesh, mesh["dp_shard", "cp"]._flatten("fsdp")


def _hsdp_mesh(mesh):
    """The 2-D (dp_replicate, fsdp) mesh ``fully_shard`` takes for HSDP. torch 2.13 warns that
    slicing a flattened dim from the root will go (torchtitan unflattens a "world" mesh into
    (dp_replicate, fsdp, tp) instead); the mesh is the same."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", "fsdp"]


def context_parallel_flattened(*, dedicated_dim: str, steps: int = 4) -> dict:
    """4 ranks as (dp_replicate 1, dp_shard 2, cp 2, tp 1): FSDP2 shards over ``fsdp`` (the CP
    ranks are data-parallel for the weights: here each gets its own rows). dmuon is given
    ``mesh[dedicated_dim]``: "dp_shard" must be refused, "fsdp" trains like the reference."""
    mesh, fsdp = torchtitan_mesh((1, 2, 2, 1))
    dp_mesh = fsdp if dedicated_dim == "fsdp" else mesh[dedicated_dim]
    config = TrainConfig(steps=steps)
    model = make_model(config)
    dedicate_and_shard_on(model, dp_mesh, fsdp_mesh=fsdp)
    try:
        optimizer = _muon(model, config)
    except ValueError as error:
        return {"error": str(error)}
    reference, reference_optimizer = build_reference(config)
    dp_rank, dp_size = fsdp.get_local_rank(), fsdp.size()
    max_errors = []
    for batch in batches(config.steps, dp_size):
        loss_fn(model, rank_rows(batch, dp_rank, dp_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_on_first_rank(reference, reference_step, reference, reference_optimizer, batch, config)
        max_errors.append(max(relative_errors_to(model, reference).values()))
    return {"error": None, "max_errors": max_errors}


def torchtitan_3d(*, dedicated_dims: tuple[str, str | None], steps: int = 4) -> dict:
    """8 ranks as (dp_replicate 2, dp_shard 1, cp 2, tp 2): ``parallelize_module`` on "tp",
    FSDP2 over (dp_replicate, fsdp). dmuon gets ``mesh[dedicated_dims[0]]`` as mesh and
    ``mesh[dedicated_dims[1]]`` as replicate_mesh (None: not given)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from tests.distributed.scenarios_tensor_parallel import (
        _train_against_reference,
        tensor_parallel_plan,
    )

    mesh, fsdp = torchtitan_mesh((2, 1, 2, 2))
    hsdp = _hsdp_mesh(mesh)
    shard_name, replicate_name = dedicated_dims
    dims = {"fsdp": fsdp, "dp_shard": mesh["dp_shard"], "dp_replicate": mesh["dp_replicate"]}
    config = TrainConfig(steps=steps)
    model = make_model(config)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=False))
    dedicate_and_shard_on(
        model,
        dims[shard_name],
        replicate_mesh=dims[replicate_name] if replicate_name else None,
        fsdp_mesh=hsdp,
    )
    dp_rank = hsdp["dp_replicate"].get_local_rank() * fsdp.size() + fsdp.get_local_rank()
    try:
        max_errors, _ = _train_against_reference(model, model, config, dp_rank, hsdp.size())
    except ValueError as error:
        return {"error": str(error)}
    state = get_dedicated_state(model)
    return {
        "error": None,
        "max_errors": max_errors,
        "rank_grid": [list(row) for row in state.mesh.rank_grid],
        "tp_ranks": list(state.mesh.tp_ranks),
    }
