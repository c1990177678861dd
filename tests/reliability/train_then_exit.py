"""Run by ``test_clean_exit.py`` under torchrun: train a dedicated model inside a function (so it
ends as cyclic garbage), destroy the process group, and leave Python the usual way.

The automatic garbage collector is off once training starts, so the dropped model is freed only
by an explicit collection: dmuon's at exit. A check registered before dmuon is imported runs
after dmuon's exit hooks (atexit runs last-registered first) and prints whether the model was
freed while the interpreter was still intact. Without that collection the model would be freed,
or not, by whichever collection happened to run during teardown: the abort this guards against
showed in about half of the 4-rank runs, the check shows its cause in every run.
"""

import atexit
import weakref

dropped: list[weakref.ref] = []


def report_dropped_models_alive() -> None:
    alive = sum(ref() is not None for ref in dropped)
    print(f"dropped dedicated models alive after dmuon's exit hooks: {alive}", flush=True)


atexit.register(report_dropped_models_alive)

import gc  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import dmuon  # noqa: E402
from dmuon.testing import TinyDecoder, batches, loss_fn, proj_predicate, rank_rows  # noqa: E402


def train() -> weakref.ref:
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
    return weakref.ref(model)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    gc.disable()
    dropped.append(train())
    dist.destroy_process_group()
