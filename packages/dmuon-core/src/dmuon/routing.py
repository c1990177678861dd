"""Routes: which parameters dmuon dedicates, and which optimizer group each parameter of
``dmuon.Muon`` is in, with which hyperparameters, and why.

Owns two decisions. At ``dedicate_params``, the selection (``select_dedicated``): the
predicate and the ``routes=`` overrides, tied parameters left out. At ``dmuon.Muon``, the
grouping, as a function of facts every rank holds (FQNs, full shapes, routes, owners, the module
tree): the route defaults, the ``no_decay`` rule (HF Trainer's by default), the user's
``param_groups`` (first match wins), the torch param groups they become, and the routing table.
Must not: read parameter values (only the user's predicates see parameters), issue collectives
or build optimizer state. ``optim`` turns the planned groups into torch param groups holding
this rank's tensors.

[Note: deciding identically on every rank]
A dedicated parameter's value lives on its owner only; every other rank holds a 0-element
placeholder. So nothing here reads values: a ``param_groups`` or ``no_decay`` predicate receives,
for a dedicated parameter, a meta tensor of its full shape, dtype and ``requires_grad`` (its
"stand-in"), and FSDP2's parameters as they are (DTensors with the full shape). Every rank then
plans the same groups, in the same order, with the same hyperparameters; only the tensors a group
holds on a rank differ (the masters it owns, FSDP2's local shards). ``Muon`` checks that
agreement once at construction, with its other facts. Every FQN here is canonical (wrapper
segments such as ``_checkpoint_wrapped_module`` and ``_orig_mod`` left out, see ``dmuon.fqn``):
predicates receive canonical names, and ``param_groups`` FQN lists may spell a name either way.

[Note: torch groups]
Each torch group has one update rule (its ``"route"`` key: ``"muon"`` or ``"adamw"``; the
``"adamw"`` rule serves both owner-side AdamW and FSDP2's shards) and one set of hyperparameters.
Groups 0 and 1 always exist: the Muon and AdamW defaults. After them come the defaults with the
``no_decay`` rule applied (weight decay 0), then each user group in order, split by update rule
and by the rule; a group no parameter falls in (on any rank) is left out. A key a user group
sets wins over the ``no_decay`` rule: ``{"params": ..., "weight_decay": 0.1}`` decays its biases.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from dmuon._text import preview_names
from dmuon.fqn import canonical_fqn
from dmuon.muon_update import MOMENTUM_DTYPES

MUON_ROUTE = "muon"
ADAMW_ROUTE = "adamw"
SHARDED_ADAMW_ROUTE = "sharded_adamw"
ROUTES = (MUON_ROUTE, ADAMW_ROUTE, SHARDED_ADAMW_ROUTE)
"""Per parameter: Muon on the owner's fp32 master, AdamW on the owner's fp32 master, or left to
FSDP2 (not dedicated) and AdamW on its shards."""

ROUTE_MEANINGS: Mapping[str, str] = {
    MUON_ROUTE: "Muon on the owner's fp32 master",
    ADAMW_ROUTE: "AdamW on the owner's fp32 master",
    SHARDED_ADAMW_ROUTE: "AdamW on FSDP2's shards, not dedicated",
}
"""What each route means, in the words the route summaries log beside its name."""

ADJUST_LR = ("match_rms_adamw", "spectral", None)

# Why a parameter is where it is (the last column of the routing table).
WHY_PREDICATE = "predicate"
WHY_ROUTES_OVERRIDE = "routes override"
WHY_NOT_DEDICATED = "not dedicated"
WHY_NO_DECAY = "no_decay rule"

# The keys a group of each update rule holds, besides "params" and "route".
UPDATE_KEYS: Mapping[str, tuple[str, ...]] = {
    MUON_ROUTE: ("lr", "momentum", "nesterov", "weight_decay", "adjust_lr", "normuon",
                 "normuon_beta2", "normuon_eps", "momentum_dtype"),
    ADAMW_ROUTE: ("lr", "betas", "eps", "weight_decay"),
}  # fmt: skip
GROUP_KEYS = ("params", "lr", "weight_decay", "momentum", "nesterov", "adjust_lr", "normuon",
              "normuon_beta2", "normuon_eps", "momentum_dtype", "betas", "eps")  # fmt: skip
"""The keys a ``param_groups`` entry may set."""
RULE_KEYS = ("normuon", "momentum_dtype")
"""Keys that choose the update rule and the state's layout: a checkpoint's values never
replace the optimizer's (``dmuon.checkpoint`` and ``Muon.load_state_dict``)."""

