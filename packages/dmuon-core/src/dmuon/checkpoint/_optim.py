"""The optimizer half of ``dmuon.checkpoint``: ``dmuon.Muon``'s state keyed by parameter FQN.

Format (torch's ``get_optimizer_state_dict`` format)::

    {"state": {fqn: {"momentum_buffer": ...} or {"step", "exp_avg", "exp_avg_sq"}},
     "param_groups": [{"params": [fqn, ...], "lr": ..., ...every other group key}]}

or, with ``flatten_optimizer_state_dict=True``, ``{"state.<fqn>.<name>": ..., "param_groups.<fqn>.
<key>": ...}``. A Muon momentum has the parameter's shape. Where a tensor lives follows the model
state dict's rules (``_model``): sharded, an owner's entries on the owner only and FSDP2's as
DTensors; full, every tensor whole. Each group's ``params`` lists the FQNs of the whole model
(not only this rank's), identical on every rank, so a checkpoint loads on any layout. FQNs are
canonical (``dmuon.fqn``): no wrapper segment, so a checkpoint written with activation
checkpointing or ``torch.compile`` wrappers on loads with them off, and the other way.

[Note: state starts fresh on a change of route]
A parameter's entries are loaded only when the checkpoint has every entry its route needs here
(NorMuon's ``row_second_moment`` excepted: without it, it starts at zero and the momentum loads).
A checkpoint written with another predicate (a matrix moved between the Muon and AdamW routes)
or without a parameter's state loads with one warning naming those parameters; their state
starts fresh, exactly as for a parameter that never had a gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon._text import preview_names
from dmuon.checkpoint._context import CheckpointContext, checkpoint_context
from dmuon.checkpoint._experts import load_piece_state, stack_optimizer_entries
from dmuon.fqn import canonical_fqn
from dmuon.muon_state import ROW_SECOND_MOMENT
from dmuon.optim import Muon
from dmuon.routing import RULE_KEYS
from dmuon.tp import TensorParallelLayout

_STATE = "state"
_GROUPS = "param_groups"
_PARAMS = "params"
_ROUTE = "route"  # every group dmuon.Muon writes has one; another optimizer's groups have none
# Entries a checkpoint may lack without the rest of the parameter's state starting fresh: NorMuon's
# row statistics (a plain Muon checkpoint resumed with normuon=True keeps its momentum).
_STARTS_AT_ZERO = frozenset({ROW_SECOND_MOMENT})


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Muon | Iterable[Muon],
    *,
    options: StateDictOptions | None = None,
) -> dict[str, object]:
    """``optimizers``' state keyed by FQN; see the module docstring. Collective."""
    ctx = checkpoint_context(model, options)
    optimizer = _the_optimizer(ctx, optimizers)
    optimizer.init_state()
    params = _ParamIndex(model, ctx, optimizer)
    state: dict[str, dict[str, object]] = {}
    for fqn in params.canonical_order:
        entries = params.entries(fqn)
        if entries is not None:
            state[fqn] = entries
    result = {_STATE: state, _GROUPS: params.groups()}
    if ctx.full and not ctx.keeps_full:
        return {}
    return _flattened(result) if ctx.options.flatten_optimizer_state_dict else result


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Muon | Iterable[Muon],
    optim_state_dict: dict[str, object],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load ``optim_state_dict`` (sharded or full, from any layout) into ``optimizers``.

    Hyperparameters of each group come from the saved group that holds its parameters; every
    state entry this rank's parameters need is copied in (see [Note: state starts fresh on a
    change of route]). Collective.
    """
    ctx = checkpoint_context(model, options)
    optimizer = _the_optimizer(ctx, optimizers)
    saved = _unflattened(optim_state_dict)
    optimizer.init_state()
    params = _ParamIndex(model, ctx, optimizer)
    errors = _check_groups(saved)
    ctx.raise_if_any_rank_failed(errors, "the optimizer state dict does not fit the optimizer")

    fresh = []
    saved_state = saved.get(_STATE, {})
    with torch.no_grad():
        for param, fqn in params.local_params():
            target = optimizer.state[param]
            entries = saved_state.get(fqn, {})
            if not set(target) - _STARTS_AT_ZERO <= set(entries):
                fresh.append(fqn)
                continue
            for name in set(target) - set(entries):
                target[name].zero_()
            present = {name: tensor for name, tensor in target.items() if name in entries}
            if fqn in params.stacks:  # an expert piece: its experts of each saved entry
                load_piece_state(params.pieces[id(param)], present, entries)
                continue
            layout = params.tp_layout(param)
            for name, tensor in present.items():
                tensor.copy_(_local_value(param, tensor, entries[name], layout))
    _load_hyperparameters(optimizer, params.global_groups, saved[_GROUPS])
    foreign = [i for i, group in enumerate(saved[_GROUPS]) if _ROUTE not in group]
    if foreign and ctx.rank == ctx.receiver:
        warnings.warn(
            f"dmuon.checkpoint: the saved param groups {foreign} have no 'route' key, so another "
            "optimizer wrote them (torch.optim.AdamW, say): no group takes hyperparameters from "
            "them, and every group keeps its current lr, weight decay and other settings. "
            "Per-parameter state was loaded where its entries have the names the route uses "
            "(AdamW: step, exp_avg, exp_avg_sq; Muon: momentum_buffer, which torch.optim.Muon "
            "keeps (1 - momentum) times smaller than dmuon).",
            UserWarning,
            stacklevel=2,
        )
    fresh_everywhere = sorted({fqn for found in ctx.all_gather(fresh) for fqn in found})
    if fresh_everywhere and ctx.rank == ctx.receiver:
        warnings.warn(
            f"dmuon.checkpoint: the optimizer state of {len(fresh_everywhere)} parameters is not "
            f"in the checkpoint under the entries their route needs ({preview_names(fresh_everywhere)})"
            "; their state starts fresh. This happens when the checkpoint was written with "
            "another predicate or routes (a matrix moved between Muon and AdamW), or with int8 "
            "momentum on one side and a float momentum_dtype on the other.",
            UserWarning,
            stacklevel=2,
        )


# ---- which parameter is which ---------------------------------------------------------------


class _ParamIndex:
    """The FQN of every tensor the optimizer updates, and each group's FQNs on all ranks."""

    def __init__(self, model: nn.Module, ctx: CheckpointContext, optimizer: Muon) -> None:
        self.ctx = ctx
        self.optimizer = optimizer
        self.dedicated = {p.fqn: p for p in ctx.state.params.values()}
        # Expert stacks: one FQN for the masters of their owned pieces (see ``_experts``).
        self.stacks = ctx.state.stacks
        self.pieces = {id(p.master): p for p in self.dedicated.values() if p.stack is not None}
        self.fqn_of: dict[int, str] = {}
        self.canonical_order: list[str] = []
        for name, param in model.named_parameters():
            name = canonical_fqn(name)
            self.canonical_order.append(name)
            if name in self.stacks:
                for piece in self.stacks[name].owned_pieces():
                    self.fqn_of[id(piece.master)] = name
                continue
            if name in self.dedicated:
                p = self.dedicated[name]
                if p.master is not None:
                    self.fqn_of[id(p.master)] = name
            else:
                self.fqn_of[id(param)] = name
        self.param_of = {self.fqn_of[id(p)]: p for p in self._optimized()}
        self.tp_layouts = {
            id(p.master): p.tp
            for p in self.dedicated.values()
            if p.master is not None and p.is_tp_sharded
        }
        local_groups = [[self.fqn_of[id(p)] for p in g[_PARAMS]] for g in optimizer.param_groups]
        # One collective: every rank learns each group's FQNs and every owner's entry shapes.
        everyone = ctx.all_gather((local_groups, self._owned_schema() if ctx.full else {}))
        position = {name: i for i, name in enumerate(self.canonical_order)}
        self.global_groups = [
            sorted({fqn for groups, _ in everyone for fqn in groups[i]}, key=position.__getitem__)
            for i in range(len(optimizer.param_groups))
        ]
        self.schema = {fqn: entries for _, schema in everyone for fqn, entries in schema.items()}

    def tp_layout(self, param: torch.Tensor) -> TensorParallelLayout | None:
        """The TP layout of a master that holds one chunk of a tensor-parallel matrix."""
        return self.tp_layouts.get(id(param))

    def public(self, param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        return _public(param, tensor, self.tp_layout(param))

    def _optimized(self) -> Iterable[torch.Tensor]:
        for group in self.optimizer.param_groups:
            yield from group[_PARAMS]

    def local_params(self) -> Iterable[tuple[torch.Tensor, str]]:
        for param in self._optimized():
            yield param, self.fqn_of[id(param)]

    def _owned_schema(self) -> dict[str, list[tuple[str, tuple[int, ...], torch.dtype, bool]]]:
        schema = {}
        for fqn, p in self.dedicated.items():
            if p.master is not None and p.master in self.optimizer.state:
                state = self.optimizer.state[p.master]
                schema[fqn] = [
                    (name, tuple(self.public(p.master, t).shape), t.dtype, t.device.type == "cpu")
                    for name, t in state.items()
                ]
        return schema

    def entries(self, fqn: str) -> dict[str, object] | None:
        """This rank's entries for ``fqn`` in the state dict being built (None: no entry)."""
        ctx = self.ctx
        if fqn in self.stacks:
            return stack_optimizer_entries(ctx, self.stacks[fqn], self.optimizer.state, self.schema)
        p = self.dedicated.get(fqn)
        if p is not None and ctx.full:
            return self._gathered_from_owner(fqn, p)
        param = self.param_of.get(fqn)
        if param is None or param not in self.optimizer.state:
            return None
        entries = {}
        for name, tensor in self.optimizer.state[param].items():
            value = self.public(param, tensor)
            if ctx.full:
                if isinstance(value, DTensor):
                    value = ctx.full_from_shards(value)  # collective: on every rank
                elif ctx.keeps_full:
                    value = ctx.full_value(value)  # AdamW's step and moments, never themselves
                if value is None or not ctx.keeps_full:
                    continue
            else:
                value = ctx.offloaded(value)
            entries[name] = value
        return entries or None

    def _gathered_from_owner(self, fqn: str, p) -> dict[str, object] | None:
        owned_state = self.optimizer.state.get(p.master, {}) if p.master is not None else {}
        entries = {}
        for name, shape, dtype, on_cpu in self.schema.get(fqn, []):
            owned = self.public(p.master, owned_state[name]) if name in owned_state else None
            if isinstance(owned, DTensor):  # a TP chunk: the owner's TP ranks gather it
                owned = owned.full_tensor()
            full = self.ctx.full_from_owner(self.ctx.owner_rank(p), owned, shape, dtype)
            if full is not None:
                entries[name] = full.cpu() if on_cpu else full
        return entries or None

    def groups(self) -> list[dict[str, object]]:
        return [
            {**{k: v for k, v in group.items() if k != _PARAMS}, _PARAMS: list(fqns)}
            for group, fqns in zip(self.optimizer.param_groups, self.global_groups)
        ]


def _public(
    param: torch.Tensor, tensor: torch.Tensor, layout: TensorParallelLayout | None = None
) -> torch.Tensor:
    """A state tensor as it appears in a state dict: the parameter's shape and layout.

    Muon keeps its momentum as the (m, n) matrix it orthogonalises; AdamW keeps a DTensor
    parameter's state as the plain local shard; the master of a tensor-parallel matrix's chunk
    keeps the chunk's state (``layout``: a DTensor of the TP chunks).
    """
    if layout is not None and tensor.ndim > 0:
        return layout.as_dtensor(tensor.view(layout.local_shape()))
    if isinstance(param, DTensor) and not isinstance(tensor, DTensor) and tensor.ndim > 0:
        return DTensor.from_local(
            tensor, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    if tensor.ndim > 0 and tensor.shape != param.shape and tensor.numel() == param.numel():
        return tensor.view(param.shape)
    return tensor


def _local_value(
    param: torch.Tensor,
    target: torch.Tensor,
    value: object,
    layout: TensorParallelLayout | None = None,
) -> torch.Tensor:
    """``value`` (full, or a DTensor of any layout) as the local tensor ``target`` holds."""
    if not isinstance(value, torch.Tensor):
        return torch.as_tensor(value, dtype=target.dtype)
    if layout is not None and target.ndim > 0:
        if isinstance(value, DTensor):
            if tuple(value.placements) != (layout.placement,):
                value = value.redistribute(layout.mesh, [layout.placement])
            value = value.to_local()
        else:
            value = layout.local_part(value.reshape(layout.shape).to(target.device))
    elif isinstance(param, DTensor) and target.ndim > 0:
        if isinstance(value, DTensor):
            if value.placements != param.placements:
                value = value.redistribute(param.device_mesh, param.placements)
            value = value.to_local()
        else:
            value = distribute_tensor(
                value.to(target.device), param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
    elif isinstance(value, DTensor):
        value = value.full_tensor()
    return value.reshape(target.shape)


# ---- groups -----------------------------------------------------------------------------------


def _check_groups(saved: dict[str, object]) -> list[str]:
    groups = saved.get(_GROUPS)
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get(_PARAMS), list) for g in groups
    ):
        return [
            "it has no 'param_groups' list of groups with 'params' FQN lists; pass the dict "
            "dmuon.checkpoint.get_optimizer_state_dict returned"
        ]
    return []


def _load_hyperparameters(
    optimizer: Muon, global_groups: list[list[str]], saved_groups: list[dict]
) -> None:
    """Each group takes the hyperparameters of the saved group of its update rule (``"route"``)
    that shares most of its FQNs; without a shared FQN, the saved group at its own index if that
    one has its rule. A group takes nothing from a group of the other rule (a checkpoint written
    with other routes may hold most of a group's parameters under the other rule), nor from a
    group without a rule (another optimizer's), and only the keys it has, never those that choose
    the update rule (``routing.RULE_KEYS``: ``normuon`` and ``momentum_dtype`` stay this
    optimizer's, so a checkpoint of another rule or momentum dtype loads into this one)."""
    for index, (group, fqns) in enumerate(zip(optimizer.param_groups, global_groups)):
        mine = set(fqns)
        same_rule = [
            i for i, saved in enumerate(saved_groups) if saved.get(_ROUTE) == group[_ROUTE]
        ]
        overlaps = {i: len(mine & set(saved_groups[i][_PARAMS])) for i in same_rule}
        best = max(same_rule, key=lambda i: (overlaps[i], -i), default=None)
        if best is None or overlaps[best] == 0:
            if index not in overlaps:
                continue
            best = index
        for key, value in saved_groups[best].items():
            # An option this dmuon no longer has stays out; the update rule stays this one's.
            if key != _PARAMS and key in group and key not in RULE_KEYS:
                group[key] = value


# ---- the flattened form -----------------------------------------------------------------------


def _flattened(state_dict: dict[str, object]) -> dict[str, object]:
    flat: dict[str, object] = {}
    for fqn, entries in state_dict[_STATE].items():
        for name, value in entries.items():
            flat[f"{_STATE}.{fqn}.{name}"] = value
    for group in state_dict[_GROUPS]:
        for fqn in group[_PARAMS]:
            for key, value in group.items():
                if key != _PARAMS:
                    flat[f"{_GROUPS}.{fqn}.{key}"] = value
    return flat


def _unflattened(state_dict: dict[str, object]) -> dict[str, object]:
    if _STATE in state_dict or _GROUPS in state_dict or not state_dict:
        return state_dict
    state: dict[str, dict[str, object]] = {}
    group_of: dict[tuple, dict[str, object]] = {}
    hyper: dict[str, dict[str, object]] = {}
    for key, value in state_dict.items():
        kind, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if kind == _STATE:
            state.setdefault(fqn, {})[name] = value
        elif kind == _GROUPS:
            hyper.setdefault(fqn, {})[name] = value
    for fqn, values in hyper.items():
        signature = tuple(sorted((k, repr(v)) for k, v in values.items()))
        group_of.setdefault(signature, {**values, _PARAMS: []})[_PARAMS].append(fqn)
    return {_STATE: state, _GROUPS: list(group_of.values())}


def _the_optimizer(ctx: CheckpointContext, optimizers) -> Muon:
    candidates = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if len(candidates) != 1 or not isinstance(candidates[0], Muon):
        kinds = [type(o).__name__ for o in candidates]
        raise TypeError(
            f"dmuon.checkpoint needs the one dmuon.Muon optimizer of the model, got {kinds}. "
            "Save other optimizers with torch.distributed.checkpoint.state_dict."
        )
    if candidates[0].model_state is not ctx.state:
        raise ValueError(
            "dmuon.checkpoint: this dmuon.Muon optimizer was built on another model; pass the "
            "model it was built on."
        )
    return candidates[0]
