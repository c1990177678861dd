"""The parallelize hook: a model's parallelize function with dmuon's ``dedicate_params`` inside.

Owns where dmuon enters torchtitan's model set-up: after tensor parallelism and activation
checkpointing have wrapped the blocks, before the first ``fully_shard``
(``dmuon.dedicate_before_fully_shard``), on each pipeline stage's part, with the meshes and
mixed precision the job configured for FSDP2 (and, under expert parallelism, torchtitan's sparse
``ep`` / ``efsdp`` dims: by then the model's own ``parallelize`` has split each expert stack
``Shard(0)`` over ``ep``); and where ``torch.compile`` goes when the job compiles its blocks (see
[Note: compiled blocks]). It must not build optimizers.

[Note: compiled blocks]
torchtitan compiles each block in place with ``block.compile(fullgraph=True)``, which compiles
the block's whole ``__call__``: its module hooks too. dmuon's hooks issue collectives and wait on
their work handles, which dynamo cannot put in a graph, so a full graph of such a block fails to
compile. dmuon-titan therefore runs the model's parallelize function with compile off and then
compiles, with the job's backend and ``fullgraph=True``, the ``forward`` of each block's
innermost module (below the activation-checkpoint wrapper): every computation of the block is
compiled as before, while the hooks (dmuon's and FSDP2's) and the checkpoint wrapper run eagerly
around it. Names are unchanged (no ``_orig_mod`` segment).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

import dmuon
from dmuon_titan.config import DMuonConfig
from dmuon_titan.recipe import MuonRecipe


def dedicating(
    parallelize_fn: Callable[..., nn.Module],
    config: DMuonConfig,
    recipe: MuonRecipe | None = None,
):
    """``parallelize_fn`` (a ``ModelSpec.parallelize_fn``) that dedicates the model it
    parallelizes: the Muon matrices ``config`` selects (or, for a job with a DistMuon recipe,
    ``recipe``: its matrices, row blocks and expert stacks) get one owner rank each, and FSDP2
    then shards only the rest."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *, parallel_dims: ParallelDims, **kwargs: Any) -> nn.Module:
        check_supported(parallel_dims)
        training, parallelism = kwargs["training"], kwargs["parallelism"]
        compile_config = kwargs["compile_config"]
        compiling = compile_config.enable and "model" in compile_config.components
        if compiling:  # see [Note: compiled blocks]
            kwargs["compile_config"] = dataclasses.replace(
                compile_config, components=[c for c in compile_config.components if c != "model"]
            )
        mesh, replicate_mesh = data_parallel_meshes(parallel_dims)
        with dmuon.dedicate_before_fully_shard(
            model,
            mesh,
            config.is_muon if recipe is None else recipe.is_muon,
            **recipe_layouts(recipe),
            **expert_parallel_meshes(parallel_dims),
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
            model = parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
        if compiling:
            compile_block_forwards(model, compile_config.backend)
        return model

    return parallelize


def recipe_layouts(recipe: MuonRecipe | None) -> dict[str, Any]:
    """``dedicate_params``' arguments for the recipe's per-matrix cuts ([Note: compute layouts as
    dmuon's settings] in ``dmuon_titan.recipe``): row blocks, and which 3-D matrices are expert
    stacks. Names are canonical, as ``dedicate_params`` gives them."""
    if recipe is None:
        return {}
    return {
        "row_blocks": lambda name, param: recipe.rows_per_block(name),
        "expert_stacks": recipe.is_expert_stack,
    }


def compile_block_forwards(model: nn.Module, backend: str) -> None:
    """``torch.compile`` (full graph) of each block's innermost ``forward``; see
    [Note: compiled blocks]."""
    # As torchtitan's own per-block compile: data-dependent shapes of token-choice MoE dispatch.
    torch._dynamo.config.capture_scalar_outputs = True
    for block in model.layers.values():
        while isinstance(inner := getattr(block, "_checkpoint_wrapped_module", None), nn.Module):
            block = inner  # below torch's checkpoint_wrapper
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)


