"""The data parallelism of the rest of the model, which dmuon's reduce to owners must agree with:
over which ranks the other gradients are reduced, and with which scale.

Owns the check ``dmuon.Muon`` runs on the rest of the model (``check_data_parallel_layout``) and
the gradient divide factor of the dedicated gradients (``set_gradient_divide_factor``,
``gradient_divisor``). It reads meshes, process groups and factors; it must not issue collectives
nor move tensors (the owners divide, in ``group.average_messages``).

[Note: replicas dmuon does not know about]
``dedicate_params`` sees only the meshes it is given: the shard dim of an HSDP mesh without its
replicate dim (or torchtitan's ``dp_shard`` where FSDP2 shards over the flattened ``fsdp`` =
``dp_shard x cp``) is a valid 1-D mesh. But then each replica (each CP rank) is its own ownership
grid, owning and stepping its own copy of every dedicated weight, fed by its own gradients only:
the copies drift apart while the rest of the model, averaged by FSDP2 over every rank, does not.
Nothing would say so. So when the optimizer is built (on every rank, after ``fully_shard``),
every parameter dmuon does not own is looked at: the ranks its DTensor's mesh spans on its
data-parallel dims (its dims other than the model-parallel ones ``dedicate_params`` recorded:
see [Note: HSDP by structure] in ``dmuon.mesh``), and the ranks a ``DistributedDataParallel``
around the model averages over, must lie within dmuon's grid. Each rank computes this from the
meshes alone, the same on every rank, so every rank raises and none waits in a collective. A
mesh spanning fewer ranks (FSDP2 on expert-parallel sub-meshes) is allowed.

[Note: one gradient scale per model]
FSDP2 divides the gradients it sums over its data-parallel ranks by their number (the mean)
unless ``FSDPModule.set_gradient_divide_factor(factor)`` says otherwise; torchtitan sets 1.0 on
every FSDP module (a sum: its loss is a local sum over the global token count). The owners divide
the dedicated gradients, summed over the grid's G x R ranks, by the same number: the factor the
model's FSDP modules were given (``dmuon.fsdp2`` records it), else the one given to
``dmuon.set_gradient_divide_factor(model, factor)`` (for DDP and other models without FSDP2),
else G x R. Every gradient of the model then has one scale, which ``dmuon.clip_grad_norm_``
needs. FSDP2's method does not recurse, so ``model.set_gradient_divide_factor(1.0)`` on the root
alone would leave the blocks averaging: FSDP modules (those that manage parameters) with
different factors raise a ValueError naming them, at ``dmuon.Muon`` and at every backward that
finds them so, rather than give the model mixed scales. The factor is read at each end of
backward, so changing it between steps takes effect at the next backward.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dmuon import fsdp2
from dmuon._text import preview_names
from dmuon.ddp import ddp_wrappers
from dmuon.mesh import data_parallel_ranks
from dmuon.param import is_dedicated

if TYPE_CHECKING:
    from dmuon.hooks import DedicatedState

REPLICAS_OUTSIDE_GRID = (
    "dmuon.Muon: {what} over {dims} spanning ranks {ranks}, but dedicate_params was given "
    "{dmuon}. Ranks {outside} would be replicas that own and update their own copies of the "
    "dedicated weights, which would drift apart without a word. Give dedicate_params the "
    "data-parallel dims {engine} got: {fix}"
)
MIXED_FACTORS = (
    "dmuon: the FSDP modules of this model divide their gradients by different factors "
    "({seen}), so its gradients would come out at different scales (the gradient norm and "
    "clipping would mix them) and dmuon cannot give the dedicated gradients the model's scale. "
    "Set one factor on every FSDP module (FSDPModule.set_gradient_divide_factor does not "
    "recurse): for m in model.modules(): if isinstance(m, FSDPModule): "
    "m.set_gradient_divide_factor(factor); or dmuon.set_gradient_divide_factor(model, factor), "
    "which does that too."
)
FACTOR_CONFLICT = (
    "dmuon: dmuon.set_gradient_divide_factor(model, {explicit}) was called, but the FSDP modules "
    "of this model now divide their gradients by {fsdp}, so the dedicated gradients and the "
    "others would come out at different scales. Call dmuon.set_gradient_divide_factor(model, "
    "factor) again (it sets the FSDP modules too) instead of setting them one by one."
)

_UNSET = object()
# state -> the factor given to dmuon.set_gradient_divide_factor (absent: never called).
_explicit_factors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---- the ranks the rest of the model is reduced over -------------------------------------------


def check_data_parallel_layout(state: DedicatedState) -> None:
    """Raise on every rank if the rest of the model is reduced over ranks outside dmuon's grid
    ([Note: replicas dmuon does not know about]) or with mixed gradient divide factors ([Note:
    one gradient scale per model]). Local: no collective."""
    model = state.model
    if fsdp2.is_fully_sharded(model):
        fsdp2.require_divide_factor_integration()
    if dist.is_initialized():
        _refuse_replicas_outside_grid(state)
    state.remember_fsdp_reducers(_fsdp_modules_with_parameters(model))
    gradient_divisor(state)


def _refuse_replicas_outside_grid(state: DedicatedState) -> None:
    grid = set(state.mesh.ranks)
    dmuon = state.mesh.describe()
    looked: set[int] = set()
    for name, param in state.model.named_parameters():
        if is_dedicated(param) or not isinstance(param, DTensor):
            continue
        if id(param.device_mesh) in looked:
            continue
        looked.add(id(param.device_mesh))
        dims, ranks = data_parallel_ranks(param.device_mesh, state.mesh.model_parallel_dims)
        outside = sorted(set(ranks) - grid)
        if outside:
            raise ValueError(
                REPLICAS_OUTSIDE_GRID.format(
                    what=f"FSDP2 shards {name}",
                    dims=f"the data-parallel mesh dims {dims}",
                    ranks=list(ranks),
                    dmuon=dmuon,
                    outside=outside,
                    engine="fully_shard",
                    fix=_fix_for(param, dims),
                )
            )
    for ddp in ddp_wrappers(state.model):
        ranks = sorted(dist.get_process_group_ranks(ddp.process_group))
        outside = sorted(set(ranks) - grid)
        if outside:
            raise ValueError(
                REPLICAS_OUTSIDE_GRID.format(
                    what="the DistributedDataParallel around this model averages",
                    dims="its process group",
                    ranks=ranks,
                    dmuon=dmuon,
                    outside=outside,
                    engine="DistributedDataParallel",
                    fix=(
                        f"the whole data-parallel mesh (a 1-D mesh over ranks {ranks}) as mesh, "
                        "e.g. dmuon.dedicate_params_ddp(model, mesh, predicate), which also "
                        "wraps the model in DDP over that mesh's group."
                    ),
                )
            )


def _fix_for(param: DTensor, dims: tuple[str, ...] | None) -> str:
    """The dedicate_params call that matches FSDP2's data-parallel dims: those it shards the
    parameter over (Shard placements) as mesh, those it replicates it over as replicate_mesh;
    several of one kind flattened into one dim."""
    placements = dict(zip(param.device_mesh.mesh_dim_names or (), param.placements))
    shard = [dim for dim in dims or () if placements[dim].is_shard()]
    replicate = [dim for dim in dims or () if not placements[dim].is_shard()]
    if not shard:
        return (
            "its shard dim as mesh and, under HSDP, its replicate dim as replicate_mesh (dims of "
            "one named mesh, e.g. init_device_mesh(device_type, (replicate_size, shard_size), "
            'mesh_dim_names=("replicate", "shard"))).'
        )
    call = f"dmuon.dedicate_params(model, {_one_dim(shard)}, predicate"
    if replicate:
        call += f", replicate_mesh={_one_dim(replicate)}"
    return call + ")."


def _one_dim(dims: list[str]) -> str:
    if len(dims) == 1:
        return f'mesh["{dims[0]}"]'
    names = ", ".join(f'"{dim}"' for dim in dims)
    return f'mesh[{names}]._flatten("{"_".join(dims)}")'


# ---- the scale of the dedicated gradients -----------------------------------------------------


def set_gradient_divide_factor(state: DedicatedState, factor: float | None) -> None:
    """Divide the summed dedicated gradients by ``factor`` (None: by the number of data-parallel
    ranks, the mean), and set it on every FSDP module of the model too."""
    _check_factor(factor, "dmuon.set_gradient_divide_factor")
    _explicit_factors[state] = None if factor is None else float(factor)
    for module in state.model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)


def gradient_divisor(state: DedicatedState) -> float:
    """What the owners divide the gradients summed over the grid by: see [Note: one gradient
    scale per model]. Raises ValueError if the model's FSDP modules disagree."""
    modules = state.fsdp_reducers
    if modules is None:  # dmuon.Muon has not looked yet
        modules = _fsdp_modules_with_parameters(state.model)
    by_factor: dict[float | None, list[str]] = {}
    for name, module in modules:
        by_factor.setdefault(fsdp2.gradient_divide_factor(module), []).append(name)
    explicit = _explicit_factors.get(state, _UNSET)
    if len(by_factor) > 1:
        seen = "; ".join(
            f"{_factor_label(factor)} on {_modules_label(names)}"
            for factor, names in by_factor.items()
        )
        raise ValueError(MIXED_FACTORS.format(seen=seen))
    if by_factor:
        (factor,) = by_factor
        if explicit is not _UNSET and explicit != factor:
            raise ValueError(FACTOR_CONFLICT.format(explicit=explicit, fsdp=_factor_label(factor)))
    else:
        factor = None if explicit is _UNSET else explicit
    if factor is None:
        return float(state.mesh.num_slots)
    _check_factor(factor, "FSDPModule.set_gradient_divide_factor")
    return float(factor)


