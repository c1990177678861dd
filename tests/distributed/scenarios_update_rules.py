"""Scenarios of the opt-in update rules (NorMuon, bf16 momentum, row blocks) on every rank of a
gloo pool, against the single-process reference written from their formulas
(``dmuon.testing.ReferenceMuonAdamW``), and through checkpoints.

Every run trains the tiny decoder on the same global batches (``GLOBAL_ROWS`` rows a step, split
evenly over the ranks), so the training is the same on any world size up to the order of float
additions, and one reference run of all the steps checks a run resumed on another layout.
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import dmuon
import dmuon.checkpoint as dckpt
from dmuon.hooks import get_dedicated_state
from dmuon.testing import dedicate_and_shard_on
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.layouts import data_parallel_meshes
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows
from tests.distributed.reference_errors import relative_errors_to
from tests.distributed.scenarios_protocol import current_weights, relative_errors
from tests.distributed.scenarios_tensor_parallel import full_weights, tensor_parallel_plan
from tests.distributed.shared_reference import step_on_first_rank
from tests.reference_optim import ReferenceMuonAdamW

LR, WEIGHT_DECAY = 0.02, 0.01
GLOBAL_ROWS = 8  # divisible by the world sizes used (2, 4)
MAX_STEPS = 6
# q_proj (30, 30) in 5 heads of 6 rows; layers.1.up_proj (52, 30) in a tall (40, 30) block and
# a wide (12, 30) one, as a fused projection of two unequal parts would be.
ROW_BLOCKS = {"layers.*.q_proj.weight": 6, "layers.1.up_proj.weight": [40, 12]}
REFERENCE_ROW_BLOCKS = {
    **{f"layers.{i}.q_proj.weight": (6,) * 5 for i in range(3)},
    "layers.1.up_proj.weight": (40, 12),
}
# param_groups= that keeps layer 2 on plain Muon with fp32 momentum (per-group options).
LAYER_2_PLAIN = [
    {
        "params": lambda name, p: name.startswith("layers.2.") and proj_predicate(name, p),
        "normuon": False,
        "momentum_dtype": torch.float32,
    }
]


def build(replicas: int, row_blocks: bool, **muon_options):
    torch.manual_seed(0)
    model = TinyDecoder()
    shard_mesh, replicate_mesh, fsdp_mesh = data_parallel_meshes(replicas)
    dmuon.dedicate_params(
        model,
        shard_mesh,
        proj_predicate,
        replicate_mesh=replicate_mesh,
        row_blocks=ROW_BLOCKS if row_blocks else None,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        **muon_options,
    )
    return model, optimizer


def build_reference(normuon: bool, momentum_dtype, row_blocks: bool, layer_2_plain: bool = False):
    torch.manual_seed(0)
    reference = TinyDecoder()
    per_param = {}
    if layer_2_plain:
        per_param = {
            name: {"normuon_beta2": None, "momentum_dtype": None}
            for name, _ in reference.named_parameters()
            if name.startswith("layers.2.")
        }
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        proj_predicate,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=functools.partial(newton_schulz, backend="gram", dtype=torch.float32),
        momentum_dtype=momentum_dtype,
        normuon_beta2=0.95 if normuon else None,
        row_blocks=REFERENCE_ROW_BLOCKS if row_blocks else None,
        per_param=per_param,
    )
    return reference, optimizer


def train(model, optimizer, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    every = batches(MAX_STEPS, 1, per_rank=GLOBAL_ROWS)
    for step in steps:
        loss_fn(model, rank_rows(every[step], rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()


def train_reference(reference, optimizer, steps: range) -> None:
    every = batches(MAX_STEPS, 1, per_rank=GLOBAL_ROWS)
    for step in steps:
        loss_fn(reference, every[step]).backward()
        optimizer.step()
        optimizer.zero_grad()


def train_against_reference(
    replicas: int = 1,
    normuon: bool = False,
    momentum_dtype: torch.dtype = torch.float32,
    row_blocks: bool = False,
    layer_2_plain: bool = False,
    steps: int = 4,
) -> dict:
    """Per-step max relative weight error against the reference, and the momentum dtypes."""
    model, optimizer = build(
        replicas,
        row_blocks,
        normuon=normuon,
        momentum_dtype=momentum_dtype,
        param_groups=LAYER_2_PLAIN if layer_2_plain else None,
    )
    reference, reference_optimizer = build_reference(
        normuon, momentum_dtype, row_blocks, layer_2_plain
    )
    max_errors = []
    for step in range(steps):
        train(model, optimizer, range(step, step + 1))
        steps_now = range(step, step + 1)
        step_on_first_rank(reference, train_reference, reference, reference_optimizer, steps_now)
        max_errors.append(max(relative_errors_to(model, reference).values()))
    return {"max_errors": max_errors, **state_summary(model, optimizer)}


def state_summary(model, optimizer) -> dict:
    """Per owned Muon matrix: its state's entries with dtype and shape."""
    return {
        "state": {
            p.fqn: {
                name: (str(t.dtype), tuple(t.shape))
                for name, t in optimizer.state[p.master].items()
            }
            for p in get_dedicated_state(model).iter_owned_masters()
            if p.route == "muon" and p.master in optimizer.state
        }
    }


