"""The small conversions every summary shares: dtype names, owner coordinates, this rank.

Owns turning what ``dmuon.inspect`` reports into plain JSON values (a dtype to its name, an owner
coordinate to a dict, an optimizer hyperparameter to JSON) and this process's rank. It must not
issue collectives nor read dmuon's state other than through ``dmuon.inspect``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dmuon.inspect import OwnerCoord


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.bfloat16 -> "bfloat16"`` (None stays None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


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