HF_NO_DECAY = "hf"
# transformers 5.x ``Trainer.get_decay_parameter_names``: parameters inside ``nn.LayerNorm``
# modules, and those whose lower-cased name matches one of these, get no weight decay.
HF_NO_DECAY_NAME_PATTERNS = (
    r"bias",
    r"layernorm",
    r"rmsnorm",
    r"(?:^|\.)norm(?:$|\.)",
    r"_norm(?:$|\.)",
)
HF_NO_DECAY_LAYER_TYPES = (nn.LayerNorm,)

NoDecay = str | Callable[[str, torch.Tensor], bool] | None | bool
Predicate = Callable[[str, nn.Parameter], bool]
"""``dedicate_params``'s predicate: ``(canonical name, param) -> bool``."""
Routes = Mapping[str, str] | Callable[[str, nn.Parameter], str | None]
"""``dedicate_params(routes=...)``: ``{fqn: route}`` or ``(name, param) -> route | None``."""


class ExpertSliceOwner(NamedTuple):
    """The owner of experts ``[start, stop)`` of an expert stack (its ``owner_rank`` is a tuple
    of these, in expert order)."""

    start: int
    stop: int
    rank: int  # global rank

    def __str__(self) -> str:
        return f"[{self.start}:{self.stop}]@{self.rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamFacts:
    """What every rank knows about one trainable parameter."""

    fqn: str
    shape: tuple[int, ...]
    route: str  # one of ROUTES
    why_route: str  # WHY_PREDICATE, WHY_ROUTES_OVERRIDE or WHY_NOT_DEDICATED
    # global rank of the owner; an expert stack's slices' owners; None when not dedicated
    owner_rank: int | tuple[ExpertSliceOwner, ...] | None
    stand_in: torch.Tensor  # what predicates receive; see [Note: deciding identically ...]

    @property
    def update(self) -> str:
        """The update rule: Muon, or AdamW (owner-side or on FSDP2's shards)."""
        return MUON_ROUTE if self.route == MUON_ROUTE else ADAMW_ROUTE


class RoutingRow(NamedTuple):
    """One row of ``Muon.routing()``."""

    fqn: str
    shape: tuple[int, ...]
    route: str
    owner_rank: int | tuple[ExpertSliceOwner, ...] | None  # see ParamFacts.owner_rank
    lr: float
    weight_decay: float
    why: str
    # The group's update rule: "muon" or "normuon" (", momentum bfloat16" / ", momentum int8"
    # when stored so), or "adamw" on both AdamW routes; see update_rule.
    update_rule: str


def update_rule(group: Mapping[str, Any]) -> str:
    """The update rule a torch group of ``dmuon.Muon`` applies, as the routing table shows it:
    ``"adamw"``, or ``"muon"`` / ``"normuon"`` with the momentum's storage dtype when it is not
    float32 (``"normuon, momentum bfloat16"``)."""
    if group["route"] != MUON_ROUTE:
        return ADAMW_ROUTE
    rule = "normuon" if group.get("normuon") else MUON_ROUTE
    momentum_dtype = group.get("momentum_dtype", "float32")
    if isinstance(momentum_dtype, torch.dtype):
        momentum_dtype = str(momentum_dtype).removeprefix("torch.")
    return rule if momentum_dtype == "float32" else f"{rule}, momentum {momentum_dtype}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedGroup:
    update: str  # the torch group's "route" key
    source: str  # "defaults", "no_decay rule", "param_groups[i]", "param_groups[i], no_decay rule"
    hyperparameters: dict[str, Any]
    fqns: tuple[str, ...]

    def torch_group(self, params: list[torch.Tensor]) -> dict[str, Any]:
        return {"params": params, "route": self.update, "source": self.source,
                **self.hyperparameters}  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingPlan:
    groups: list[PlannedGroup]
    group_of: dict[str, int]  # FQN -> index into ``groups``
    why: dict[str, str]  # FQN -> the routing table's "why"


