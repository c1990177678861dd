"""``summarize_param_groups``: which optimizer route, owner and dtypes each parameter has.

Owns the rank-local routing summary of a model and its optimizer. It reads ``dmuon.inspect``, the
optimizer's param groups and (for FSDP2-managed parameters) the mixed-precision policy; it must
not issue collectives nor change anything it reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import dmuon.inspect
from dmuon.inspect import ADAMW_ROUTE, ExpertStackView, ModelView, ParamView
from dmuon_tools._json import dtype_name, jsonable, owner_dict, this_rank

FROZEN_ROUTE = "frozen"


def summarize_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Routes, owners, shapes and dtypes of every parameter, and the optimizer's groups.

    Rank-local, no collectives; the result is plain JSON (``json.dumps`` needs no ``default``).

    Returns a dict with:
        ``rank``, ``mesh`` (this rank's owner coordinate and the grid size; None when the model has
        no dedicated parameters), ``optimizer`` (type and, for ``dmuon.Muon``, the Newton-Schulz
        request), ``groups`` (per optimizer group: route, hyperparameters, ``num_params``,
        ``numel`` — elements this rank's optimizer updates — and ``global_numel``), ``params``
        (per FQN: ``route`` "muon" / "adamw" / "frozen", ``dedicated``, ``owner``,
        ``owner_rank``, ``is_owner``, ``shape`` (full shape; the global shape for DTensors),
        ``param_dtype`` (forward compute dtype), ``master_dtype`` (dtype of what the optimizer
        updates on this rank; None where this rank updates nothing), ``fsdp2``, ``group``
        (index of the optimizer group holding it on this rank, or None)) and ``totals`` per route.
        An expert stack (E, m, n) has ``owner`` and ``owner_rank`` None and ``expert_slices``:
        per contiguous range of its experts, ``experts`` [start, stop), ``owner``,
        ``owner_rank`` and ``is_owner``.
    """
    view = dmuon.inspect.view(model) if dmuon.inspect.is_prepared(model) else None
    dedicated = view.params if view is not None else {}
    stacks = view.expert_stacks if view is not None else {}
    group_of = _group_index_by_tensor(optimizer)
    compute_dtypes = dmuon.inspect.fsdp2_compute_dtypes(model)

    params: dict[str, dict[str, Any]] = {}
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        name = dmuon.inspect.canonical_fqn(name)  # as dmuon names them (wrapper segments out)
        if name in dedicated:
            entry = _dedicated_entry(dedicated[name], group_of)
        elif name in stacks:
            entry = _expert_stack_entry(stacks[name], dedicated, group_of)
        else:
            entry = _regular_entry(param, group_of, compute_dtypes)
        if id(param) in first_name and name not in dedicated:
            entry["tied_to"] = first_name[id(param)]
        first_name.setdefault(id(param), name)
        params[name] = entry

    return {
        "rank": this_rank(),
        "mesh": _mesh_entry(view),
        "optimizer": _optimizer_entry(optimizer),
        "groups": [
            _group_entry(index, group) for index, group in enumerate(optimizer.param_groups)
        ],
        "params": params,
        "totals": _totals(params),
    }


def _dedicated_entry(p: ParamView, group_of: dict[int, int]) -> dict[str, Any]:
    return {
        "route": p.route if p.requires_grad else FROZEN_ROUTE,
        "dedicated": True,
        "owner": owner_dict(p.owner),
        "owner_rank": p.owner_rank,
        "is_owner": p.is_owner,
        "shape": list(p.shape),
        "numel": p.numel,
        "param_dtype": dtype_name(p.param_dtype),
        "reduce_dtype": dtype_name(p.reduce_dtype),
        "master_dtype": dtype_name(p.master_dtype),
        "fsdp2": False,
        "requires_grad": p.requires_grad,
        "group": group_of.get(id(p.master)) if p.master is not None else None,
    }


def _expert_stack_entry(
    stack: ExpertStackView, pieces: dict[str, ParamView], group_of: dict[int, int]
) -> dict[str, Any]:
    """A stack as one parameter of its full shape; its pieces' owners in ``expert_slices``."""
    views = [pieces[name] for name in stack.pieces]
    owned = [p for p in views if p.master is not None]
    master_dtypes = [p.master_dtype for p in views if p.master_dtype is not None]
    return {
        **_dedicated_entry(views[0], group_of),
        "owner": None,
        "owner_rank": None,
        "is_owner": any(p.is_owner for p in views),
        "shape": list(stack.shape),
        "numel": stack.numel,
        "master_dtype": dtype_name(master_dtypes[0]) if master_dtypes else None,
        "group": group_of.get(id(owned[0].master)) if owned else None,
        "expert_slices": [
            {
                "experts": list(experts),
                "owner": owner_dict(p.owner),
                "owner_rank": p.owner_rank,
                "is_owner": p.is_owner,
            }
            for p, experts in zip(views, stack.experts)
        ],
    }


def _regular_entry(
    param: nn.Parameter, group_of: dict[int, int], compute_dtypes: dict[int, torch.dtype]
) -> dict[str, Any]:
    trainable = param.requires_grad
    return {
        "route": ADAMW_ROUTE if trainable else FROZEN_ROUTE,
        "dedicated": False,
        "owner": None,
        "owner_rank": None,
        "is_owner": None,
        "shape": list(param.shape),  # a DTensor's shape is its global shape
        "numel": param.numel(),
        "param_dtype": dtype_name(compute_dtypes.get(id(param), param.dtype)),
        "reduce_dtype": None,
        # The optimizer updates the parameter (or this rank's shard of it) in place.
        "master_dtype": dtype_name(param.dtype) if trainable else None,
        "fsdp2": isinstance(param, DTensor),
        "requires_grad": trainable,
        "group": group_of.get(id(param)),
    }


def _group_index_by_tensor(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    return {
        id(tensor): index
        for index, group in enumerate(optimizer.param_groups)
        for tensor in group["params"]
    }


def _group_entry(index: int, group: dict[str, Any]) -> dict[str, Any]:
    tensors = group["params"]
    return {
        "index": index,
        "route": group.get("route"),
        "hyperparameters": {
            key: jsonable(value) for key, value in group.items() if key not in ("params", "route")
        },
        "num_params": len(tensors),
        "numel": sum(_local_numel(t) for t in tensors),
        "global_numel": sum(t.numel() for t in tensors),
    }


def _local_numel(tensor: torch.Tensor) -> int:
    return tensor.to_local().numel() if isinstance(tensor, DTensor) else tensor.numel()


def _optimizer_entry(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"}
    newton_schulz = getattr(optimizer, "newton_schulz", None)
    if newton_schulz is not None:
        entry["newton_schulz"] = newton_schulz.config.as_dict()
        entry["newton_schulz_kernel"] = repr(newton_schulz)
    if hasattr(optimizer, "replicate_async"):
        entry["replicate_async"] = bool(optimizer.replicate_async)
    return entry


def _mesh_entry(view: ModelView | None) -> dict[str, Any] | None:
    if view is None:
        return None
    grid = view.grid
    return {
        "num_shards": grid.num_shards,
        "num_replicas": grid.num_replicas,
        "coord": owner_dict(grid.coord),
        "rank_grid": [list(row) for row in grid.rank_grid],
    }


def _totals(params: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    totals: dict[str, dict[str, int]] = {}
    for entry in params.values():
        if "tied_to" in entry:
            continue
        route = totals.setdefault(entry["route"], {"num_params": 0, "numel": 0})
        route["num_params"] += 1
        route["numel"] += entry["numel"]
    return totals
