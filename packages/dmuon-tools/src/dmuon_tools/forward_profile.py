"""``collect_forward_unshard_profile``: how often and how long forward waited for owners' weights.

Owns the reading of the counters dmuon records when ``DMUON_RECORD_FORWARD_PROFILE=1`` was set
before ``dedicate_params`` (``dmuon.inspect.forward_waits``): per boundary, the waits, how many were already
prefetched, the host time, and the CUDA time between the event pair recorded around each wait.
Rank-local, no collectives; reading does not reset the counters (they accumulate from
``dedicate_params`` on). It synchronises the device only when asked to.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import dmuon.inspect
from dmuon.inspect import FORWARD_PROFILE_ENV, ForwardWaitsView
from dmuon_tools._json import this_rank

PROFILE_HINT = f"set {FORWARD_PROFILE_ENV}=1 before dmuon.dedicate_params"


def collect_forward_unshard_profile(model: nn.Module, synchronize: bool = False) -> dict[str, Any]:
    """Forward-unshard wait counters and timings of this rank, per hook boundary.

    Args:
        synchronize: call ``torch.cuda.synchronize()`` first so every recorded CUDA event is
            complete and timed. Do not do this inside a timed training loop: it changes the
            overlap being measured. Without it, only events whose ``query()`` reports them
            complete are timed, and the others are counted as ``pending``.

    Returns ``{"enabled": False, "hint": ...}`` when the counters were not requested; otherwise
    ``enabled``, ``rank``, ``synchronized``, ``boundaries`` (per boundary, in the order forward
    first waited for them, then boundaries that never waited: ``name``, ``waits``,
    ``prefetched`` (waits whose broadcast a prefetch had already issued), ``host_ms`` (host time
    spent in the waits: the transfer itself on gloo, only the enqueueing on NCCL) and
    ``cuda_wait_ms`` (``events``, ``timed``, ``pending``, ``sum``, ``mean``, ``max`` over the
    completed CUDA event pairs; ``mean``/``max`` are None when none is complete)) and
    ``totals`` (the same, summed over boundaries).
    """
    waits = dmuon.inspect.forward_waits(model)
    if waits is None:
        return {"enabled": False, "hint": PROFILE_HINT}
    synchronized = bool(synchronize and torch.cuda.is_available() and torch.cuda.is_initialized())
    if synchronized:
        torch.cuda.synchronize()

    boundaries = [_boundary_entry(boundary) for boundary in waits]
    return {
        "enabled": True,
        "rank": this_rank(),
        "synchronized": synchronized,
        "boundaries": boundaries,
        "totals": _totals(boundaries),
    }


def _boundary_entry(waits: ForwardWaitsView) -> dict[str, Any]:
    # An event pair is timed only once both have completed; query() never blocks.
    timed = [
        start.elapsed_time(end) for start, end in waits.cuda_events if start.query() and end.query()
    ]
    return {
        "name": waits.boundary,
        "waits": waits.waits,
        "prefetched": waits.prefetched,
        "host_ms": waits.host_ms,
        "cuda_wait_ms": _stats(timed, num_events=len(waits.cuda_events)),
    }


def _stats(values_ms: list[float], *, num_events: int) -> dict[str, Any]:
    return {
        "events": num_events,
        "timed": len(values_ms),
        "pending": num_events - len(values_ms),
        "sum": math.fsum(values_ms),
        "mean": math.fsum(values_ms) / len(values_ms) if values_ms else None,
        "max": max(values_ms) if values_ms else None,
    }


def _totals(boundaries: list[dict[str, Any]]) -> dict[str, Any]:
    cuda = [b["cuda_wait_ms"] for b in boundaries]
    timed = sum(c["timed"] for c in cuda)
    total_ms = math.fsum(c["sum"] for c in cuda)
    maxima = [c["max"] for c in cuda if c["max"] is not None]
    return {
        "waits": sum(b["waits"] for b in boundaries),
        "prefetched": sum(b["prefetched"] for b in boundaries),
        "host_ms": math.fsum(b["host_ms"] for b in boundaries),
        "cuda_wait_ms": {
            "events": sum(c["events"] for c in cuda),
            "timed": timed,
            "pending": sum(c["pending"] for c in cuda),
            "sum": total_ms,
            "mean": total_ms / timed if timed else None,
            "max": max(maxima) if maxima else None,
        },
    }
