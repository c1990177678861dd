"""Tensor parallelism: dedicated matrices that ``parallelize_module`` made into DTensors.

Owns recognising a tensor-parallel parameter (the mesh dim of its DTensor, told apart from the
data-parallel dims by name: any names, e.g. torchtitan's "tp" beside "dp_replicate" and "fsdp"),
the model-parallel dims of a model (``model_parallel_dims``), the arithmetic of its chunks (which
rows or columns each TP rank holds), and the two exchanges of the owner step: the Muon input of
every chunk to the TP rank that orthogonalises the whole matrix, and the chunks of the update
back. It must not decide owners (``partition``) nor do optimizer math (``optim``).

[Note: tensor-parallel matrices]
After ``parallelize_module(model, mesh["tp"], plan)`` a weight is a DTensor on the 1-D TP mesh,
``Shard(0)`` (colwise) or ``Shard(1)`` (rowwise): TP rank t holds chunk t, in ``torch.chunk``'s
split. Along the data-parallel dims nothing changes: each TP rank runs the ownership protocol
over its own data-parallel group with its own chunk, so the owner slot (s, r) holds, on every TP
rank t, the fp32 master of chunk t and its momentum (momentum and Nesterov are element-wise, so
chunk-local state is exact). Newton-Schulz needs the whole matrix: at ``step()`` the owner's TP
ranks send their chunks of the Muon input to one TP rank (the owner coordinate's ``tp``, chosen
by the partition over dp x tp slots so that the iterations spread over every rank), which
normalises and orthogonalises the full matrix and scatters the chunks of the result back; each
TP rank applies its chunk to its master with decoupled weight decay. A ``Replicate`` DTensor (or
a plain tensor) holds the whole matrix on every TP rank and needs no exchange.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from dmuon import collectives

NAMED_MESH_FIX = 'mesh = init_device_mesh("cuda", (dp_size, tp_size), mesh_dim_names=("dp", "tp"))'


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelLayout:
    """How one dedicated parameter is split over its TP mesh."""

    mesh: DeviceMesh  # the 1-D TP mesh of the DTensor
    placement: Placement  # Shard(dim) or Replicate()
    shape: tuple[int, ...]  # the global shape

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        """This rank's coordinate on the TP mesh."""
        return self.mesh.get_local_rank()

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the TP mesh, by TP coordinate."""
        return tuple(self.mesh.mesh.tolist())

    @property
    def shard_dim(self) -> int | None:
        return self.placement.dim if isinstance(self.placement, Shard) else None

    @property
    def is_sharded(self) -> bool:
        return self.shard_dim is not None and self.size > 1

    @property
    def chunk_length(self) -> int:
        """Rows (or columns) of the largest chunk: every chunk travels padded to it."""
        return math.ceil(self.shape[self.shard_dim] / self.size)

    def bounds(self, tp_rank: int) -> tuple[int, int]:
        """[start, stop) of ``tp_rank``'s chunk along the shard dim."""
        return chunk_bounds(self.shape[self.shard_dim], self.size, tp_rank)

    def local_shape(self, tp_rank: int | None = None) -> tuple[int, ...]:
        if self.shard_dim is None:
            return self.shape
        start, stop = self.bounds(self.rank if tp_rank is None else tp_rank)
        shape = list(self.shape)
        shape[self.shard_dim] = stop - start
        return tuple(shape)

    def padded_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.shard_dim] = self.chunk_length
        return tuple(shape)

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a full value."""
        if self.shard_dim is None:
            return full
        start, stop = self.bounds(self.rank)
        return full.narrow(self.shard_dim, start, stop - start)

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's chunk, not copied) as the DTensor the model computes with."""
        return DTensor.from_local(
            local,
            self.mesh,
            [self.placement],
            shape=torch.Size(self.shape),
            stride=_contiguous_stride(self.shape),
        )

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a gradient autograd left on the DTensor parameter.

        A replicated weight used on sequence-sharded activations gets a ``Partial`` gradient;
        it is reduced to the parameter's own placement first, as DTensor's optimizers expect.
        """
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != (self.placement,):
                grad = grad.redistribute(self.mesh, [self.placement])
            return grad.to_local()
        return grad


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` when ``length`` rows are split in ``parts`` as
    ``torch.chunk`` (and so DTensor's ``Shard``) splits them: chunks of ceil(length / parts),
    the last ones shorter or empty."""
    size = math.ceil(length / parts)
    start = min(index * size, length)
    return start, min(start + size, length)


