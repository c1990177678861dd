"""The overlapped owner step: Muon's owner work started during backward, committed by ``step()``.

Owns the speculation of ``dmuon.Muon(..., overlap_step=True)``: what was computed during
backward for which matrices, from which inputs, on which stream, and whether ``step()`` may
commit it. It must not do the update math (``dmuon.Muon`` hands it the functions that compute
and apply, the same ones its plain step uses) nor move data (``hooks`` lands the gradients).

[Note: the overlapped step]
Plain schedule: backward reduces each boundary's gradients to their owners, the end of backward
adds them into the masters' ``.grad``, and ``step()`` runs momentum + Newton-Schulz for every
owned matrix. With ``overlap_step=True`` each boundary's owned gradients *land* as soon as the
boundary has reduced (``DedicatedState._land``: its local reduces waited for, the replicate
stage under HSDP run, the messages averaged). The owner's boundaries are cut into a few *chunks*
of consecutive boundaries (see [Note: speculation chunks]); as soon as the last boundary of a
chunk lands, the owner computes, for that chunk's Muon matrices of each param group (a *unit*),
the new momentum and the Newton-Schulz output, on a side stream on CUDA (inline elsewhere),
while backward goes on through the earlier layers. This work is *speculative*: nothing the
plain step reads is changed by it. The new momentum goes into a scratch buffer and the
Newton-Schulz output is kept; the masters and the optimizer state are untouched until
``step()``.

``step()`` *commits* a unit only where its inputs are exactly those the plain step would use:

- each matrix's ``.grad`` at step time is the very tensor the speculation read (a view of the
  same averaged message, same offset) and unchanged since: the message's version counter is the
  one recorded at landing. A later backward without ``no_sync`` adds into the gradient (its
  version moves), ``zero_grad`` drops it, a user's in-place edit moves the version: recompute;
- ``dmuon.clip_grad_norm_`` scales every gradient in place (torch multiplies even by 1). It
  records the coefficient it used; a unit whose gradients were changed by that clip alone
  commits only if the coefficient is exactly 1.0 (one scalar read on the host in ``step()``),
  since multiplying by 1.0 changes no bit; a clip that really scales means recompute;
- the step-wide non-finite decision runs first, as in the plain step: a skipped step (or
  ``nonfinite="raise"``) discards every speculation; with ``"ignore"`` a NaN gradient's unit
  commits the same NaN the plain step would compute from it;
- the momentum state is the one it read (same tensor, same version; or still absent), and the
  group's ``momentum`` and ``nesterov`` are the values it used. ``lr``, ``weight_decay`` and
  ``adjust_lr`` are read at commit (the decay and the update are applied there), so an lr
  scheduler needs nothing;
- the unit's matrices with a gradient at step time are exactly the ones speculated (a matrix no
  rank produced a gradient for in this backward is absent: recompute the unit).

A committed unit installs its scratch momentum as the state's and applies the stored
Newton-Schulz output with the group's current lr and weight decay; every other unit is computed
by the plain step. Both go through the same functions with the same batching: in this mode the
plain step, too, runs one unit at a time (Newton-Schulz batched by shape within a chunk, not
across chunks), so a committed unit and a recomputed one are bit-identical on any device, by
construction. Against the default schedule (batched across boundaries) they are
bit-identical where the kernels give each matrix of a batch the same result whatever the batch
(verified on CPU: ``tests/distributed/test_overlap_step.py``). On CUDA they are not: the
plain schedule's last product writes the update into the masters, where a unit here applies
its stored output ([Note: the update epilogue] in ``dmuon_kernels.update_epilogue``), so the two
differ by the fp16 rounding of that output, besides any batch-dependent rounding of the kernels.

Streams (CUDA): a landing makes the side stream wait for the compute stream (so it sees the
gradients, the momentum and the previous step's writes) and the reduces; the tensors it reads
that the compute stream allocated are ``record_stream``-ed on the side stream. Each landing
records an event once its gradients are averaged, before its speculation; the end of backward
makes the compute stream wait for the last one before the masters take their gradients, so
whatever reads them next (the non-finite check, a clip's norm, the user) reads final values,
while the speculation of the last chunk may still run. The compute stream waits for the whole
speculation only where something could race it: before ``dmuon.clip_grad_norm_`` scales the
gradients in place (they may still be read), and in ``step()`` after the non-finite decision
(the commit reads its results). So the host's wait for that decision, and its launches of the
commit, overlap the last chunk's Newton-Schulz instead of following it. A Newton-Schulz graph
called from another stream meanwhile waits for the side stream's replays by itself
(``dmuon_kernels.graphs``).

[Note: speculation chunks]
A unit was first one boundary (one layer), and on the H200 at world size 1 that made the
overlapped step 9-11% slower than the plain one: Newton-Schulz batched one layer's matrices
instead of every layer's, so each problem fell under the autotuner's size bound and ran on
cuBLAS, less efficiently (torch.profiler, ``benchmarks/overlap/profile_overlap.py``: quack's
SYRK time -16.6 ms per step, cuBLAS's +28 ms; profile-overlap-h200-w1-2026-12-02-8814852.json).
So each Muon param group's boundaries, in the model's order, are cut into ``SPECULATION_CHUNKS``
runs of about equal owned elements. Two, not four: each Newton-Schulz batch is then half of the
plain step's instead of a quarter. On the H200 at world size 1, paired against the plain step,
four chunks gave +1.87 ms (215ad1a) and two -2.37 and -4.06 ms (215ad1a, 99ae62b), each on its
own machine start; at side-stream priority -5, four gave +4.50 and two +2.25 (142ad87;
overlap-ab-h200-w1-2026-12-04-*.json). ``dmuon-tools simulate`` puts two and four within 1 ms of
each other for Llama-3-8B and 70B on 8 to 512 GPUs: half of the owner work starts before
backward ends instead of three quarters, but there it is a small share of the step.

[Note: speculation graphs]
The speculation's launches are made from backward, on its thread: where backward is host-bound
(world size 1 on the H200, on some of its hosts), each one delays backward's own launches, and
eager Newton-Schulz calls were most of it (the speculation's host time per iteration of the
0.89 B Llama: 38.9 ms eager, 17.1 ms with graphs;
``overlap-timeline-h200-w1-2026-12-04-333e147.json``). So in this mode every Newton-Schulz
call (speculated or computed by ``step()``, one chunk's matrices of a shape) replays a CUDA
graph up to ``SPECULATION_GRAPH_MAX_NUMEL`` elements, where the plain step stops at
``dmuon_kernels.graphs.GRAPH_MAX_NUMEL``; a call holds at most 256 MiB of fp16 input
(``dmuon.muon_state.NS_CALL_BYTES``), so only a single matrix over 2**28 elements stays eager.
A graph keeps its input and intermediates for good (the iteration's final product runs after the
replay, into the tensor the call returns), once per shape, since the chunks of a uniform model
share their shapes: on the H200's 0.89 B Llama the peak is 17.6 GiB against the plain step's 13.5
(``e2e-h200-w1-2026-12-04-dd0ad90-overlap.json``; 17.2 with four chunks).

Memory: from landing to ``step()``, per speculated matrix, a scratch momentum (fp32, 4 bytes an
element, written by the fused pass from the state's buffer, which it only reads; the old buffer
is freed at commit) and the Newton-Schulz output (its dtype: 2 bytes an element in fp16 on CUDA,
4 in fp32 on CPU): about 6 bytes per owned Muon element on CUDA, where the plain step holds only
one Newton-Schulz call's transient buffers at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from dmuon import _profiler_labels as labels
from dmuon._torch_internals import profiler_range, tensor_version, view_base
from dmuon.experts import is_expert_piece
from dmuon.group import AveragedGradients, BoundaryGroup, GradientMessage
from dmuon.muon_state import MOMENTUM_BUFFER, Batch
from dmuon.param import MUON_ROUTE, DedicatedParam

# A unit's Newton-Schulz calls, each with its output (``dmuon.muon_state.Batch``).
Speculate = Callable[
    [dict, list[nn.Parameter], dict[int, torch.Tensor], dict[int, torch.Tensor]],
    list[tuple[Batch, torch.Tensor]],
]
Apply = Callable[[dict, Batch, torch.Tensor], None]

# How many runs of consecutive boundaries a param group's speculation is cut into: see [Note:
# speculation chunks].
SPECULATION_CHUNKS = 2
# The largest Newton-Schulz input the overlapped step replays as a CUDA graph: see [Note:
# speculation graphs]. 2**28 fp16 elements: 512 MiB of input.
SPECULATION_GRAPH_MAX_NUMEL = 2**28
# The side stream's CUDA priority (lower is higher; 0, the default streams', is the lowest). The
# highest, -5, was no faster at world size 1 on the H200 (paired +4.50 ms over the plain step
# against +2.79 at 0; overlap-ab-h200-w1-2026-12-04-142ad87-chunks4-priority*.json).
SPECULATION_STREAM_PRIORITY = 0
Boundary = TypeVar("Boundary", bound=Hashable)


@dataclass(frozen=True, slots=True)
class OverlapStepStats:
    """Counts of Muon matrices (an expert piece's experts each count) since construction.

    ``speculated``: computed during backward; ``committed``: of those, applied by ``step()``;
    ``discarded``: of those, thrown away (inputs changed, a clip that scaled, a skipped step,
    ``zero_grad``, a later landing); ``recomputed``: computed by ``step()`` itself."""

    speculated: int = 0
    committed: int = 0
    discarded: int = 0
    recomputed: int = 0


@dataclass(eq=False, slots=True)
class _Input:
    """The gradient and momentum one matrix's speculation read."""

    message: torch.Tensor  # the averaged message its gradient is a view of
    offset: int  # the gradient's storage offset in it
    version: int  # the message's version the result is valid for
    # Clip coefficients (0-dim tensors) that must be exactly 1.0 for the version to hold.
    clip_coefficients: list[torch.Tensor] = field(default_factory=list)
    momentum: torch.Tensor | None = None  # the state's buffer it read (None: none yet)
    momentum_version: int = 0


@dataclass(eq=False, slots=True)
class _Landed:
    """The boundaries of one chunk landed so far in this backward, and their gradients."""

    boundaries: set[BoundaryGroup] = field(default_factory=set)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    messages: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class _Unit:
    """One chunk's Muon matrices of one param group, speculated."""

    group_index: int
    masters: list[nn.Parameter]  # in param-group order
    momentum: float
    nesterov: bool
    inputs: dict[int, _Input]  # id(master) ->
    scratch: dict[int, torch.Tensor]  # id(master) -> its new momentum buffer
    calls: list[tuple[Batch, torch.Tensor]]  # each Newton-Schulz call and its output
    matrices: int


class OverlappedStep:
    """The speculation of one ``dmuon.Muon``; see [Note: the overlapped step].

    ``boundary_of``: id(master) -> the boundary it lands with; ``boundaries``: every boundary
    in the model's order (the chunks are runs of it); ``speculate(group, masters, grads,
    scratch)`` computes a unit's scratch momentum (filled in ``scratch``) and Newton-Schulz
    calls; ``apply(group, call, output)`` applies one call.
    """

    def __init__(
        self,
        *,
        param_groups: list[dict],
        boundary_of: dict[int, BoundaryGroup],
        boundaries: list[BoundaryGroup],
        muon_groups: list[int],
        state: dict,
        speculate: Speculate,
        apply: Apply,
        device: torch.device,
    ) -> None:
        self._param_groups = param_groups
        self._boundary_of = boundary_of
        self._muon_groups = muon_groups
        self._state = state
        self._speculate = speculate
        self._apply_call = apply
        self._device = device
        # Keys (group index, chunk index): the units speculated, the chunks' boundaries landed so
        # far, each chunk's boundaries and its Muon masters in group order.
        self._units: dict[tuple[int, int], _Unit] = {}
        self._landed: dict[tuple[int, int], _Landed] = {}
        self._chunk_boundaries: dict[tuple[int, int], set[BoundaryGroup]] = {}
        self._unit_masters: dict[tuple[int, int], list[nn.Parameter]] = {}
        # (group index, boundary) -> its chunk index.
        self._chunk_of: dict[tuple[int, BoundaryGroup], int] = {}
        for group_index in muon_groups:
            elements: dict[BoundaryGroup, int] = {}
            for m in param_groups[group_index]["params"]:
                boundary = boundary_of.get(id(m))
                if boundary is not None and m.numel() > 0:
                    elements[boundary] = elements.get(boundary, 0) + m.numel()
            order = [b for b in boundaries if b in elements]
            for boundary, chunk in speculation_chunks(order, elements, SPECULATION_CHUNKS).items():
                self._chunk_of[(group_index, boundary)] = chunk
                self._chunk_boundaries.setdefault((group_index, chunk), set()).add(boundary)
            for m in param_groups[group_index]["params"]:
                chunk = self._chunk_of.get((group_index, boundary_of.get(id(m))))
                if chunk is not None and m.numel() > 0:
                    self._unit_masters.setdefault((group_index, chunk), []).append(m)
        self._side: torch.cuda.Stream | None = None
        # On the side stream after the latest landing's averaging: see the Note's "Streams".
        self._averaged: torch.cuda.Event | None = None
        self._side_unwaited = False  # speculation the compute stream has not waited for yet
        self.stats = OverlapStepStats()

    # ---- during backward (``hooks.GradientListener``) -------------------------------------------

    @contextlib.contextmanager
    def landing(self) -> Iterator[None]:
        if self._device.type != "cuda":
            yield
            return
        if self._side is None:
            self._side = torch.cuda.Stream(self._device, priority=SPECULATION_STREAM_PRIORITY)
        self._side.wait_stream(torch.cuda.current_stream(self._device))
        self._side_unwaited = True
        with torch.cuda.stream(self._side):
            yield

    def landed(
        self, group: BoundaryGroup, received: list[GradientMessage], averaged: AveragedGradients
    ) -> None:
        grads: dict[int, torch.Tensor] = {}
        messages: dict[int, tuple[torch.Tensor, int]] = {}
        for p, index, start in averaged.owned:
            grad = averaged.averaged[index][start : start + p.numel].view(p.local_shape)
            grads[id(p.master)] = grad
            messages[id(p.master)] = (averaged.averaged[index], grad.storage_offset())
        if self._side is not None and self._device.type == "cuda":
            for item in received:  # read here, allocated (and freed) by the compute stream
                item.message.record_stream(self._side)
            self._averaged = torch.cuda.Event()
            self._averaged.record(self._side)
        with torch.no_grad():
            for group_index in self._muon_groups:
                chunk = self._chunk_of.get((group_index, group))
                if chunk is None:
                    continue
                key = (group_index, chunk)
                self._drop(key)  # speculated in an earlier backward
                landed = self._landed.get(key)
                if landed is None or group in landed.boundaries:  # this backward's first
                    landed = self._landed[key] = _Landed()
                landed.boundaries.add(group)
                landed.grads.update(grads)
                landed.messages.update(messages)
                if landed.boundaries != self._chunk_boundaries[key]:
                    continue
                del self._landed[key]
                masters = [m for m in self._unit_masters[key] if id(m) in landed.grads]
                # A gradient already in a master (a backward without no_sync before this one)
                # is summed into at the end of backward: the plain step computes that unit.
                if masters and all(m.grad is None for m in masters):
                    with profiler_range(labels.SPECULATE):
                        self._units[key] = self._speculate_unit(
                            group_index, masters, landed.grads, landed.messages
                        )

    def _speculate_unit(self, group_index, masters, grads, messages) -> _Unit:
        hyper = self._param_groups[group_index]
        inputs = {}
        for m in masters:
            message, offset = messages[id(m)]
            buffer = self._state.get(m, {}).get(MOMENTUM_BUFFER)
            if buffer is not None and self._side is not None:
                buffer.record_stream(self._side)
            inputs[id(m)] = _Input(
                message=message,
                offset=offset,
                version=tensor_version(message),
                momentum=buffer,
                momentum_version=0 if buffer is None else tensor_version(buffer),
            )
        scratch: dict[int, torch.Tensor] = {}
        calls = self._speculate(hyper, masters, grads, scratch)
        matrices = sum(len(call) for call, _ in calls)
        self._count(speculated=matrices)
        return _Unit(
            group_index=group_index,
            masters=masters,
            momentum=hyper["momentum"],
            nesterov=hyper["nesterov"],
            inputs=inputs,
            scratch=scratch,
            calls=calls,
            matrices=matrices,
        )

    def before_masters_take_gradients(self) -> None:
        if self._averaged is not None:  # final gradients; the speculation may go on
            torch.cuda.current_stream(self._device).wait_event(self._averaged)
            self._averaged = None

    def wait_for_speculation(self) -> None:
        """Order the compute stream after everything speculated so far (before a write to
        what it reads, or a read of what it wrote)."""
        if self._side_unwaited:
            torch.cuda.current_stream(self._device).wait_stream(self._side)
            self._side_unwaited = False

    def gradients_cleared(self) -> None:
        self.discard()

    # ---- dmuon.clip_grad_norm_ ------------------------------------------------------------------

    def before_gradients_scaled(self) -> dict[int, int]:
        """Before a clip scales the gradients in place: the speculation's reads of them are
        ordered first; returns each speculated message's version now."""
        self.wait_for_speculation()
        return {
            id(i.message): tensor_version(i.message)
            for u in self._units.values()
            for i in u.inputs.values()
        }

    def gradients_scaled(self, before: dict[int, int], coefficient: torch.Tensor) -> None:
        """A clip multiplied every gradient by ``coefficient`` in place: a speculation whose
        message the clip alone changed stays valid if the coefficient is exactly 1.0."""
        for unit in self._units.values():
            for i in unit.inputs.values():
                if before.get(id(i.message)) == i.version:
                    i.version = tensor_version(i.message)
                    i.clip_coefficients.append(coefficient)

    # ---- step() ---------------------------------------------------------------------------------

    def discard(self) -> None:
        """Drop every speculation, and the chunks half landed (a step, zero_grad)."""
        for key in list(self._units):
            self._drop(key)
        self._landed.clear()

    def units_of(self, group_index: int, masters: list[nn.Parameter]) -> dict[int | None, list]:
        """``masters`` of param group ``group_index`` by the chunk whose unit holds them, each
        list in group order (None: masters outside every chunk): the batches of Newton-Schulz
        inputs this schedule runs are each unit's (``dmuon.kernel_switch.ns_inputs``)."""
        by_chunk: dict[int | None, list[nn.Parameter]] = {}
        for m in masters:
            chunk = self._chunk_of.get((group_index, self._boundary_of.get(id(m))))
            by_chunk.setdefault(chunk, []).append(m)
        return by_chunk

    def units_to_compute(self, group_index: int, masters: list[nn.Parameter]) -> list[list]:
        """Commit the speculated units of this group whose inputs are the plain step's; return
        the others, each a list of masters in group order, for the plain step to compute."""
        by_chunk = self.units_of(group_index, masters)
        group = self._param_groups[group_index]
        remaining, ones = [], {}
        for chunk, unit_masters in by_chunk.items():
            unit = self._units.pop((group_index, chunk), None) if chunk is not None else None
            if unit is not None and self._valid(unit, unit_masters, group, ones):
                with profiler_range(labels.COMMIT):
                    for m in unit.masters:
                        self._state[m][MOMENTUM_BUFFER] = unit.scratch[id(m)]
                    for call, output in unit.calls:
                        self._apply_call(group, call, output)
                self._count(committed=unit.matrices)
            else:
                if unit is not None:
                    self._count(discarded=unit.matrices)
                remaining.append(unit_masters)
        self._count(recomputed=sum(_matrix_count(m) for u in remaining for m in u))
        return remaining

    def _valid(self, unit: _Unit, masters, group: dict, ones: dict) -> bool:
        if unit.masters != masters or (unit.momentum, unit.nesterov) != (
            group["momentum"],
            group["nesterov"],
        ):
            return False
        for m in masters:
            i = unit.inputs[id(m)]
            grad = m.grad
            if (
                grad is None
                or view_base(grad) is not i.message
                or grad.storage_offset() != i.offset
                or tensor_version(i.message) != i.version
            ):
                return False
            buffer = self._state.get(m, {}).get(MOMENTUM_BUFFER)
            if buffer is not i.momentum or (
                buffer is not None and tensor_version(buffer) != i.momentum_version
            ):
                return False
            for coefficient in i.clip_coefficients:
                if id(coefficient) not in ones:  # one host read per clip
                    ones[id(coefficient)] = bool((coefficient == 1.0).item())
                if not ones[id(coefficient)]:
                    return False
        return True

    def _drop(self, key) -> None:
        unit = self._units.pop(key, None)
        if unit is not None:
            self._count(discarded=unit.matrices)

    def _count(self, **more: int) -> None:
        s = self.stats
        self.stats = OverlapStepStats(
            **{name: getattr(s, name) + more.get(name, 0) for name in s.__dataclass_fields__}
        )


def check_speculation_options(
    param_groups: Sequence[dict], params: Iterable[DedicatedParam]
) -> None:
    """Refuse what the speculation of ``overlap_step=True`` does not keep, naming it. Decided
    from facts every rank has, so every rank raises alike."""
    options = [
        f"{key}={group[key]!r}"
        for group in param_groups
        if group["route"] == MUON_ROUTE
        for key, plain in (("normuon", False), ("momentum_dtype", "float32"))
        if group[key] != plain
    ]
    if any(p.row_blocks is not None for p in params):
        options.append("dedicate_params(row_blocks=...)")
    if options:
        raise ValueError(
            "dmuon.Muon(overlap_step=True) does not combine yet with "
            f"{', '.join(sorted(set(options)))}: its speculation keeps plain fp32 momentum "
            "of whole matrices. Drop overlap_step=True, or those options."
        )


def speculation_chunks(
    boundaries: Sequence[Boundary],
    elements: Mapping[Boundary, int],
    chunks: int = SPECULATION_CHUNKS,
) -> dict[Boundary, int]:
    """boundary -> its chunk: ``boundaries`` (in order) cut into at most ``chunks`` runs of
    about equal ``elements``; a boundary goes where its first element falls. Any hashable
    stands for a boundary (``dmuon-tools simulate`` passes layer indices)."""
    total = sum(elements[b] for b in boundaries)
    chunk_of, start = {}, 0
    for boundary in boundaries:
        chunk_of[boundary] = start * chunks // total
        start += elements[boundary]
    return chunk_of


def _matrix_count(master: torch.Tensor) -> int:
    return master.shape[0] if is_expert_piece(master) else 1