def plan_groups(
    facts: Sequence[ParamFacts],
    defaults: Mapping[str, Mapping[str, Any]],
    param_groups: Sequence[Mapping[str, Any]] | None,
    no_decay: Collection[str],
) -> RoutingPlan:
    """The torch groups of ``facts`` (see [Note: torch groups]).

    ``defaults`` maps each update rule (``"muon"``, ``"adamw"``) to its hyperparameters;
    ``no_decay`` holds the FQNs the no-decay rule selects. Raises ValueError or TypeError for a
    malformed ``param_groups`` entry, naming it and the fix.
    """
    if param_groups is not None and not isinstance(param_groups, (list, tuple)):
        raise TypeError(
            f"dmuon.Muon: param_groups must be a list of dicts, got {type(param_groups).__name__}"
            ': param_groups=[{"params": ["lm_head.weight"], "lr": 1e-4}, ...].'
        )
    known = {f.fqn for f in facts}
    for index, spec in enumerate(param_groups or ()):
        _check_group_spec(index, spec, known)
    user_groups = [_with_canonical_names(spec) for spec in param_groups or ()]

    members: dict[str, int | None] = {f.fqn: _first_match(f, user_groups) for f in facts}
    for index, spec in enumerate(user_groups):
        _check_keys_apply(index, spec, [f for f in facts if members[f.fqn] == index])
        if index not in members.values():
            _warn_empty_group(index, spec, facts, user_groups)

    # (source index: -1 for the defaults, update rule, no_decay applied) -> FQNs
    buckets: dict[tuple[int, str, bool], list[str]] = {}
    why: dict[str, str] = {}
    for f in facts:
        index = members[f.fqn]
        spec = user_groups[index] if index is not None else {}
        applies_no_decay = f.fqn in no_decay and "weight_decay" not in spec
        reasons = [f.why_route]
        if applies_no_decay:
            reasons.append(WHY_NO_DECAY)
        if index is not None:
            reasons.append(f"param_groups[{index}]")
        why[f.fqn] = ", ".join(reasons)
        source = -1 if index is None else index
        buckets.setdefault((source, f.update, applies_no_decay), []).append(f.fqn)

    order = [(-1, MUON_ROUTE, False), (-1, ADAMW_ROUTE, False)]
    order += [(-1, MUON_ROUTE, True), (-1, ADAMW_ROUTE, True)]
    order += [
        (index, update, nd)
        for index in range(len(user_groups))
        for update in (MUON_ROUTE, ADAMW_ROUTE)
        for nd in (False, True)
    ]
    groups: list[PlannedGroup] = []
    group_of: dict[str, int] = {}
    for position, (index, update, nd) in enumerate(order):
        fqns = buckets.get((index, update, nd), [])
        if not fqns and position >= 2:
            continue
        hyperparameters = dict(defaults[update])
        if nd:
            hyperparameters["weight_decay"] = 0.0
        source = "defaults" if index < 0 else f"param_groups[{index}]"
        if index >= 0:
            hyperparameters.update({k: v for k, v in user_groups[index].items() if k != "params"})
            if "betas" in hyperparameters:
                hyperparameters["betas"] = tuple(hyperparameters["betas"])
            if "momentum_dtype" in hyperparameters:
                hyperparameters["momentum_dtype"] = momentum_dtype_name(
                    hyperparameters["momentum_dtype"]
                )
        if nd:
            source = WHY_NO_DECAY if index < 0 else f"{source}, {WHY_NO_DECAY}"
        for fqn in fqns:
            group_of[fqn] = len(groups)
        groups.append(
            PlannedGroup(update=update, source=source, hyperparameters=hyperparameters,
                         fqns=tuple(fqns))
        )  # fmt: skip
    return RoutingPlan(groups=groups, group_of=group_of, why=why)


def routing_rows(
    facts: Sequence[ParamFacts], plan: RoutingPlan, torch_groups: Sequence[Mapping[str, Any]]
) -> list[RoutingRow]:
    """The routing table, with each group's current lr and weight decay (a scheduler's too)."""
    rows = []
    for f in facts:
        group = torch_groups[plan.group_of[f.fqn]]
        rows.append(
            RoutingRow(f.fqn, f.shape, f.route, f.owner_rank, group["lr"], group["weight_decay"],
                       plan.why[f.fqn], update_rule(group))
        )  # fmt: skip
    return rows