def find_tensor_parallel_layout(
    name: str, param: torch.Tensor, data_parallel_names: set[str] | None
) -> TensorParallelLayout | None:
    """The TP layout of a parameter ``dedicate_params`` selected; None for a plain tensor.

    ``data_parallel_names`` are the dim names of the meshes given to ``dedicate_params`` (None
    when one of them has no names); the TP dim is the DTensor's dim outside them.
    """
    if not isinstance(param, DTensor):
        return None
    names = param.device_mesh.mesh_dim_names
    if names is None or data_parallel_names is None:
        unnamed = "its DTensor's mesh" if names is None else "the mesh given to dedicate_params"
        raise ValueError(
            f"DMuon requires named DeviceMesh for TP detection: parameter {name} is a DTensor, "
            f"but {unnamed} has no mesh_dim_names. Build the mesh with names and pass its dims "
            f"to parallelize_module, fully_shard and dedicate_params:\n    {NAMED_MESH_FIX}"
        )
    shared = [dim for dim in names if dim in data_parallel_names]
    if shared:
        raise ValueError(
            f"parameter {name} is a DTensor over the data-parallel mesh dims {shared} (its mesh "
            f"is {names}): dmuon takes TP DTensors from parallelize_module on the 'tp' dim "
            "alone. Call parallelize_module(model, mesh['tp'], plan), then dedicate_params, "
            "then fully_shard."
        )
    if len(names) != 1:
        raise ValueError(
            f"parameter {name} is a DTensor on the {len(names)}-D mesh {names}; dmuon supports "
            "one tensor-parallel dim. Parallelize the model over one dim: "
            "parallelize_module(model, mesh['tp'], plan)."
        )
    (placement,) = param.placements
    if not (isinstance(placement, Replicate) or type(placement) is Shard):
        raise ValueError(
            f"parameter {name} is a DTensor placed {placement!r} on the {names[0]!r} dim; dmuon "
            "dedicates tensor-parallel weights placed Shard(dim) (ColwiseParallel, "
            "RowwiseParallel) or Replicate(). Leave this one out of the predicate (it stays "
            "with the AdamW route)."
        )
    if isinstance(placement, Shard) and placement.dim < 0:
        placement = Shard(placement.dim + param.ndim)
    return TensorParallelLayout(
        mesh=param.device_mesh, placement=placement, shape=tuple(param.shape)
    )


def model_parallel_dims(
    model: torch.nn.Module, data_parallel_names: set[str] | None
) -> frozenset[str]:
    """The dim names of the meshes the model's parameters are DTensors over before
    ``fully_shard``: the tensor-parallel dims (``parallelize_module`` runs first), whatever their
    names; the data-parallel dims given to ``dedicate_params`` are never among them. See
    [Note: HSDP by structure] in ``dmuon.mesh`` for what they are kept for."""
    names = {
        name
        for param in model.parameters()
        if isinstance(param, DTensor)
        for name in (param.device_mesh.mesh_dim_names or ())
    }
    return frozenset(names - (data_parallel_names or set()))


def exchange_mesh(layouts: dict[str, TensorParallelLayout]) -> DeviceMesh | None:
    """The one TP mesh the dedicated DTensors share, where some are TP-sharded (their chunks
    are exchanged at step); None when none is. Raises if they live on different TP meshes."""
    found: dict[tuple[int, ...], str] = {}
    for name, layout in layouts.items():
        found.setdefault(layout.ranks, name)
    if len(found) > 1:
        shown = "; ".join(f"{name} on ranks {list(ranks)}" for ranks, name in found.items())
        raise ValueError(
            f"dedicate_params: the tensor-parallel parameters live on different TP meshes "
            f"({shown}). Parallelize the whole model over one mesh['tp']."
        )
    sharded = [layout for layout in layouts.values() if layout.is_sharded]
    return sharded[0].mesh if sharded else None


# ---- the owner step's exchanges ----------------------------------------------------------------


