"""The DDP path: replicated (not sharded) training with torch's ``DistributedDataParallel``.

Owns three things for models that ``fully_shard`` does not wrap:

- making ``DistributedDataParallel(model)`` skip the dedicated parameters (``dedicate_params``
  calls ``ignore_dedicated_in_ddp``), so DDP averages only the other gradients and needs no
  ``find_unused_parameters``: a placeholder never gets a gradient, and its gradient goes to the
  owner through dmuon's own reduce;
- the construction-time rule of ``dmuon.Muon`` (``check_gradients_are_averaged``): with more than
  one owner slot, every trainable parameter dmuon does not own must be sharded by FSDP2 (a
  DTensor) or averaged by a ``DistributedDataParallel`` over the same ranks, else each rank
  would step AdamW on its own local gradient and the copies would drift apart silently;
- the DDP wrappers around a model, for ``dmuon.no_sync``.

It reads two public attributes of a DDP instance (``module``, ``require_backward_grad_sync``)
and ``process_group``, and, through ``_torch_internals``, what its reducer averages and the
ignore list DDP reads at construction, which it writes. It must not issue collectives outside
``check_gradients_are_averaged``.

[Note: finding the DDP around a model]
``dmuon.Muon`` takes the inner module (the one ``dedicate_params`` prepared), so it cannot see the
wrapper: DDP marks nothing on the module it wraps. The rule is therefore "wrap in
``DistributedDataParallel`` before constructing ``dmuon.Muon``", and the check finds the live
DDP instances with one pass over the garbage collector's objects (a DDP is an ``nn.Module``,
always tracked). What decides is what each DDP's reducer actually averages
(``_module_parameters``), so a DDP built before ``dedicate_params`` (it would wait for the
replaced originals' gradients forever), around a parent module that lists no ignored names, or
over other ranks is caught, not trusted. The pass runs only when some trainable parameter is neither dedicated nor a DTensor
(never on the FSDP2 path), and its result is kept for ``no_sync``.
"""

from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dmuon._text import preview_names
from dmuon._torch_internals import (
    composable_api_names,
    ddp_ignored_names,
    ddp_reduced_parameters,
    set_ddp_ignored,
)
from dmuon.param import DedicatedParam, is_dedicated

if TYPE_CHECKING:
    from dmuon.hooks import DedicatedState

NOT_AVERAGED = (
    "dmuon.Muon: {count} trainable parameters are neither sharded by fully_shard nor averaged by "
    "DistributedDataParallel ({names}), and this model spans {slots} ranks: each rank would step "
    "AdamW on its own local gradient and the copies would drift apart. After "
    "dmuon.dedicate_params, and before dmuon.Muon(model, ...), either wrap the model in "
    "torch.nn.parallel.DistributedDataParallel(model) (no find_unused_parameters needed: "
    "dedicate_params makes DDP skip the dedicated parameters), or call dmuon.dedicate_params_ddp"
    "(model, mesh, predicate), which does both; or shard it with fully_shard(layer, mesh=mesh) "
    "for each layer, then fully_shard(model, mesh=mesh)."
)
DDP_REDUCES_DEDICATED = (
    "dmuon.Muon: a DistributedDataParallel around this model averages the dedicated parameters "
    "{names}, whose gradients dmuon reduces to their owners; DDP would wait for gradients that "
    "never come. It wraps a module that contains the model, and reads that module's ignore list: "
    "call dmuon.dedicate_params on the module you wrap (then DistributedDataParallel(it)), or "
    "use dmuon.dedicate_params_ddp(model, mesh, predicate)."
)
DDP_BUILT_BEFORE = (
    "dmuon.Muon: the DistributedDataParallel around this model was built before "
    "dmuon.dedicate_params: it averages {count} parameters that dedicate_params has since "
    "replaced with its placeholders, and would wait for their gradients forever. Call "
    "dmuon.dedicate_params(model, mesh, predicate) first, then DistributedDataParallel(model) "
    "(or dmuon.dedicate_params_ddp(model, mesh, predicate))."
)
DDP_OTHER_RANKS = (
    "dmuon.Muon: the DistributedDataParallel around this model averages over ranks {ddp_ranks}, "
    "but dmuon's mesh spans ranks {dmuon_ranks}: the two halves of each gradient would be "
    "averaged over different ranks. Pass the mesh's group: DistributedDataParallel(model, "
    "process_group=mesh.get_group()), or use dmuon.dedicate_params_ddp(model, mesh, predicate)."
)
COMPOSABLE_REPLICATE = (
    "dmuon.Muon: {module} is wrapped by torch.distributed._composable.replicate, which averages "
    "every parameter it finds, the dedicated placeholders included (it reads no ignore list), so "
    "its DDP would wait for gradients dmuon sends to their owners. Use "
    "torch.nn.parallel.DistributedDataParallel(model) after dmuon.dedicate_params (or "
    "dmuon.dedicate_params_ddp(model, mesh, predicate)) instead."
)