def _fsdp_modules_with_parameters(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of the FSDP2 modules of ``model`` that manage parameters: each sharded
    (DTensor) parameter belongs to the lowest FSDP2 module around it. An FSDP2 module whose
    parameters are all dedicated reduces nothing, so its factor does not matter."""
    managing: dict[int, tuple[str, nn.Module]] = {}

    def visit(prefix: str, module: nn.Module, owner: tuple[str, nn.Module] | None) -> None:
        if isinstance(module, FSDPModule):
            owner = (prefix, module)
        if (
            owner is not None
            and id(owner[1]) not in managing
            and any(isinstance(p, DTensor) for p in module.parameters(recurse=False))
        ):
            managing[id(owner[1])] = owner
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child, owner)

    visit("", model, None)
    return list(managing.values())


def _check_factor(factor: object, where: str) -> None:
    if factor is None:
        return
    valid = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    if not valid or not math.isfinite(factor) or factor <= 0:
        raise ValueError(
            f"{where}: the gradient divide factor must be a positive number or None, got "
            f"{factor!r}. Pass 1.0 to sum the gradients over the data-parallel ranks (a loss "
            "divided by the global token count), or None to average them (the default)."
        )


def _factor_label(factor: float | None) -> str:
    return "none (the mean over the data-parallel ranks)" if factor is None else f"{factor}"


def _modules_label(names: list[str]) -> str:
    return preview_names([repr(name) if name else "the root" for name in names])
