"""The one place that touches FSDP2 internals: ``fully_shard`` skips dedicated parameters.

FSDP2 (torch 2.11 to 2.13) collects the parameters it manages in
``torch.distributed.fsdp._fully_shard._fsdp_init._get_managed_states(modules, ignored_params)``.
On import, dmuon wraps that function so that parameters tagged as dedicated join
``ignored_params``: the user's own ``fully_shard`` calls need no extra argument. If a torch
release changes that internal, the wrap is not installed and ``dedicate_params`` fails with an
explanation instead of letting FSDP2 shard dedicated parameters silently.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

from dmuon.param import is_dedicated

_EXPECTED_PARAMETERS = ["modules", "ignored_params"]

# None when the wrap is installed; otherwise why it could not be.
install_error: str | None = None

# Called with the modules of each ``fully_shard`` call, before FSDP2 collects their parameters
# (``dmuon.deferred`` dedicates a model there: see its [Note: dedicating at the first fully_shard]).
fully_shard_listeners: list[Callable[[list[nn.Module]], None]] = []


def _install() -> None:
    global install_error
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init
    except ImportError as error:
        install_error = f"cannot import FSDP2's _fsdp_init ({error})"
        return
    original = getattr(_fsdp_init, "_get_managed_states", None)
    if original is None:
        install_error = "torch.distributed.fsdp._fully_shard._fsdp_init has no _get_managed_states"
        return
    if getattr(original, "_dmuon_wrapped", False):
        return
    names = list(inspect.signature(original).parameters)
    if names != _EXPECTED_PARAMETERS:
        install_error = f"_get_managed_states takes {names}, expected {_EXPECTED_PARAMETERS}"
        return

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

    get_managed_states._dmuon_wrapped = True  # type: ignore[attr-defined]
    _fsdp_init._get_managed_states = get_managed_states


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


_install()