def route_summaries(rows: Sequence[RoutingRow]) -> list[str]:
    """One line per route present: what it means, its update rules, count, elements, learning
    rates and weight decays."""
    lines = []
    for route in ROUTES:
        mine = [row for row in rows if row.route == route]
        if not mine:
            continue
        numel = sum(math.prod(row.shape) for row in mine)
        lrs = "/".join(f"{v:g}" for v in sorted({row.lr for row in mine}))
        wds = "/".join(f"{v:g}" for v in sorted({row.weight_decay for row in mine}))
        rules = "; ".join(sorted({row.update_rule for row in mine}))
        lines.append(
            f"route {route} ({ROUTE_MEANINGS[route]}; update rule {rules}): {len(mine)} "
            f"parameters, {numel:,} elements, lr {lrs}, weight_decay {wds}"
        )
    return lines


# ---- the no_decay rule ------------------------------------------------------------------------


def no_decay_fqns(model: nn.Module, no_decay: NoDecay, facts: Sequence[ParamFacts]) -> set[str]:
    """The FQNs of ``facts`` that get no weight decay.

    ``"hf"``: HF Trainer's rule (``Trainer.get_decay_parameter_names`` of transformers 5.x):
    parameters of ``nn.LayerNorm`` modules (at any depth) and parameters whose lower-cased FQN
    contains ``bias``, ``layernorm`` or ``rmsnorm``, or has a ``norm`` or ``*_norm`` component.
    Decided from names and module types only, so identically on every rank. A callable
    ``(name, param) -> bool`` selects them itself; None or False selects none.
    """
    if no_decay is None or no_decay is False:
        return set()
    if callable(no_decay):
        return {f.fqn for f in facts if no_decay(f.fqn, f.stand_in)}
    if no_decay != HF_NO_DECAY:
        raise ValueError(
            f"dmuon.Muon: no_decay={no_decay!r} is not a rule: pass 'hf' (the default: biases "
            "and norm weights get no weight decay, as in HF Trainer), a function (name, param) "
            "-> bool, or None to decay every parameter by its group's weight_decay."
        )
    patterns = [re.compile(pattern) for pattern in HF_NO_DECAY_NAME_PATTERNS]
    norm_prefixes = [
        f"{canonical_fqn(name)}." if name else ""
        for name, module in model.named_modules()
        if isinstance(module, HF_NO_DECAY_LAYER_TYPES)
    ]
    return {
        f.fqn
        for f in facts
        if any(f.fqn.startswith(prefix) for prefix in norm_prefixes)
        or any(pattern.search(f.fqn.lower()) for pattern in patterns)
    }


# ---- user groups ------------------------------------------------------------------------------


