"""``MuonRecipe``: what a torchtitan job's own Muon config (its ``DistMuon`` param group) says
about each Muon matrix, read as dmuon's settings.

torchtitan's Muon recipes (``kimi_k2_7``'s ``kimi_k2_5_debugmodel``, ``moonlight_16b_a3b``, ...)
name their Muon matrices with a ``DistMuon`` param group (a regex and torch.optim.Muon's
hyperparameters) and give each matrix a compute layout
(``optimizer_factory_kwargs_by_name["DistMuon"]["compute_sharding_by_fqn"]``). This module owns
reading them, and nothing else: ``parallelize`` and ``optimizer`` apply what it returns. See
[Note: compute layouts as dmuon's settings].

[Note: compute layouts as dmuon's settings]
A layout says how DistMuon cuts a matrix for Newton-Schulz on the data-parallel shard axis
(``dp_shard``); dmuon reaches the same per-matrix math its own way:

- ``Owned()``: one rank orthogonalises the whole matrix -> a dedicated matrix (one owner);
- ``BlockShard(dim=0, block_size=R)``: each block of ``R`` rows (an attention head) is a matrix
  of its own -> ``dedicate_params(row_blocks={fqn: R})``;
- ``Shard(0)`` of a 3-D (E, m, n) stack: each expert is a matrix -> a dmuon expert stack (its
  experts in slices, one owner each).

Any other layout is refused, naming the matrix and the layout. The expert layouts are kept whole
(``expert_layouts``, every mesh axis's placement); under expert parallelism the ``ep`` /
``efsdp`` meshes themselves are torchtitan's (``dmuon_titan.parallelize.expert_parallel_meshes``)
and the per-expert cut is the same, each slice of experts owned inside its EP slot. The
hyperparameters are torch.optim.Muon's names: ``lr``, ``weight_decay``, ``momentum``,
``nesterov`` and ``adjust_lr_fn`` (None or ``"original"`` is dmuon's ``"spectral"``). torchtitan
0.3.0's DistMuon has no QK-clip setting; the clip is dmuon-titan's option (``DMuonConfig``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.tensor import Shard
from torchtitan.components.optimizer import OptimizersContainer

# The param group torchtitan's Muon recipes name their matrices with, and its factory's key.
DIST_MUON = "DistMuon"
_LAYOUTS_KEY = "compute_sharding_by_fqn"
# The data-parallel axis whose layout decides a matrix's Newton-Schulz cut (MeshAxisName).
_SHARD_AXIS = "dp_shard"
# torch.optim.Muon's adjust_lr_fn -> dmuon.Muon's adjust_lr.
_ADJUST_LR = {None: "spectral", "original": "spectral", "match_rms_adamw": "match_rms_adamw"}
_HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "nesterov")


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonRecipe:
    """The Muon matrices of a torchtitan recipe and how each is orthogonalised."""

    pattern: str
    """The DistMuon group's regex, searched in each parameter's canonical FQN."""

    hyperparameters: Mapping[str, Any]
    """dmuon.Muon's Muon-route arguments the recipe sets (``lr``, ``adjust_lr``, ...)."""

    row_blocks: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """FQN -> rows per Newton-Schulz block (``BlockShard(dim=0, block_size)``)."""

    owned: frozenset[str] = frozenset()
    """FQNs orthogonalised whole (``Owned()``)."""

    expert_layouts: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """FQN -> the ``ComputeLayout`` of each per-expert stack (``Shard(0)``), every axis kept."""

    def is_muon(self, canonical_name: str, param: torch.Tensor) -> bool:
        return param.ndim >= 2 and re.search(self.pattern, canonical_name) is not None

    def rows_per_block(self, canonical_name: str) -> int | None:
        return self.row_blocks.get(canonical_name)

    def is_expert_stack(self, canonical_name: str, param: torch.Tensor) -> bool:
        return param.ndim == 3 and canonical_name in self.expert_layouts


def read_recipe(optimizer: OptimizersContainer.Config) -> MuonRecipe | None:
    """The recipe of a job whose optimizer config has a DistMuon param group; None without one."""
    groups = [group for group in optimizer.param_groups if group.optimizer_name == DIST_MUON]
    if not groups:
        return None
    if len(groups) > 1:
        raise ValueError(
            f"dmuon_titan reads one {DIST_MUON} param group of the job's optimizer config, got "
            f"{len(groups)} (patterns {[g.pattern for g in groups]}). Merge them into one."
        )
    (group,) = groups
    kwargs = dict(group.optimizer_kwargs)
    adjust_lr_fn = kwargs.get("adjust_lr_fn")
    if adjust_lr_fn not in _ADJUST_LR:
        raise ValueError(
            f"dmuon_titan: the job's {DIST_MUON} group asks for adjust_lr_fn={adjust_lr_fn!r}; "
            f"dmuon reads {sorted(k for k in _ADJUST_LR if k)} or None."
        )
    hyperparameters = {key: kwargs[key] for key in _HYPERPARAMETERS if key in kwargs}
    hyperparameters["adjust_lr"] = _ADJUST_LR[adjust_lr_fn]
    factory = optimizer.optimizer_factory_kwargs_by_name.get(DIST_MUON, {})
    row_blocks, owned, experts = {}, set(), {}
    for fqn, layout in factory.get(_LAYOUTS_KEY, {}).items():
        placement = layout.shardings_by_mesh_axis.get(_SHARD_AXIS)
        kind = type(placement).__name__
        if kind == "Owned":
            owned.add(fqn)
        elif kind == "BlockShard" and placement.dim == 0:
            row_blocks[fqn] = placement.block_size
        elif isinstance(placement, Shard) and placement.dim == 0:
            experts[fqn] = layout
        else:
            raise ValueError(
                f"dmuon_titan: the compute layout of {fqn} on {_SHARD_AXIS!r} is {placement!r}; "
                "dmuon reads Owned() (one owner), BlockShard(dim=0, block_size=R) (row blocks "
                "of R) and Shard(0) of an (E, m, n) stack (per expert). Leave the matrix out of "
                f"the {DIST_MUON} pattern, or give it one of those layouts."
            )
    return MuonRecipe(
        pattern=group.pattern,
        hyperparameters=MappingProxyType(hyperparameters),
        row_blocks=MappingProxyType(row_blocks),
        owned=frozenset(owned),
        expert_layouts=MappingProxyType(experts),
    )
