"""The collectives of the ownership protocol, one function each, and their completion handles.

Owns how a collective is issued and how its completion is awaited; it must not decide which
tensors move (that is ``group``) or when (that is ``hooks`` and ``optim``).

[Note: handles instead of events]
Every collective is issued with ``async_op=True`` and returns its work handle; the protocol waits
on the handle only where the data is consumed. On NCCL, ``Work.wait()`` makes the *current CUDA
stream* wait for the collective's stream (no host synchronisation), so the handle plays the role
of a CUDA event. On gloo (CPU in CI, or CUDA tensors on one shared GPU) ``wait()`` blocks the host
until the background transfer is done. One code path serves both, so the asynchronous paths
(prefetch, pending publishes, drains) really run in CI.

Reductions use SUM and the owner divides afterwards (by the number of ranks, or by the gradient
divide factor: see ``dmuon.data_parallel``): gloo has no AVG, and one formula keeps NCCL and gloo
numerically alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist


class Handle(Protocol):
    def wait(self) -> object: ...


class _Done:
    """The handle of a collective that needed no communication (a group of one)."""

    def wait(self) -> bool:
        return True


DONE: Handle = _Done()


COLLECTIVE_FAILED = (
    "dmuon: the {operation} of {numel} elements{root} over ranks {ranks}{purpose} (rank {rank} "
    "waiting) failed: {error}. A rank of this group stalled, died or skipped the call; its own "
    "log says why. A hook boundary that ran on some ranks only (data-dependent control flow) "
    "makes the ranks skip each other's collectives: every rank must run the same boundaries in "
    "every forward (see dmuon's troubleshooting page)."
)


class _Named:
    """A collective's work handle whose failure (a timeout, a dead peer) names the collective
    and what it was for."""

    __slots__ = ("group", "numel", "operation", "purpose", "root", "work")

    def __init__(
        self,
        work,
        operation: str,
        root: int | None,
        group: dist.ProcessGroup,
        numel: int,
        purpose: str | None,
    ):
        self.work, self.operation, self.root, self.group, self.numel, self.purpose = (
            work, operation, root, group, numel, purpose,
        )  # fmt: skip

    def wait(self) -> object:
        try:
            return self.work.wait()
        except RuntimeError as error:
            raise RuntimeError(
                COLLECTIVE_FAILED.format(
                    operation=self.operation,
                    numel=self.numel,
                    root="" if self.root is None else f" with root rank {self.root}",
                    ranks=dist.get_process_group_ranks(self.group),
                    purpose="" if self.purpose is None else f" for {self.purpose}",
                    rank=dist.get_rank(),
                    error=error,
                )
            ) from error


# Each function below takes ``purpose``: what the collective is for, in a few words ("the weights
# of boundary 'layers.1'"), which its failure names.


def broadcast(
    tensor: torch.Tensor,
    src_rank: int,
    group: dist.ProcessGroup | None,
    purpose: str | None = None,
) -> Handle:
    """Send ``tensor`` from global rank ``src_rank`` into the same tensor on every group rank."""
    if group is None:
        return DONE
    work = dist.broadcast(tensor, src=src_rank, group=group, async_op=True)
    return _Named(work, "broadcast", src_rank, group, tensor.numel(), purpose)


def reduce_sum(
    tensor: torch.Tensor,
    dst_rank: int,
    group: dist.ProcessGroup | None,
    purpose: str | None = None,
) -> Handle:
    """Sum ``tensor`` over the group into global rank ``dst_rank`` (other ranks' copies are junk)."""
    if group is None:
        return DONE
    work = dist.reduce(tensor, dst=dst_rank, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _Named(work, "reduce", dst_rank, group, tensor.numel(), purpose)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    purpose: str | None = None,
) -> Handle:
    """Reduce ``tensor`` over the group into every rank's copy."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return _Named(work, "all-reduce", None, group, tensor.numel(), purpose)


def gather(
    tensor: torch.Tensor,
    parts: list[torch.Tensor] | None,
    dst_rank: int,
    group: dist.ProcessGroup,
    purpose: str | None = None,
) -> Handle:
    """Collect every group rank's ``tensor`` into ``parts`` on global rank ``dst_rank``."""
    work = dist.gather(tensor, parts, dst=dst_rank, group=group, async_op=True)
    return _Named(work, "gather", dst_rank, group, tensor.numel(), purpose)


def scatter(
    tensor: torch.Tensor,
    parts: list[torch.Tensor] | None,
    src_rank: int,
    group: dist.ProcessGroup,
    purpose: str | None = None,
) -> Handle:
    """Send ``parts[i]`` from global rank ``src_rank`` into ``tensor`` on group rank ``i``."""
    work = dist.scatter(tensor, parts, src=src_rank, group=group, async_op=True)
    return _Named(work, "scatter", src_rank, group, tensor.numel(), purpose)


def wait_all(handles: Iterable[Handle]) -> None:
    for handle in handles:
        handle.wait()
