"""Reliability scenarios run on every rank of a gloo pool; each returns what the test checks."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests.distributed.models import TinyDecoder, proj_predicate


def muon_with_a_different_value_on_rank_1(name: str, value, default) -> str:
    """``dmuon.Muon(model, **{name: value})`` on rank 1, ``default`` elsewhere: the message."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    try:
        dmuon.Muon(model, **{name: value if dist.get_rank() == 1 else default})
    except ValueError as error:
        return str(error)
    return "no error"