def data_parallel_meshes(parallel_dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The dims FSDP2 shards and replicates over: ``fsdp`` (dp_shard x cp, flattened) and, under
    HSDP, ``dp_replicate`` — the same dims torchtitan gives ``fully_shard``."""
    mesh = parallel_dims.get_mesh("fsdp")
    replicate = (
        parallel_dims.get_mesh("dp_replicate") if parallel_dims.dp_replicate_enabled else None
    )
    return mesh, replicate


def expert_parallel_meshes(parallel_dims: ParallelDims) -> dict[str, DeviceMesh]:
    """``dedicate_params``' expert-parallel arguments: under EP (``expert_parallel_degree`` > 1)
    torchtitan's sparse mesh dims ``ep`` (each of its ranks holds other experts: the model's
    ``parallelize`` makes the stacks DTensors ``Shard(0)`` over it) and ``efsdp`` (the
    ranks that hold the same experts, which torchtitan's ``fully_shard`` of the experts shards
    over), so that each expert slice gets an owner inside its EP slot; none without EP. Under
    HSDP the sparse mesh's ``dp_replicate`` is the dense one's ranks, the ``replicate_mesh``
    both grids share."""
    if not parallel_dims.ep_enabled:
        return {}
    return {
        "ep_mesh": parallel_dims.get_mesh("ep"),
        "expert_mesh": parallel_dims.get_mesh("efsdp"),
    }


# [Note: expert parallelism with tensor parallelism]
# torchtitan 0.3 has no expert tensor parallelism (ETP). With EP > 1 its expert stacks are
# DTensors ``Shard(0)`` over ``ep`` alone, on the sparse mesh (``efsdp`` x ``ep`` = ``dp_shard``
# x ``cp`` x ``tp``), and the MoE input is sequence-parallel, so each TP rank routes its own
# tokens: the TP ranks are the experts' data-parallel ranks. dmuon's ownership grid of the dense
# matrices is ``dp_shard`` x ``cp``, one per TP rank, and ``dmuon.dedicate_params`` cuts the
# expert grid out of that grid (``ep`` x ``efsdp`` = its shard dim, [Note: expert meshes] in
# ``dmuon.mesh``); an expert grid that crosses TP ranks would need the expert pieces' owners,
# reduces and broadcasts on a grid of their own, a change to the core's partition, not here.
# At EP 1 with TP, torchtitan shards the stacks over ``tp`` (``Shard(1)`` / ``Shard(2)``), which
# ``dedicate_params`` refuses as well (tensor-parallel expert stacks). Both are refused with
# the fixes that exist: TP 1, or the stacks off the Muon route.


def check_supported(parallel_dims: ParallelDims) -> None:
    if parallel_dims.ep_enabled and parallel_dims.tp_enabled:
        # See [Note: expert parallelism with tensor parallelism].
        efsdp = parallel_dims.dp_shard * parallel_dims.cp * parallel_dims.tp // parallel_dims.ep
        raise ValueError(
            f"dmuon_titan takes expert parallelism (parallelism.expert_parallel_degree="
            f"{parallel_dims.ep}) only without tensor parallelism, got parallelism."
            f"tensor_parallel_degree={parallel_dims.tp}. torchtitan has no expert tensor "
            "parallelism: under EP it folds the TP ranks into the experts' data-parallel dim "
            f"(efsdp = dp_shard x cp x tp / ep = {efsdp}), so each slice of experts would need "
            "an owner among ranks that dmuon's ownership grid (dp_shard x cp, one per TP rank) "
            "keeps apart, which dmuon does not dedicate yet. Set "
            "--parallelism.tensor_parallel_degree 1 (EP with FSDP). With "
            "--parallelism.expert_parallel_degree 1 instead, TP shards the expert stacks "
            "themselves, which dmuon does not dedicate either: there, keep them off the Muon "
            "route (--dmuon.adamw_params, or out of the recipe's DistMuon pattern)."
        )
    if parallel_dims.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"dmuon_titan needs parallelism.spmd_backend='partial_dtensor', got "
            f"{parallel_dims.spmd_backend!r}: under the full-DTensor backends every parameter is "
            "a DTensor over the whole mesh before fully_shard, which dmuon does not dedicate "
            "yet. Set --parallelism.spmd_backend partial_dtensor."
        )
