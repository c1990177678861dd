"""The parallelize hook: a model's parallelize function with dmuon's ``dedicate_params`` inside.

Owns where dmuon enters torchtitan's model set-up: after tensor parallelism, activation
checkpointing and ``torch.compile`` have wrapped the blocks, before the first ``fully_shard``
(``dmuon.dedicate_before_fully_shard``), on each pipeline stage's part, with the meshes and
mixed precision the job configured for FSDP2. It must not build optimizers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

import dmuon
from dmuon_titan.config import DMuonConfig


def dedicating(parallelize_fn: Callable[..., nn.Module], config: DMuonConfig):
    """``parallelize_fn`` (a ``ModelSpec.parallelize_fn``) that dedicates the model it
    parallelizes: the Muon matrices ``config`` selects get one owner rank each, and FSDP2 then
    shards only the rest."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *, parallel_dims: ParallelDims, **kwargs: Any) -> nn.Module:
        check_supported(parallel_dims)
        training, parallelism = kwargs["training"], kwargs["parallelism"]
        mesh, replicate_mesh = data_parallel_meshes(parallel_dims)
        with dmuon.dedicate_before_fully_shard(
            model,
            mesh,
            config.is_muon,
            replicate_mesh=replicate_mesh,
            reshard_after_forward=get_fsdp_reshard_after_forward_policy(
                parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled
            ),
            param_policy={
                "defaults": {
                    "param_dtype": TORCH_DTYPE_MAP[training.mixed_precision_param],
                    "reduce_dtype": TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                }
            },
        ):
            return parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)

    return parallelize


def data_parallel_meshes(parallel_dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The dims FSDP2 shards and replicates over: ``fsdp`` (dp_shard x cp, flattened) and, under
    HSDP, ``dp_replicate`` — the same dims torchtitan gives ``fully_shard``."""
    mesh = parallel_dims.get_mesh("fsdp")
    replicate = (
        parallel_dims.get_mesh("dp_replicate") if parallel_dims.dp_replicate_enabled else None
    )
    return mesh, replicate


def check_supported(parallel_dims: ParallelDims) -> None:
    if parallel_dims.ep_enabled:
        raise ValueError(
            f"dmuon_titan does not support expert parallelism yet (parallelism."
            f"expert_parallel_degree={parallel_dims.ep}): the expert stacks would be DTensors "
            "sharded over the ep mesh, and dmuon owns whole expert slices. Set "
            "--parallelism.expert_parallel_degree 1 (the experts then train with dmuon's expert "
            "stacks, each slice of experts on one owner), or train this job without dmuon."
        )
    if parallel_dims.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"dmuon_titan needs parallelism.spmd_backend='partial_dtensor', got "
            f"{parallel_dims.spmd_backend!r}: under the full-DTensor backends every parameter is "
            "a DTensor over the whole mesh before fully_shard, which dmuon does not dedicate "
            "yet. Set --parallelism.spmd_backend partial_dtensor."
        )
