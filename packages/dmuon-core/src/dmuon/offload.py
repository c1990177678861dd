"""The owners' fp32 masters kept in CPU memory between steps (``dmuon.Muon(offload_masters=True)``).

Owns where an offloaded master's value lives and its trips to the device and back: the CPU
home (pinned under CUDA), the copies on side streams, the events that order them, and which
masters the step has already copied into their segments. It must not do optimizer math (the
step hands it one function per Newton-Schulz call), decide which masters are offloaded (the
optimizer does, see ``dmuon.optim``) nor issue collectives. It is attached through the model
state (``DedicatedState.attach_offload``), which registers it on each offloaded parameter.

[Note: offloaded masters]
Between steps an offloaded master's value is its *home*, a CPU tensor; the ``nn.Parameter``
that the optimizer's param groups and state are keyed by stays where it was, on the device,
with its shape and dtype, so gradients land on it (``.grad`` must share its device), and
``load_state_dict`` and ``init_state`` put the momentum on the device. Its ``.data`` is then a
*stand-in*: one NaN expanded to the master's shape, four bytes per device. A reader that
bypasses the home sees NaN, and a write into it raises (the expanded elements share one
location), so nothing can read or lose a value silently. Readers and writers outside the
update go through ``DedicatedParam.master_value()``, which returns the home once the copies
that write it have landed.

During ``step()`` the Muon route's Newton-Schulz calls run in order. Before call i computes,
the masters first needed by call i + 1 are copied to the device on the upload stream; call i
waits for its own upload's event, not the host. After the last call that needs a master, the
master is copied into its local segment (what forward broadcasts, as ``after_step`` would),
copied home on the download stream, and its ``.data`` becomes the stand-in again: its device
memory goes back to the caching allocator, kept from reuse until the download has read it
(``record_stream``). The device thus holds the masters of at most two calls (each at most
``NS_CALL_BYTES`` of Newton-Schulz input) and those whose download is in flight, never all of
them. The next upload of a home waits for its download (the upload stream waits for the
download stream once per step). The segment copies of the step are remembered (``_fresh``),
so the step's publish does not copy those masters from their homes again; anything that
writes a home in between (QK-clip) reaches it through ``master_value()``, which forgets that.

On a CPU device (gloo) the copies are CPU to CPU and synchronous, but every other part (which
masters, when they arrive and leave, the stand-ins, the fresh segments) runs the same, so the
CPU tests exercise the mechanism. fp32 copies are exact: the numbers are bit-identical to a
run without offload.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dmuon._text import preview_names
from dmuon.muon_state import Batch
from dmuon.routing import MUON_ROUTE

if TYPE_CHECKING:
    from dmuon.group import BoundaryGroup
    from dmuon.param import DedicatedParam


def check_masters_can_be_offloaded(params: Iterable[DedicatedParam], overlap_step: bool) -> None:
    """Refuse ``offload_masters=True`` where it cannot apply, naming what and the fix. Decided
    from facts every rank has (every dedicated parameter, owned or not), so every rank raises
    alike."""
    if overlap_step:
        raise ValueError(
            "dmuon.Muon(offload_masters=True) does not combine with overlap_step=True: the "
            "overlapped step runs Newton-Schulz during backward and applies it to the masters "
            "in step(), but offloaded masters are on the device only inside step(). Drop one "
            "of the two."
        )
    trained = [p for p in params if p.route == MUON_ROUTE and p.requires_grad]
    tensor_parallel = [p.fqn for p in trained if p.is_tp_sharded]
    if tensor_parallel:
        raise ValueError(
            "dmuon.Muon(offload_masters=True) is not supported yet for tensor-parallel matrices "
            f"({preview_names(tensor_parallel)}): their update runs on TP chunks outside the "
            "offloaded Newton-Schulz calls. Drop offload_masters=True, or leave these matrices "
            "out of the predicate of dmuon.dedicate_params."
        )
    experts = [p.fqn for p in trained if p.stack is not None]
    if experts:
        raise ValueError(
            "dmuon.Muon(offload_masters=True) is not supported yet for expert stacks "
            f"({preview_names(sorted(set(experts)))}): their checkpoints read the pieces' "
            "masters directly. Drop offload_masters=True, or leave the stacks out of the "
            "predicate of dmuon.dedicate_params."
        )
    fp32 = [p.fqn for p in trained if p.param_dtype == torch.float32]
    if fp32:
        raise ValueError(
            "dmuon.Muon(offload_masters=True): the Muon matrices "
            f"{preview_names(fp32)} compute in torch.float32, so each owner's fp32 master is "
            "the weight that forward broadcasts, not a separate copy, and there is nothing to "
            "offload. Compute them in bf16: dmuon.dedicate_params(..., param_policy="
            "{'defaults': {'param_dtype': torch.bfloat16}}) (with FSDP2's "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16) for the rest of the model), or "
            "drop offload_masters=True."
        )


@dataclass(slots=True)
class _Upload:
    """Masters on their way to the device: their device tensors and the copies' event."""

    params: list[DedicatedParam]
    tensors: list[torch.Tensor]
    done: torch.cuda.Event | None  # None on a CPU device: the copies already ran