# model -> the DDP instances found around it (weakly held both ways).
_wrappers: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref]] = weakref.WeakKeyDictionary()


def ignore_dedicated_in_ddp(model: nn.Module, params: dict[str, DedicatedParam]) -> None:
    """Make a later ``DistributedDataParallel(model)`` skip the dedicated parameters.

    Adds their names to the model's DDP ignore list (kept: the names already there) and marks
    the placeholders as DDP marks what it ignores. DDP compares a root module's parameter both
    as ``"weight"`` and as ``".weight"`` (its reducer joins an empty module name with a dot), so
    root-level names are listed both ways.
    """
    ignored = ddp_ignored_names(model)
    for name, p in params.items():
        name = p.stack.fqn if p.stack is not None else name  # an expert piece: its stack's FQN
        for form in (name, "." + name) if "." not in name else (name,):
            if form not in ignored:
                ignored.append(form)
    set_ddp_ignored(model, ignored, [p.placeholder for p in params.values()])


def check_gradients_are_averaged(state: DedicatedState) -> None:
    """Raise on every rank unless every trainable parameter dmuon does not own is averaged.

    Averaged means: a DTensor (FSDP2 shards it and reduce-scatters its gradient) or averaged by
    a ``DistributedDataParallel`` that wraps the model (or a module containing it) over the
    ranks of dmuon's mesh; see [Note: finding the DDP around a model]. With one owner slot there
    is nothing to average. One ``all_gather_object`` over the mesh's ranks, so a rank-dependent
    wrapping fails everywhere instead of leaving ranks waiting in the next collective.
    """
    mesh = state.mesh
    if mesh.num_slots == 1 or mesh.world_group is None:
        return
    problem = _local_problem(state)
    problems: list[str | None] = [None] * dist.get_world_size(mesh.world_group)
    dist.all_gather_object(problems, problem, group=mesh.world_group)
    if problem is not None:
        raise ValueError(problem)
    ranks = dist.get_process_group_ranks(mesh.world_group)
    failed = {rank: text for rank, text in zip(ranks, problems) if text is not None}
    if failed:
        first = min(failed)
        raise ValueError(
            f"dmuon.Muon failed on ranks {sorted(failed)} (this rank is fine); rank {first} "
            f"says: {failed[first]}"
        )


def ddp_wrappers(model: nn.Module) -> list[DistributedDataParallel]:
    """The live ``DistributedDataParallel`` instances whose module is or contains ``model``."""
    known = [ref() for ref in _wrappers.get(model, ())]
    if known and all(ddp is not None for ddp in known):
        return known  # type: ignore[return-value]
    if not _replicated_candidates(model):
        return []
    # type(), not isinstance(): a dead weakref.proxy among the objects raises on isinstance.
    found = [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), DistributedDataParallel)
        and any(module is model for module in obj.module.modules())
    ]
    if found:
        _wrappers[model] = [weakref.ref(ddp) for ddp in found]
    return found


# ---- the check's parts ----------------------------------------------------------------------


def _replicated_candidates(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters that are neither dedicated nor FSDP2 DTensors, by first name."""
    return {
        name: param
        for name, param in model.named_parameters()
        if param.requires_grad and not is_dedicated(param) and not isinstance(param, DTensor)
    }


def _local_problem(state: DedicatedState) -> str | None:
    model = state.model
    candidates = _replicated_candidates(model)
    if not candidates:
        return None
    replicated = _composably_replicated(model)
    if replicated is not None:
        return COMPOSABLE_REPLICATE.format(module=replicated)
    averaged: set[int] = set()
    placeholders = {id(p.placeholder): p.fqn for p in state.params.values()}
    for ddp in ddp_wrappers(model):
        reduced = [p for p in ddp_reduced_parameters(ddp) if p.requires_grad]
        current = {id(p) for p in ddp.module.parameters()}
        gone = [p for p in reduced if id(p) not in current]
        if gone:
            return DDP_BUILT_BEFORE.format(count=len(gone))
        wrongly = [placeholders[id(p)] for p in reduced if id(p) in placeholders]
        if wrongly:
            return DDP_REDUCES_DEDICATED.format(names=preview_names(wrongly))
        ddp_ranks = sorted(dist.get_process_group_ranks(ddp.process_group))
        dmuon_ranks = sorted(r for row in state.mesh.rank_grid for r in row)
        if ddp_ranks != dmuon_ranks:
            return DDP_OTHER_RANKS.format(ddp_ranks=ddp_ranks, dmuon_ranks=dmuon_ranks)
        averaged.update(id(p) for p in reduced)
    missing = [name for name, param in candidates.items() if id(param) not in averaged]
    if not missing:
        return None
    return NOT_AVERAGED.format(
        count=len(missing), names=preview_names(missing), slots=state.mesh.num_slots
    )


def _composably_replicated(model: nn.Module) -> str | None:
    """The name of a module of ``model`` that ``_composable.replicate`` wraps, if any."""
    for name, module in model.named_modules():
        if "replicate" in composable_api_names(module):
            return f"module {name!r}" if name else "the model"
    return None
