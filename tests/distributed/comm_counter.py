"""Counts the communication a rank actually issues, by intercepting c10d ops at the dispatcher.

Owns: ``count_collectives()``, a context manager that records every ``c10d::*`` and
``_c10d_functional::*`` op this thread dispatches (``dist.broadcast``, ``dist.reduce``,
``dist.all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, point-to-point, and
the functional collectives DTensor and FSDP2 use), and a picklable ``CollectiveLog`` with the
sums the tests need. It must never learn what was sent from a plan or from dmuon's own
bookkeeping: only from the ops issued.

How it sees them: every ``torch.distributed`` collective reaches the dispatcher as a ``c10d``
op (``c10d::broadcast_(Tensor[] tensors, ProcessGroup process_group, int root_rank, ...)``), so a
``TorchDispatchMode`` sees it with its tensors, its process group (a ``ScriptObject`` that
``ProcessGroup.unbox`` turns back into the group) and its ``async_op`` flag. The mode is
thread-local: ops issued from another thread are not seen. A functional collective is counted
once, at its ``_c10d_functional`` op; the ``c10d`` op it calls underneath runs while the mode is
inactive and is not seen again.

What ``nbytes`` means (per participant, this rank's share, in bytes):

====================  ===============================================================
broadcast, reduce,    the tensor(s) — every participant holds that many bytes;
all_reduce            non-roots of a broadcast receive them, non-roots of a reduce send them
all_gather            the input this rank contributes (the output is group_size times it)
reduce_scatter        the output shard this rank receives (the input is group_size times it)
gather / scatter      this rank's input / output tensor(s)
all_to_all            this rank's whole input
send / recv           the tensor(s) sent / received; ``root`` is the peer
barrier               0
====================  ===============================================================

An op in the c10d namespaces that is not in the table raises ``UnknownCollectiveError``: a
counter that silently skipped traffic would make a test pass that should fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")

# Ops in those namespaces that move no data.
NOT_COMMUNICATION = frozenset(
    {"c10d.check_for_nan", "_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd"}
)


@dataclass(frozen=True, slots=True)
class _OpSpec:
    """How to read one c10d op: its kind, where its payload is, where its root is."""

    kind: str
    payload: str | None  # name of the tensor argument whose bytes count (None: no payload)
    root: str | None = None  # name of the group-local root / peer argument
    divide_by_group_size: bool = False  # functional reduce_scatter: payload is the full input
    always_async: bool = False  # functional collectives return before the data has moved


_OPS: dict[str, _OpSpec] = {
    # torch.distributed API ops (process group passed as a ScriptObject).
    "c10d.broadcast_": _OpSpec("broadcast", "tensors", root="root_rank"),
    "c10d.reduce_": _OpSpec("reduce", "tensors", root="root_rank"),
    "c10d.allreduce_": _OpSpec("all_reduce", "tensors"),
    "c10d.allreduce_coalesced_": _OpSpec("all_reduce", "tensors"),
    "c10d.allgather_": _OpSpec("all_gather", "input_tensors"),
    "c10d._allgather_base_": _OpSpec("all_gather", "input_tensor"),
    "c10d.allgather_coalesced_": _OpSpec("all_gather", "input_list"),
    "c10d.allgather_into_tensor_coalesced_": _OpSpec("all_gather", "inputs"),
    "c10d.reduce_scatter_": _OpSpec("reduce_scatter", "output_tensors"),
    "c10d._reduce_scatter_base_": _OpSpec("reduce_scatter", "output_tensor"),
    "c10d.reduce_scatter_tensor_coalesced_": _OpSpec("reduce_scatter", "outputs"),
    "c10d.gather_": _OpSpec("gather", "input_tensors", root="root_rank"),
    "c10d.scatter_": _OpSpec("scatter", "output_tensors", root="root_rank"),
    "c10d.alltoall_": _OpSpec("all_to_all", "input_tensors"),
    "c10d.alltoall_base_": _OpSpec("all_to_all", "input"),
    "c10d.send": _OpSpec("send", "tensors", root="dst"),
    "c10d.recv_": _OpSpec("recv", "tensors", root="src"),
    "c10d.recv_any_source_": _OpSpec("recv", "tensors"),
    "c10d.barrier": _OpSpec("barrier", None),
    "c10d.monitored_barrier_": _OpSpec("barrier", None),
    # Functional collectives (process group passed by name or object).
    "_c10d_functional.broadcast": _OpSpec("broadcast", "input", root="src", always_async=True),
    "_c10d_functional.broadcast_": _OpSpec("broadcast", "input", root="src", always_async=True),
    "_c10d_functional.all_reduce": _OpSpec("all_reduce", "input", always_async=True),
    "_c10d_functional.all_reduce_": _OpSpec("all_reduce", "input", always_async=True),
    "_c10d_functional.all_reduce_coalesced": _OpSpec("all_reduce", "inputs", always_async=True),
    "_c10d_functional.all_reduce_coalesced_": _OpSpec("all_reduce", "inputs", always_async=True),
    "_c10d_functional.all_gather_into_tensor": _OpSpec("all_gather", "input", always_async=True),
    "_c10d_functional.all_gather_into_tensor_out": _OpSpec(
        "all_gather", "input", always_async=True
    ),
    "_c10d_functional.all_gather_into_tensor_coalesced": _OpSpec(
        "all_gather", "inputs", always_async=True
    ),
    "_c10d_functional.reduce_scatter_tensor": _OpSpec(
        "reduce_scatter", "input", divide_by_group_size=True, always_async=True
    ),
    "_c10d_functional.reduce_scatter_tensor_out": _OpSpec(
        "reduce_scatter", "input", divide_by_group_size=True, always_async=True
    ),
    "_c10d_functional.reduce_scatter_tensor_coalesced": _OpSpec(
        "reduce_scatter", "inputs", divide_by_group_size=True, always_async=True
    ),
    "_c10d_functional.all_to_all_single": _OpSpec("all_to_all", "input", always_async=True),
    "_c10d_functional.isend": _OpSpec("send", "tensor", root="dst", always_async=True),
    "_c10d_functional.irecv": _OpSpec("recv", "tensor", root="src", always_async=True),
    "_c10d_functional_autograd.all_gather_into_tensor": _OpSpec(
        "all_gather", "input", always_async=True
    ),
    "_c10d_functional_autograd.reduce_scatter_tensor": _OpSpec(
        "reduce_scatter", "input", divide_by_group_size=True, always_async=True
    ),
    "_c10d_functional_autograd.all_to_all_single": _OpSpec(
        "all_to_all", "input", always_async=True
    ),
}

_GROUP_ARGUMENTS = ("process_group", "group_name")


class UnknownCollectiveError(RuntimeError):
    """A c10d op the counter has no rule for was issued."""


@dataclass(frozen=True, slots=True)
class Collective:
    """One communication op issued by one rank."""

    op: str  # the dispatcher op, e.g. "c10d.broadcast_"
    kind: str  # "broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", ...
    nbytes: int  # this rank's payload in bytes (see the module docstring's table)
    root: int | None  # global rank of the src/dst root, or of the peer for send/recv
    group_ranks: tuple[int, ...]  # global ranks of the group, in group-rank order
    async_op: bool
    rank: int  # global rank that issued the op

    @property
    def is_root(self) -> bool:
        return self.root == self.rank


@dataclass(slots=True)
class CollectiveLog:
    """The collectives one rank issued inside ``count_collectives()``, in issue order."""

    rank: int
    calls: list[Collective] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[Collective]:
        return [call for call in self.calls if call.kind == kind]

    def count(self, kind: str | None = None) -> int:
        return len(self.calls if kind is None else self.of_kind(kind))

    def total_bytes(self, kind: str | None = None) -> int:
        """This rank's payload summed over its ops (of one kind if given)."""
        return sum(call.nbytes for call in (self.calls if kind is None else self.of_kind(kind)))

    def broadcast_bytes_received(self) -> int:
        """Bytes this rank received by broadcasts it was not the root of."""
        return sum(call.nbytes for call in self.of_kind("broadcast") if not call.is_root)

    def broadcast_bytes_sent_as_root(self) -> int:
        """Bytes of the broadcasts this rank was the root of (each sent to group_size - 1 ranks)."""
        return sum(call.nbytes for call in self.of_kind("broadcast") if call.is_root)

    def reduce_bytes_sent(self) -> int:
        """Bytes this rank contributed to reduces whose root is another rank."""
        return sum(call.nbytes for call in self.of_kind("reduce") if not call.is_root)

    def reduce_bytes_received_as_root(self) -> int:
        """Bytes that reached this rank as the root of reduces (group_size - 1 shares each)."""
        return sum(
            call.nbytes * (len(call.group_ranks) - 1)
            for call in self.of_kind("reduce")
            if call.is_root
        )


