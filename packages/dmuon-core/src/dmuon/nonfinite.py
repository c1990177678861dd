"""Non-finite gradients: the check ``dmuon.Muon(nonfinite=...)`` runs before a step.

Owns finding which gradients hold a NaN or an infinity, agreed over every rank of the step (the
ownership grids, their TP ranks and the pipeline stages: ``dmuon.step_group`` gives the groups),
so that all ranks take the same decision. It must not change gradients or weights.

The check is one fused max-abs norm per gradient dtype and device (NaN or inf exactly when the
tensor holds one; it cannot overflow) and one all-reduce of a flag; the host waits for that flag
only here, and only when the policy is not ``"ignore"`` (the default is ``"skip"``: a NaN must
never reach the weights without a word). Parameter names are exchanged only when something was
found.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from dmuon import collectives
from dmuon._torch_internals import foreach_max_abs

NONFINITE_POLICIES = ("ignore", "raise", "skip")


def check_policy(nonfinite: object) -> str:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"dmuon.Muon: nonfinite={nonfinite!r} is not one of {NONFINITE_POLICIES}: 'skip' (the "
            "default: the step is skipped on every rank, with a warning), 'raise' (RuntimeError "
            "naming the parameters) or 'ignore' (torch's behaviour: the step runs, and a NaN "
            "reaches the weights)."
        )
    return nonfinite


class PendingFlag:
    """A 0-dim device bool for the host to read later without waiting for the work queued after
    it: on CUDA copied to pinned memory behind an event at once (the step reads a clip's finite
    flag so, and does not wait for the clip's scaling or an overlapped step's speculation)."""

    def __init__(self, flag: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        self._flag = flag
        if flag.is_cuda:
            self._flag = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self._flag.copy_(flag, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(flag.device))

    def value(self) -> bool:
        if self._ready is not None:
            self._ready.synchronize()
        return bool(self._flag.item())


def nonfinite_gradients(
    named_grads: Iterable[tuple[str, torch.Tensor]],
    groups: Sequence[dist.ProcessGroup | None],
    device: torch.device,
) -> list[str]:
    """Names of the gradients holding NaN or inf on any rank (sorted; [] if none). The ranks
    agree through ``groups`` in turn (the grid, then the TP ranks), which together span them."""
    groups = [group for group in groups if group is not None]
    by_kind: dict[tuple, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, grad in named_grads:
        if grad.numel():  # an empty TP chunk holds nothing (and has no max-abs norm)
            by_kind[(grad.dtype, grad.device)].append((name, grad))
    # Per kind: the names, and which of them are finite (one fused max-abs norm).
    checked = [
        (
            [name for name, _ in members],
            torch.stack(foreach_max_abs([g for _, g in members])).isfinite(),
        )
        for members in by_kind.values()
    ]
    flag = torch.ones((), dtype=torch.int32, device=device)
    for _, finite in checked:
        flag = flag.minimum(finite.all().to(device=device, dtype=torch.int32))
    for group in groups:
        collectives.all_reduce(
            flag, group, op=dist.ReduceOp.MIN, purpose="the non-finite gradient check"
        ).wait()
    if flag.item():
        return []
    found = {
        name for names, finite in checked for name, ok in zip(names, finite.tolist()) if not ok
    }
    for group in groups:
        everyone: list[set[str] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, found, group=group)
        found = set().union(*everyone)
    return sorted(found)
