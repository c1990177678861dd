"""Hook boundaries: which module's hooks move which dedicated parameters.

Owns the second of the protocol's three decisions (see ``partition`` for the first): for each
dedicated parameter, the module whose forward/backward hooks unshard, free and reduce it — by
default the ``layers.N`` / ``blocks.N`` block around it (the partition's layer rule), else the
lowest ancestor for which ``hook_boundary_predicate`` is True. It must not decide owners or
issue collectives.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from dmuon._text import preview_names
from dmuon.group import BoundaryGroup
from dmuon.param import DedicatedParam
from dmuon.partition import layer_id_of


def group_by_boundary(
    model: nn.Module,
    params: dict[str, DedicatedParam],
    hook_boundary_predicate: Callable[[nn.Module], bool] | None,
    mesh,
    reshard_after_forward: bool,
) -> list[BoundaryGroup]:
    modules = dict(model.named_modules())
    # The module's own path (with any wrapper segments): ``p.fqn`` is canonical.
    module_names = {id(module): name for name, module in modules.items()}
    by_boundary: dict[str, list[DedicatedParam]] = {}
    fallback: list[str] = []
    for name, p in params.items():
        module_name = module_names[id(p.module)]
        boundary = _boundary_of(module_name, modules, hook_boundary_predicate)
        if boundary is None:
            boundary = module_name
            fallback.append(name)
        by_boundary.setdefault(boundary, []).append(p)
    if fallback:
        warnings.warn(
            f"dedicate_params: no hook boundary found for {len(fallback)} parameters "
            f"({preview_names(fallback)}); each uses its parent module as boundary. Pass "
            "hook_boundary_predicate=lambda module: ... to choose boundaries.",
            UserWarning,
            stacklevel=3,
        )
    # Boundaries in module registration order (the initial guess of the forward order).
    order = {name: i for i, name in enumerate(modules)}
    return [
        BoundaryGroup(boundary, modules[boundary], members, mesh, reshard_after_forward)
        for boundary, members in sorted(by_boundary.items(), key=lambda kv: order[kv[0]])
    ]


def _boundary_of(
    module_name: str,
    modules: dict[str, nn.Module],
    hook_boundary_predicate: Callable[[nn.Module], bool] | None,
) -> str | None:
    if hook_boundary_predicate is not None:
        candidate = module_name
        while True:
            if hook_boundary_predicate(modules[candidate]):
                return candidate
            if not candidate:
                return None
            candidate = candidate.rpartition(".")[0]
    # The same rule as the partition's layer id (``layers.N``, ``blocks.N``, ...).
    return layer_id_of(module_name + ".weight")
