"""Scenarios that exercise the worker pool itself (run on every rank by tests/distributed/test_pool.py).

Owns only tiny behaviours of a rank: report its set-up, fail, hang, die, talk on a mesh. Nothing
about dmuon lives here.
"""

import ctypes
import datetime
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def report_setup() -> dict[str, object]:
    """What a rank sees of its environment: rank, world size, threads, PG backend and timeout."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "num_threads": torch.get_num_threads(),
        "pg_timeout_s": backend.options._timeout.total_seconds(),
        "master_addr": os.environ["MASTER_ADDR"],
    }


def fork_server_threads() -> list[str]:
    """The names of the threads of the process this worker was forked from (Linux)."""
    tasks = Path(f"/proc/{os.getppid()}/task")
    return sorted((task / "comm").read_text().strip() for task in tasks.iterdir())


def sum_of_ranks() -> float:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item()


def random_draw() -> torch.Tensor:
    return torch.rand(3)


def raise_on_ranks(ranks: list[int], message: str) -> str:
    print(f"rank {dist.get_rank()} is about to check its input")
    if dist.get_rank() in ranks:
        raise ValueError(f"{message} (rank {dist.get_rank()})")
    return "fine"


def print_line(text: str) -> None:
    print(f"{text} from rank {dist.get_rank()}")


def only_rank_zero_all_reduces() -> str:
    """A collective that only rank 0 issues: rank 0 blocks, the others return at once."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return "returned"


def only_rank_zero_all_reduces_on_short_timeout_group(timeout_s: float) -> str:
    """Like ``only_rank_zero_all_reduces`` on a subgroup whose timeout makes rank 0 raise."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), group=group)
    return "returned"


def block_forever_on_rank(rank: int) -> str:
    """Blocks outside any collective (no PG timeout can fire), so only the pool's deadline helps."""
    if dist.get_rank() == rank:
        threading.Event().wait()
    return "returned"


def exit_on_rank(rank: int, exit_code: int) -> str:
    if dist.get_rank() == rank:
        os._exit(exit_code)
    return "returned"


def segfault_on_rank(rank: int) -> str:
    if dist.get_rank() == rank:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return "returned"


def broadcast_along_each_mesh_dim() -> dict[str, float]:
    """On a 2x2 mesh ("replicate", "shard"): broadcast this rank's id from each subgroup's rank 0."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    received = {}
    for dim_name in ("replicate", "shard"):
        group = mesh.get_group(dim_name)
        value = torch.tensor([float(dist.get_rank())])
        dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
        received[dim_name] = value.item()
    return received


def new_groups_then_count(count: int) -> int:
    """Create ``count`` groups over every rank (each used once); return how many groups this
    rank now has, the default group included."""
    for _ in range(count):
        group = dist.new_group(list(range(dist.get_world_size())))
        dist.all_reduce(torch.ones(1), group=group)
    return len(dist.distributed_c10d._world.pg_map)
