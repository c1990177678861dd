"""Reading dmuon's per-model state for the summaries: dtype names, owner coordinates, ranks.

Owns the small conversions every summary shares (a dtype to its JSON name, an owner coordinate to
a dict, this process's rank). It must not issue collectives nor change the state it reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmuon.api import get_dedicated_state
from dmuon.hooks import DedicatedState
from dmuon.partition import OwnerCoord


def dedicated_state_or_none(model: nn.Module) -> DedicatedState | None:
    """The model's dmuon state, or None when ``dedicate_params`` was never called on it."""
    try:
        return get_dedicated_state(model)
    except ValueError:
        return None


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.bfloat16 -> "bfloat16"`` (None stays None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def widest(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype a mixed gradient message is reduced in: the one with the most bits."""
    return max(dtypes, key=lambda d: torch.finfo(d).bits if d.is_floating_point else 0)


def owner_dict(coord: OwnerCoord) -> dict[str, int]:
    return {"shard": coord.shard, "replicate": coord.replicate}


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def jsonable(value: Any) -> Any:
    """Plain JSON values for optimizer hyperparameters (tuples, 0-d tensors, dtypes, ...)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return repr(value)
