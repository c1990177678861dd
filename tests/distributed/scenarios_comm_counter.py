"""Scenarios with known communication, to check what count_collectives() records.

Owns only plain torch.distributed calls whose traffic is known in advance; each returns the
rank's CollectiveLog (and sometimes the values received, to show the ops really ran).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.distributed.comm_counter import CollectiveLog, count_collectives


def rooted_collectives_on_the_world() -> CollectiveLog:
    """On 2 ranks: a sync broadcast of 10 fp32 from rank 1, an async reduce of 6 fp64 to rank 0."""
    payload = torch.full((10,), float(dist.get_rank()))
    dist.all_reduce(torch.ones(1))  # before the block: must not be counted
    with count_collectives() as log:
        dist.broadcast(payload, src=1)
        work = dist.reduce(torch.ones(2, 3, dtype=torch.float64), dst=0, async_op=True)
        work.wait()
    assert payload.eq(1.0).all(), "the broadcast did not deliver rank 1's values"
    return log


def rooted_collectives_on_a_subgroup() -> tuple[CollectiveLog, float]:
    """On 4 ranks: a group of global ranks [1, 3]; async broadcast of 5 fp32 from global rank 3,
    then a sync reduce of 4 bf16 to global rank 1. Ranks 0 and 2 only join new_group."""
    group = dist.new_group([1, 3])
    value = torch.full((5,), float(dist.get_rank()))
    with count_collectives() as log:
        if dist.get_rank() in (1, 3):
            dist.broadcast(value, src=3, group=group, async_op=True).wait()
            dist.reduce(torch.ones(4, dtype=torch.bfloat16), dst=1, group=group)
    return log, value[0].item()


def broadcasts_along_a_device_mesh() -> CollectiveLog:
    """On a 2x2 mesh ("replicate", "shard"): 3 fp32 along "shard", 7 fp16 along "replicate",
    each from the subgroup's first rank."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with count_collectives() as log:
        for dim_name, tensor in (("shard", torch.ones(3)), ("replicate", torch.ones(7).half())):
            group = mesh.get_group(dim_name)
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return log


def gathers_and_scatters() -> CollectiveLog:
    """all_reduce of 8 fp32, all_gather_into_tensor of 3 fp32 per rank, reduce_scatter_tensor
    down to 2 fp32 per rank, and list all_gather of 4 int64 per rank."""
    world_size = dist.get_world_size()
    with count_collectives() as log:
        dist.all_reduce(torch.ones(8))
        dist.all_gather_into_tensor(torch.empty(3 * world_size), torch.ones(3))
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world_size))
        gathered = [torch.empty(4, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(gathered, torch.ones(4, dtype=torch.int64))
    return log


def point_to_point_ring() -> CollectiveLog:
    """Each rank sends 12 fp32 to the next rank and receives as many from the previous one."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with count_collectives() as log:
        outgoing = dist.isend(torch.ones(12), dst=(rank + 1) % world_size)
        dist.recv(torch.empty(12), src=(rank - 1) % world_size)
        outgoing.wait()
    return log


def functional_broadcast_on_a_subgroup() -> tuple[CollectiveLog, float]:
    """On 4 ranks, group [2, 3]: functional broadcast of 6 fp32 from the group's rank 1."""
    group = dist.new_group([2, 3])
    with count_collectives() as log:
        if dist.get_rank() in (2, 3):
            value = funcol.broadcast(torch.full((6,), float(dist.get_rank())), src=1, group=group)
            received = funcol.wait_tensor(value)[0].item()
        else:
            received = float("nan")
    return log, received


def dtensor_collectives() -> tuple[CollectiveLog, CollectiveLog, float]:
    """On a 1-D mesh: ``full_tensor()`` of a row-sharded 4x4 fp32 DTensor (issued from Python),
    then the sum of a row-sharded and a column-sharded one (DTensor redistributes one operand
    while dispatching the add)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    rows = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    columns = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    with count_collectives() as gather_log:
        rows.full_tensor()
    with count_collectives() as add_log:
        total = (rows + columns).full_tensor().sum().item()
    return gather_log, add_log, total
