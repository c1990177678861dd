"""Run by ``test_clean_exit.py`` under torchrun: train a dedicated model inside a function (so it
ends as cyclic garbage), destroy the process group, and leave Python the usual way."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.testing import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows


def train() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = TinyDecoder()
    dmuon.dedicate_params(model, mesh, proj_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model)
    for batch in batches(2, world):
        loss_fn(model, rank_rows(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    train()
    dist.destroy_process_group()