@dataclass(eq=False, slots=True)
class ChunkExchange:
    """The Muon inputs of TP-sharded matrices gathered to their runners, and the updates back.

    ``layouts[i]`` and ``runners[i]`` (a TP coordinate) describe matrix i; every TP rank of the
    owner builds the same lists in the same order. ``tp_ranks`` are the global ranks of the TP
    coordinates, and ``group`` their process group.
    """

    layouts: list[TensorParallelLayout]
    runners: list[int]
    tp_ranks: tuple[int, ...]
    group: dist.ProcessGroup

    def gather(self, chunks: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Send each chunk to its runner; returns the full value of every matrix this rank runs,
        by index. Collective over the TP group: one gather per runner, all in flight at once."""
        me = self.tp_ranks.index(dist.get_rank())
        pending = []
        for runner, indices in self._runs():
            message = torch.cat([self._padded(chunks[i], i).reshape(-1) for i in indices])
            message = message.to(self._wire_device(message.device))
            parts = [torch.empty_like(message) for _ in self.tp_ranks] if runner == me else None
            work = collectives.gather(
                message, parts, self.tp_ranks[runner], self.group, "the Muon inputs of TP chunks"
            )
            pending.append((work, indices, parts))
        received: dict[int, torch.Tensor] = {}
        for work, indices, parts in pending:
            work.wait()
            if parts is not None:
                parts = [part.to(chunks[indices[0]].device) for part in parts]
                received.update(self._assembled(indices, self._by_coordinate(parts)))
        return received

    def scatter(
        self, results: dict[int, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        """Send each runner's full results back in chunks; returns this rank's chunk of every
        matrix, in ``dtype`` (the results' dtype on every rank). Collective over the TP group."""
        me = self.tp_ranks.index(dist.get_rank())
        pending = []
        for runner, indices in self._runs():
            numel = sum(math.prod(self.layouts[i].padded_shape()) for i in indices)
            message = torch.empty(numel, dtype=dtype, device=self._wire_device(device))
            parts = None
            if runner == me:
                parts = self._by_group_rank(
                    [
                        torch.cat(
                            [self._chunk_of(results[i], i, t).reshape(-1) for i in indices]
                        ).to(message.device)
                        for t in range(len(self.tp_ranks))
                    ]
                )
            work = collectives.scatter(
                message, parts, self.tp_ranks[runner], self.group, "the Muon updates of TP chunks"
            )
            pending.append((work, indices, message))
        out: list[torch.Tensor | None] = [None] * len(self.layouts)
        for work, indices, message in pending:
            work.wait()
            message = message.to(device)
            offset = 0
            for i in indices:
                padded = self.layouts[i].padded_shape()
                piece = message[offset : offset + math.prod(padded)].view(padded)
                offset += piece.numel()
                out[i] = self._unpadded(piece, i, me)
        return out

    # ---- chunk arithmetic ----

    def _padded(self, chunk: torch.Tensor, i: int) -> torch.Tensor:
        layout = self.layouts[i]
        missing = layout.chunk_length - chunk.shape[layout.shard_dim]
        if missing == 0:
            return chunk
        pad_shape = list(chunk.shape)
        pad_shape[layout.shard_dim] = missing
        return torch.cat([chunk, chunk.new_zeros(pad_shape)], dim=layout.shard_dim)

    def _unpadded(self, padded: torch.Tensor, i: int, tp_rank: int) -> torch.Tensor:
        start, stop = self.layouts[i].bounds(tp_rank)
        return padded.narrow(self.layouts[i].shard_dim, 0, stop - start)

    def _chunk_of(self, full: torch.Tensor, i: int, tp_rank: int) -> torch.Tensor:
        start, stop = self.layouts[i].bounds(tp_rank)
        return self._padded(full.narrow(self.layouts[i].shard_dim, start, stop - start), i)

    def _assembled(self, indices: list[int], parts: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in indices}
        for tp_rank, part in enumerate(parts):
            offset = 0
            for i in indices:
                padded = self.layouts[i].padded_shape()
                piece = part[offset : offset + math.prod(padded)].view(padded)
                offset += piece.numel()
                pieces[i].append(self._unpadded(piece, i, tp_rank))
        return {i: torch.cat(chunks, dim=self.layouts[i].shard_dim) for i, chunks in pieces.items()}

    def _wire_device(self, device: torch.device) -> torch.device:
        # gloo gathers and scatters CPU tensors only (gloo ranks sharing one GPU): stage there.
        if device.type != "cpu" and dist.get_backend(self.group) == "gloo":
            return torch.device("cpu")
        return device

    def _runs(self) -> Iterator[tuple[int, list[int]]]:
        """``(runner, the matrices it runs)`` for each TP coordinate that runs any."""
        for runner in range(len(self.tp_ranks)):
            indices = [i for i, r in enumerate(self.runners) if r == runner]
            if indices:
                yield runner, indices

    # gather and scatter lists are indexed by group rank (ranks sorted); chunks by TP coordinate.
    def _by_coordinate(self, by_group_rank: list[torch.Tensor]) -> list[torch.Tensor]:
        return [by_group_rank[dist.get_group_rank(self.group, r)] for r in self.tp_ranks]

    def _by_group_rank(self, by_coordinate: list[torch.Tensor]) -> list[torch.Tensor]:
        ordered: list[torch.Tensor | None] = [None] * len(by_coordinate)
        for rank, tensor in zip(self.tp_ranks, by_coordinate):
            ordered[dist.get_group_rank(self.group, rank)] = tensor
        return ordered


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))