def broadcast_bytes_received_per_rank(logs: Sequence[CollectiveLog]) -> list[int]:
    """``[log.broadcast_bytes_received() for log in logs]`` for logs returned by every rank."""
    return [log.broadcast_bytes_received() for log in logs]


def reduce_bytes_sent_per_rank(logs: Sequence[CollectiveLog]) -> list[int]:
    """``[log.reduce_bytes_sent() for log in logs]`` for logs returned by every rank."""
    return [log.reduce_bytes_sent() for log in logs]


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _bind_arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    # The dispatcher drops trailing arguments equal to their default (async_op=True arrives as
    # nothing), so fill them back from the schema.
    bound = {}
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _process_group(bound: dict[str, Any]) -> dist.ProcessGroup:
    for name in _GROUP_ARGUMENTS:
        if name not in bound:
            continue
        group = bound[name]
        if isinstance(group, str):
            return dist.distributed_c10d._resolve_process_group(group)
        if isinstance(group, torch.ScriptObject):
            return dist.ProcessGroup.unbox(group)
        return group
    raise UnknownCollectiveError(f"no process group argument among {sorted(bound)}")


def _describe(func: torch._ops.OpOverload, op_name: str, args: tuple, kwargs: dict) -> Collective:
    spec = _OPS[op_name]
    bound = _bind_arguments(func, args, kwargs)
    group = _process_group(bound)
    group_ranks = tuple(dist.get_global_rank(group, local) for local in range(group.size()))
    nbytes = _tensor_bytes(bound[spec.payload]) if spec.payload else 0
    if spec.divide_by_group_size:
        nbytes //= len(group_ranks)
    root = group_ranks[bound[spec.root]] if spec.root else None
    return Collective(
        op=op_name,
        kind=spec.kind,
        nbytes=nbytes,
        root=root,
        group_ranks=group_ranks,
        async_op=spec.always_async or bool(bound.get("async_op", False)),
        rank=dist.get_rank(),
    )