class MasterOffload:
    """CPU homes of the fp32 masters of ``params`` on ``device``, and their trips in a step.
    Made by ``DedicatedState.attach_offload``, which registers it on each of ``params``."""

    def __init__(
        self,
        params: Sequence[tuple[DedicatedParam, BoundaryGroup]],
        device: torch.device,
    ) -> None:
        self.device = device
        cuda = device.type == "cuda"
        # Uploads and downloads on two streams, so a call's masters go home while the next
        # call's arrive (PCIe moves both ways at once).
        self._upload_stream = torch.cuda.Stream(device) if cuda else None
        self._download_stream = torch.cuda.Stream(device) if cuda else None
        self._stand_in = torch.full((1,), math.nan, dtype=torch.float32, device=device)
        self._boundary = {id(p): boundary for p, boundary in params}
        self._param_of_master = {id(p.master): p for p, _ in params}
        self._homes: dict[int, torch.Tensor] = {}  # id(p) -> its CPU home
        # id(p) -> the event of the last copy that reads or writes its home; waited for before
        # the host touches the home.
        self._last_copy: dict[int, torch.cuda.Event] = {}
        # id(p) -> (p, its device tensor): the masters the update holds, during a step.
        self._resident: dict[int, tuple[DedicatedParam, torch.Tensor]] = {}
        self._fresh: set[int] = set()  # id(p) whose segment this step's update wrote
        with torch.no_grad():
            for p, _ in params:
                home = torch.empty(p.master.shape, dtype=torch.float32, pin_memory=cuda)
                home.copy_(p.master.detach())
                self._homes[id(p)] = home
                p.master.data = self._stand_in.expand(p.master.shape)

    @property
    def params(self) -> list[DedicatedParam]:
        return list(self._param_of_master.values())

    # ---- readers and writers outside the update ---------------------------------------------

    def home_of(self, p: DedicatedParam) -> torch.Tensor:
        """``p``'s value now, to read or write: its CPU home once the copies touching it have
        landed (the device tensor while the update holds it). A write there reaches the
        segment at the next publish: the step's segment copy no longer counts."""
        self._fresh.discard(id(p))
        if id(p) in self._resident:
            return self._resident[id(p)][1]
        event = self._last_copy.pop(id(p), None)
        if event is not None:
            event.synchronize()
        return self._homes[id(p)]

    def value_for_segment(self, p: DedicatedParam) -> torch.Tensor | None:
        """What a publish copies into ``p``'s segment: its home, or None where this step's
        update already wrote the segment."""
        if id(p) in self._fresh:
            self._fresh.discard(id(p))
            return None
        return self.home_of(p)

    # ---- the step ---------------------------------------------------------------------------

    def run(self, calls: Sequence[Batch], update: Callable[[Batch], None]) -> None:
        """Run ``update(call)`` for each call with its masters on the device, one call's
        uploads ahead; see [Note: offloaded masters]."""
        arriving: list[list[DedicatedParam]] = [[] for _ in calls]
        leaving: list[list[DedicatedParam]] = [[] for _ in calls]
        last_call: dict[int, int] = {}
        for index, call in enumerate(calls):
            for master, _ in call:
                p = self._param_of_master[id(master)]
                if id(p) not in last_call:
                    arriving[index].append(p)
                last_call[id(p)] = index
        for p in self._param_of_master.values():
            if id(p) in last_call:
                leaving[last_call[id(p)]].append(p)
        if self._upload_stream is not None:  # last step's downloads wrote the homes
            self._upload_stream.wait_stream(self._download_stream)
        upload = self._upload(arriving[0]) if calls else None
        try:
            for index, call in enumerate(calls):
                current = upload
                upload = self._upload(arriving[index + 1]) if index + 1 < len(calls) else None
                self._arrive(current)
                update(call)
                for p in leaving[index]:
                    self._boundary[id(p)].refresh_master(p)
                self._download(leaving[index], fresh=True)
        finally:
            # Only after a failure: what is on the device goes home as it is, and a publish
            # copies it from there (the segment was not refreshed).
            self._download([p for p, _ in self._resident.values()], fresh=False)

    def _upload(self, params: list[DedicatedParam]) -> _Upload | None:
        if not params:
            return None
        # Allocated on the compute stream, where they are used and freed; the upload stream
        # first waits for the compute work queued so far (the block may be one it just freed),
        # which is the previous call's, not the one about to run.
        tensors = [
            torch.empty(p.master.shape, dtype=torch.float32, device=self.device) for p in params
        ]
        homes = [self._homes[id(p)] for p in params]
        if self._upload_stream is None:
            for tensor, home in zip(tensors, homes):
                tensor.copy_(home)
            return _Upload(params, tensors, None)
        self._upload_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._upload_stream):
            for tensor, home in zip(tensors, homes):
                tensor.copy_(home, non_blocking=True)
                tensor.record_stream(self._upload_stream)  # freed early only after a failure
            done = self._upload_stream.record_event()
        for p in params:
            self._last_copy[id(p)] = done
        return _Upload(params, tensors, done)

    def _arrive(self, upload: _Upload | None) -> None:
        """The compute stream waits for ``upload`` (the host does not); the masters take their
        device tensors."""
        if upload is None:
            return
        if upload.done is not None:
            torch.cuda.current_stream(self.device).wait_event(upload.done)
        for p, tensor in zip(upload.params, upload.tensors):
            self._resident[id(p)] = (p, tensor)
            p.master.data = tensor

    def _download(self, params: list[DedicatedParam], *, fresh: bool) -> None:
        """Copy ``params``' device tensors home after the compute queued so far; the masters
        take their stand-ins and the device memory returns to the allocator."""
        if not params:
            return
        tensors = [self._resident.pop(id(p))[1] for p in params]
        homes = [self._homes[id(p)] for p in params]
        if self._download_stream is None:
            for home, tensor in zip(homes, tensors):
                home.copy_(tensor)
        else:
            self._download_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._download_stream):
                for home, tensor in zip(homes, tensors):
                    home.copy_(tensor, non_blocking=True)
                    tensor.record_stream(self._download_stream)
                done = self._download_stream.record_event()
            for p in params:
                self._last_copy[id(p)] = done
        for p in params:
            p.master.data = self._stand_in.expand(p.master.shape)
            if fresh:
                self._fresh.add(id(p))