def save_after(path: str, replicas: int = 1, steps: int = 2, **muon_options) -> None:
    model, optimizer = build(replicas, row_blocks=True, **muon_options)
    train(model, optimizer, range(steps))
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    dckpt.save({"model": model_sd, "optim": optim_sd}, path)


def resume_against_reference(
    path: str, replicas: int = 1, saved_at: int = 2, steps: int = 4, **muon_options
) -> dict:
    """A fresh model loaded from ``path`` trains to ``steps``; its weights against a reference
    that trained every step without interruption (the rule of ``muon_options``)."""
    model, optimizer = build(replicas, row_blocks=True, **muon_options)
    model_sd, optim_sd = dckpt.get_state_dict(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dckpt.load({"model": model_sd, "optim": optim_sd}, path)
        dckpt.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    summary = state_summary(model, optimizer)
    train(model, optimizer, range(saved_at, steps))
    reference, reference_optimizer = build_reference(
        muon_options.get("normuon", False), muon_options.get("momentum_dtype"), row_blocks=True
    )
    train_reference(reference, reference_optimizer, range(steps))
    return {
        "max_error": max(relative_errors_to(model, reference).values()),
        "warnings": [str(w.message) for w in caught if "dmuon" in str(w.message)],
        "rules": [(g["normuon"], g["momentum_dtype"]) for g in optimizer.param_groups[:1]],
        **summary,
    }


def torch_state_dict_round_trip(older_groups: bool = False, **muon_options) -> dict:
    """``optimizer.state_dict()`` after 2 steps loaded into a second model and optimizer (its
    weights copied over): both train 2 more steps and must end identical. ``older_groups``:
    the saved groups lack the options of issue 26, as a state dict saved before them would."""
    model, optimizer = build(1, row_blocks=True, **muon_options)
    train(model, optimizer, range(2))
    saved = copy.deepcopy(optimizer.state_dict())
    if older_groups:
        for group in saved["param_groups"]:
            for key in ("normuon", "normuon_beta2", "normuon_eps", "momentum_dtype"):
                group.pop(key, None)
    twin, twin_optimizer = build(1, row_blocks=True, **muon_options)
    dckpt.set_model_state_dict(twin, dckpt.get_model_state_dict(model))
    twin_optimizer.load_state_dict(saved)
    summary = state_summary(twin, twin_optimizer)
    train(model, optimizer, range(2, 4))
    train(twin, twin_optimizer, range(2, 4))
    mine, theirs = current_weights(model), current_weights(twin)
    return {
        "identical": all(torch.equal(mine[k], theirs[k]) for k in mine),
        "rules": [(g["normuon"], g["momentum_dtype"]) for g in twin_optimizer.param_groups[:1]],
        **summary,
    }


# ---- layouts the rules meet: tensor parallelism -----------------------------------------------


def tensor_parallel_against_reference(tp: int = 2, steps: int = 3, **muon_options) -> dict:
    """dp x tp (torch's colwise / rowwise plan) with ``muon_options``: the worst relative weight
    error after each step against the reference, and what NorMuon and row blocks say there."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TinyDecoder()
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=False))
    dedicate_and_shard_on(model, mesh["dp"])
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
        **muon_options,
    )
    reference, reference_optimizer = build_reference(
        False, muon_options.get("momentum_dtype"), row_blocks=False
    )
    dp_rank, dp = mesh["dp"].get_local_rank(), world // tp
    every = batches(MAX_STEPS, 1, per_rank=GLOBAL_ROWS)
    max_errors = []
    for step in range(steps):
        loss_fn(model, rank_rows(every[step], dp_rank, dp)).backward()
        optimizer.step()
        optimizer.zero_grad()
        train_reference(reference, reference_optimizer, range(step, step + 1))
        max_errors.append(max(relative_errors(full_weights(model), reference).values()))
    dtypes = {
        str(state["momentum_buffer"].dtype)
        for state in optimizer.state.values()
        if "momentum_buffer" in state
    }
    return {"max_errors": max_errors, "momentum_dtypes": sorted(dtypes)}


def tensor_parallel_refusals() -> dict[str, str]:
    """The messages of NorMuon, int8 momentum and row blocks on tensor-parallel matrices."""
    world = dist.get_world_size()
    messages = {}
    for option in ("normuon", "int8", "row_blocks"):
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        model = TinyDecoder()
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(sequence_parallel=False))
        try:
            if option == "row_blocks":
                dmuon.dedicate_params(
                    model, mesh["dp"], proj_predicate, row_blocks={"layers.0.q_proj.weight": 6}
                )
            else:
                dedicate_and_shard_on(model, mesh["dp"])
                options = {"normuon": True} if option == "normuon" else {"momentum_dtype": "int8"}
                dmuon.Muon(model, **options)
        except ValueError as error:
            messages[option] = str(error)
    return messages