def _with_canonical_names(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """A group whose FQN list may spell names with wrapper segments, listing canonical ones."""
    params = spec["params"]
    if callable(params):
        return spec
    return {**spec, "params": [canonical_fqn(name) for name in params]}


def _first_match(f: ParamFacts, user_groups: Sequence[Mapping[str, Any]]) -> int | None:
    for index, spec in enumerate(user_groups):
        params = spec["params"]
        if f.fqn in params if not callable(params) else params(f.fqn, f.stand_in):
            return index
    return None


def _warn_empty_group(
    index: int,
    spec: Mapping[str, Any],
    facts: Sequence[ParamFacts],
    user_groups: Sequence[Mapping[str, Any]],
) -> None:
    """An entry that ends up with no parameter is most likely a typo in its predicate, or an
    entry shadowed by an earlier one (first match wins): say which."""
    selected = [f.fqn for f in facts if _first_match(f, user_groups[index : index + 1]) == 0]
    if selected:
        earlier = sorted({_first_match(f, user_groups) for f in facts if f.fqn in selected})
        why = (
            f"every parameter it selects ({preview_names(selected)}) is taken by the earlier "
            f"param_groups{earlier} (the first matching entry wins); move it before them"
        )
    elif callable(spec["params"]):
        why = (
            f"its predicate matches none of the {len(facts)} trainable parameters (names as in "
            "model.named_parameters())"
        )
    else:
        why = "its 'params' list is empty"
    warnings.warn(
        f"dmuon.Muon: param_groups[{index}] ({_describe_params(spec['params'])}) applies to no "
        f"parameter: {why}.",
        UserWarning,
        stacklevel=4,
    )


def _describe_params(params: Any) -> str:
    if callable(params):
        return f"predicate {getattr(params, '__qualname__', repr(params))}"
    return f"params [{preview_names(list(params))}]"


def _check_group_spec(index: int, spec: Any, known: set[str]) -> None:
    where = f"dmuon.Muon: param_groups[{index}]"
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"{where} must be a dict, got {type(spec).__name__}: "
            '{"params": ["lm_head.weight"] or lambda name, p: ..., "lr": ..., ...}.'
        )
    unknown = sorted(set(spec) - set(GROUP_KEYS), key=str)
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {unknown}; a group accepts {list(GROUP_KEYS)} (the "
            "Muon route takes lr, weight_decay, momentum, nesterov, adjust_lr, normuon, "
            "normuon_beta2, normuon_eps, momentum_dtype; the AdamW routes take lr, "
            "weight_decay, betas, eps)."
        )
    if "params" not in spec:
        raise ValueError(
            f"{where} has no 'params': give the FQNs it holds (a list of names from "
            "model.named_parameters()) or a predicate (name, param) -> bool."
        )
    params = spec["params"]
    if not callable(params):
        if isinstance(params, str) or not isinstance(params, (list, tuple, set, frozenset)):
            hint = f" For one parameter write [{params!r}]." if isinstance(params, str) else ""
            raise TypeError(
                f"{where}['params'] must be a list of FQNs or a predicate (name, param) -> bool, "
                f"got {type(params).__name__}: {params!r}.{hint}"
            )
        missing = [name for name in params if canonical_fqn(name) not in known]
        if missing:
            raise ValueError(
                f"{where}['params'] names {len(missing)} parameters the optimizer does not "
                f"update: {missing[:5]}{' ...' if len(missing) > 5 else ''}. Use the names of "
                "model.named_parameters() (trainable ones; with the task head's prefix, e.g. "
                "'model.layers.0...'), or a predicate (name, param) -> bool."
            )
    for key, value in spec.items():
        if key != "params":
            _check_value(f"{where}[{key!r}]", key, value)


def momentum_dtype_name(value: Any) -> str:
    """The name of a Muon momentum dtype (``torch.bfloat16`` or ``"bfloat16"``: ``"bfloat16"``)."""
    name = str(value).removeprefix("torch.") if isinstance(value, (str, torch.dtype)) else None
    if name not in MOMENTUM_DTYPES:
        raise ValueError(
            f"dmuon.Muon: momentum_dtype={value!r} is not one of torch.float32 (the default), "
            "torch.bfloat16 (half the memory) or torch.int8 (int8 with block scales, about a "
            "quarter); the arithmetic stays fp32."
        )
    return name