class _CollectiveRecorder(TorchDispatchMode):
    def __init__(self, log: CollectiveLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A mode runs before tensor subclasses and is inactive inside its own handler, so the
        # collectives DTensor issues while dispatching an op (a redistribution) would go unseen
        # if the op ran here. NotImplemented hands the op to DTensor with this mode still active;
        # what it desugars into (plain-tensor ops and collectives) comes back through this mode.
        # Only DTensor: other subclasses (FakeTensor, in DTensor's sharding propagation) expect
        # the op to run.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if func.namespace in COLLECTIVE_NAMESPACES:
            op_name = f"{func.namespace}.{func._opname}"
            if op_name in _OPS:
                self.log.calls.append(_describe(func, op_name, args, kwargs))
            elif op_name not in NOT_COMMUNICATION:
                raise UnknownCollectiveError(
                    f"count_collectives() has no rule for {op_name} ({func._schema}); add its "
                    "payload and root arguments to _OPS in tests/distributed/comm_counter.py"
                )
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record the communication ops this thread issues inside the block.

    Usage inside a scenario (the log pickles, so return it to the test)::

        with count_collectives() as log:
            optimizer.step()
        return log
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "count_collectives() needs an initialised default process group; use it inside a "
            "scenario run by the gloo worker pool"
        )
    log = CollectiveLog(rank=dist.get_rank())
    with _CollectiveRecorder(log):
        yield log
