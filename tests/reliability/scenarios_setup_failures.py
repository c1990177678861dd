"""Scenarios where ``dedicate_params`` fails on some ranks only; run on every rank of a gloo pool.

Each returns what this rank raised (type, message, the exception it was chained from) instead of
letting it escape, so the test sees every rank's error and the pool keeps its workers.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests.distributed.models import TinyDecoder, proj_predicate


def _dedicate_and_report(**kwargs) -> dict:
    try:
        dmuon.dedicate_params(TinyDecoder(), **kwargs)
    except Exception as error:
        cause = error.__cause__
        return {
            "type": type(error).__name__,
            "message": str(error),
            "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
        }
    return {"type": None, "message": "no error", "cause": None}


def _flat_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))


def predicate_raises_on(*, failing_ranks: list[int]) -> dict:
    """The predicate raises ValueError("boom") on ``failing_ranks``; the others' runs fine."""
    mesh = _flat_mesh()
    rank = dist.get_rank()

    def predicate(name, param):
        if rank in failing_ranks:
            raise ValueError(f"boom on rank {rank}")
        return proj_predicate(name, param)

    return _dedicate_and_report(mesh=mesh, predicate=predicate)


def bad_argument_on_rank_1(*, argument: str) -> dict:
    """Rank 1 passes a bad ``argument`` ("policy": an unknown process_group_policy;
    "param_policy": an unknown dtype; "mesh": a mesh that is no DeviceMesh); every other rank
    passes good ones."""
    mesh = _flat_mesh()
    kwargs = {"mesh": mesh, "predicate": proj_predicate}
    if dist.get_rank() == 1:
        if argument == "policy":
            kwargs["process_group_policy"] = "clone"
        elif argument == "param_policy":
            kwargs["param_policy"] = {"defaults": {"param_dtype": "fp8"}}
        else:
            kwargs["mesh"] = [0, 1]
    return _dedicate_and_report(**kwargs)


def failure_on_another_pipeline_stage() -> dict:
    """A ("pp", "dp") 2x2 mesh; rank 3 (stage 1) fails: stage 0's ranks must raise as well, as
    the groups of both stages are created by all ranks together."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    rank = dist.get_rank()

    def predicate(name, param):
        if rank == 3:
            raise KeyError(name)
        return proj_predicate(name, param)

    return _dedicate_and_report(mesh=mesh["dp"], predicate=predicate)


def different_process_group_policies() -> dict:
    """Valid policies, but rank 1's differs from the others'."""
    policy = "shared" if dist.get_rank() == 1 else "isolated"
    return _dedicate_and_report(
        mesh=_flat_mesh(), predicate=proj_predicate, process_group_policy=policy
    )


def meshes_that_disagree() -> dict:
    """Ranks 0, 1 pass the "dp" dim of a ("pp", "dp") mesh, ranks 2, 3 that of a ("dp", "tp")
    mesh: rank 2's slice {0, 2} holds rank 0, whose own slice is {0, 1}."""
    pp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = pp_dp["dp"] if dist.get_rank() < 2 else dp_tp["dp"]
    return _dedicate_and_report(mesh=mesh, predicate=proj_predicate)