def _check_value(where: str, key: str, value: Any) -> None:
    if key in ("lr", "weight_decay", "eps", "momentum", "normuon_beta2", "normuon_eps"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a finite number, got {value!r}.")
        in_unit = key in ("momentum", "normuon_beta2")
        if not math.isfinite(value) or value < 0 or (in_unit and value >= 1):
            limit = "in [0, 1)" if in_unit else "a finite non-negative number"
            raise ValueError(f"{where} must be {limit}, got {value!r}.")
    elif key == "momentum_dtype":
        momentum_dtype_name(value)
    elif key in ("nesterov", "normuon"):
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be True or False, got {value!r}.")
    elif key == "adjust_lr":
        if value not in ADJUST_LR:
            raise ValueError(f"{where}={value!r} is not one of {ADJUST_LR}.")
    elif key == "betas" and (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(
            isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 <= beta < 1
            for beta in value
        )
    ):
        raise ValueError(f"{where} must be a pair of numbers in [0, 1), e.g. (0.9, 0.95), got {value!r}.")  # fmt: skip


def _check_keys_apply(index: int, spec: Mapping[str, Any], members: Sequence[ParamFacts]) -> None:
    for f in members:
        misplaced = [k for k in spec if k != "params" and k not in UPDATE_KEYS[f.update]]
        if misplaced:
            others = [m.fqn for m in members if m.update == f.update]
            more = f" and {len(others) - 1} more" if len(others) > 1 else ""
            raise ValueError(
                f"dmuon.Muon: param_groups[{index}] sets {misplaced}, which do not apply to the "
                f"{f.route} route of {f.fqn!r}{more} (shape {f.shape}). The Muon route takes "
                f"{list(UPDATE_KEYS[MUON_ROUTE])}, the AdamW routes {list(UPDATE_KEYS[ADAMW_ROUTE])}"
                ". Narrow the group's params to one route (e.g. lambda name, p: ... and "
                "p.ndim >= 2), or split it into one group per route."
            )


# ---- which parameters are dedicated, and on which route (``dedicate_params``) ------------------


def select_dedicated(
    model: nn.Module, predicate: Predicate, routes: Routes | None
) -> tuple[list[tuple[str, nn.Module, str, nn.Parameter]], dict[str, str]]:
    """(name, module, attr, param) for each parameter ``dedicate_params`` dedicates, in
    registration order, and the route overrides (canonical FQN -> route) ``routes`` gave.

    A parameter is dedicated when ``routes`` sends it to ``"muon"`` or ``"adamw"``, or gives
    it no route and ``predicate`` selects it; a tied parameter is left to FSDP2, with a warning.
    """
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(canonical_fqn(name))
    routes = _canonical_routes(routes)
    _check_routes_mapping(routes, names_of)
    selected = []
    overrides: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            name = canonical_fqn(f"{module_name}.{attr}" if module_name else attr)
            if names_of[id(param)][0] != name:
                continue
            route = _route_override(name, param, routes)
            if route is not None:
                overrides[name] = route
            if route == SHARDED_ADAMW_ROUTE or (route is None and not predicate(name, param)):
                continue
            if len(names_of[id(param)]) > 1:
                warnings.warn(
                    f"dedicate_params: {name} is tied to {names_of[id(param)][1:]}; tied "
                    "parameters are left to FSDP2 (AdamW route).",
                    UserWarning,
                    stacklevel=3,
                )
                overrides.pop(name, None)
                continue
            selected.append((name, module, attr, param))
    return selected, overrides


def _canonical_routes(routes: Routes | None) -> Routes | None:
    """``routes`` keyed by canonical FQNs (a name spelled with wrapper segments is accepted)."""
    if routes is None or callable(routes) or not isinstance(routes, Mapping):
        return routes
    return {canonical_fqn(name): route for name, route in routes.items()}


def _check_routes_mapping(routes: Routes | None, names_of: dict[int, list[str]]) -> None:
    if routes is None or callable(routes):
        return
    if not isinstance(routes, Mapping):
        raise TypeError(
            f"dedicate_params: routes must be a dict {{fqn: route}} or a function (name, param) "
            f"-> route | None, got {type(routes).__name__}: {routes!r}."
        )
    known = {name for names in names_of.values() for name in names}
    unknown = [name for name in routes if name not in known]
    if unknown:
        raise ValueError(
            f"dedicate_params: routes names {len(unknown)} parameters the model does not have: "
            f"{preview_names(unknown)}. Use the names of model.named_parameters(), e.g. "
            "routes={'lm_head.weight': 'adamw'}."
        )


def _route_override(name: str, param: nn.Parameter, routes: Routes | None) -> str | None:
    if routes is None:
        return None
    route = routes(name, param) if callable(routes) else routes.get(name)
    if route is not None and route not in ROUTES:
        raise ValueError(
            f"dedicate_params: routes gives {name} the route {route!r}; the routes are "
            f"{list(ROUTES)} (or None from a function: the predicate decides)."
        )
    if route == MUON_ROUTE and param.ndim < 2:
        raise ValueError(
            f"dedicate_params: routes puts {name} of shape {tuple(param.shape)} on the Muon "
            "route, but Muon orthogonalises matrices (2 or more dims). Route it to 'adamw' "
            "(owner-side AdamW) or 'sharded_adamw' (left to FSDP2), or leave it out of routes."
        )
    return route
