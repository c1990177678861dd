"""dmuon's FSDP2 integration: ``fully_shard`` skips dedicated parameters, and dmuon learns the
gradient divide factor of each FSDP module.

FSDP2 (torch 2.11 to 2.13) collects the parameters it manages in a private function,
``_fsdp_init._get_managed_states(modules, ignored_params)``. On import, dmuon replaces it
(through ``_torch_internals``, the one place with torch's private APIs) by a wrap that adds the
parameters tagged as dedicated to ``ignored_params``: the user's own ``fully_shard`` calls need
no extra argument. If a torch release changes that internal, the wrap is not installed and
``dedicate_params`` fails with an explanation instead of letting FSDP2 shard dedicated
parameters silently.

[Note: following FSDP2's gradient divide factor]
``FSDPModule.set_gradient_divide_factor(factor)`` makes FSDP2 divide the gradients it sums over
its data-parallel ranks by ``factor`` instead of their number (torchtitan sets 1.0: its loss is a
local sum over the global token count, so gradients must be summed). Where FSDP2 keeps the factor
changed between releases (its state's one param group, then a list of param groups in 2.13); the
public method did not. On import dmuon wraps it (every FSDP2 module class inherits it from
``FSDPModule``) so that each call also records the factor on the module, where
``gradient_divide_factor`` reads it. FSDP2 modules exist only after ``dedicate_params``, so no
call is missed. If a release changes the method's signature,
the wrap is not installed and ``require_divide_factor_integration`` makes ``dmuon.Muon`` refuse a
fully sharded model with the reason, rather than reduce the dedicated gradients with a scale that
may not be FSDP2's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

from dmuon._torch_internals import replace_fsdp_managed_states
from dmuon.param import is_dedicated

_DIVIDE_FACTOR_PARAMETERS = ["self", "factor"]
_DIVIDE_FACTOR_ATTR = "_dmuon_gradient_divide_factor"

# None when the wrap is installed; otherwise why it could not be.
install_error: str | None = None
# The same for the wrap of FSDPModule.set_gradient_divide_factor.
divide_factor_error: str | None = None

# Called with the modules of each ``fully_shard`` call, before FSDP2 collects their parameters
# (``dmuon.deferred`` dedicates a model there: see its [Note: dedicating at the first fully_shard]).
fully_shard_listeners: list[Callable[[list[nn.Module]], None]] = []


def _skipping_dedicated(original: Callable) -> Callable:
    """FSDP2's ``_get_managed_states`` with the dedicated parameters joining ``ignored_params``
    (after telling the ``fully_shard_listeners``)."""

    @functools.wraps(original)
    def get_managed_states(modules: list[nn.Module], ignored_params=None):
        for listener in tuple(fully_shard_listeners):
            listener(modules)
        dedicated = {
            p for module in modules for p in module.parameters(recurse=False) if is_dedicated(p)
        }
        if dedicated:
            ignored_params = set(ignored_params or ()) | dedicated
        return original(modules, ignored_params)

    return get_managed_states


def _install_divide_factor_record() -> None:
    """Wrap ``FSDPModule.set_gradient_divide_factor``: see [Note: following FSDP2's gradient
    divide factor]."""
    global divide_factor_error
    from torch.distributed.fsdp import FSDPModule

    original = getattr(FSDPModule, "set_gradient_divide_factor", None)
    if original is None:
        return  # nothing can set a factor: FSDP2 averages, as dmuon does by default
    if getattr(original, "_dmuon_wrapped", False):
        return
    names = list(inspect.signature(original).parameters)
    if names != _DIVIDE_FACTOR_PARAMETERS:
        divide_factor_error = (
            f"FSDPModule.set_gradient_divide_factor takes {names}, expected "
            f"{_DIVIDE_FACTOR_PARAMETERS}"
        )
        return

    @functools.wraps(original)
    def set_gradient_divide_factor(self, factor):
        original(self, factor)
        object.__setattr__(self, _DIVIDE_FACTOR_ATTR, factor)

    set_gradient_divide_factor.__dict__["_dmuon_wrapped"] = True
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def gradient_divide_factor(module: nn.Module) -> float | None:
    """The factor last given to ``module.set_gradient_divide_factor`` (None: never set, FSDP2
    averages over its data-parallel ranks)."""
    return getattr(module, _DIVIDE_FACTOR_ATTR, None)


def require_divide_factor_integration() -> None:
    """Raise if dmuon cannot follow ``FSDPModule.set_gradient_divide_factor`` on this torch."""
    if divide_factor_error is not None:
        raise RuntimeError(
            f"dmuon cannot follow FSDP2's gradient divide factor on torch {torch.__version__}: "
            f"{divide_factor_error}. dmuon supports FSDPModule.set_gradient_divide_factor(factor) "
            "of torch 2.11 to 2.13 (it reduces the dedicated gradients with the factor FSDP2 "
            "uses for the others); until it supports this release, train this model on a "
            "supported torch."
        )


def require_fully_shard_integration() -> None:
    """Raise if ``fully_shard`` would not skip dedicated parameters on this torch."""
    if install_error is not None:
        raise RuntimeError(
            f"dmuon cannot make fully_shard skip dedicated parameters on torch "
            f"{torch.__version__}: {install_error}. dmuon supports the FSDP2 internals of torch "
            "2.11 to 2.13; until it supports this release, pass "
            "ignored_params=dmuon.dedicated_parameters(model) to each fully_shard call."
        )


def is_fully_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


install_error = replace_fsdp_managed_states(_skipping_dedicated)
_install_divide_factor_record()
