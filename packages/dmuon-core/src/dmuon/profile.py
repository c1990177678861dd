"""Forward-unshard wait counters: how long forward waited for the owners' broadcasts.

Recorded only when ``DMUON_RECORD_FORWARD_PROFILE=1`` was set before ``dedicate_params``, so the
hot path pays nothing otherwise. Rank-local; no collectives. On CUDA the waits are timed with
CUDA events on the current stream (no host synchronisation while recording); on CPU with the
host clock. ``dmuon_tools.collect_forward_unshard_profile`` reads them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dmuon_kernels._env import env_flag

FORWARD_PROFILE_ENV = "DMUON_RECORD_FORWARD_PROFILE"
# CUDA event pairs kept per boundary: the timings cover the most recent waits, so a long run's
# memory stays bounded; the counters cover the whole run.
TIMED_WAITS_KEPT = 1000


def forward_profile_requested() -> bool:
    """True when ``DMUON_RECORD_FORWARD_PROFILE`` is 1/true/yes/on; off by default
    (``dmuon_kernels._env.env_flag``: any other value raises ValueError)."""
    return env_flag(FORWARD_PROFILE_ENV, default=False)


@dataclass(slots=True)
class BoundaryWaits:
    waits: int = 0  # forward pre-hooks that needed this boundary's weights
    prefetched: int = 0  # ... whose broadcast had already been issued (by a prefetch)
    host_ms: float = 0.0  # CPU time spent waiting (gloo) or enqueueing the wait (NCCL)
    # (start, end) CUDA events around each wait on the compute stream
    events: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = field(
        default_factory=lambda: deque(maxlen=TIMED_WAITS_KEPT)
    )


class ForwardUnshardProfile:
    def __init__(self) -> None:
        self.boundaries: dict[str, BoundaryWaits] = {}

    def record(
        self, name: str, was_prefetched: bool, device: torch.device, wait: Callable[[], None]
    ) -> None:
        entry = self.boundaries.setdefault(name, BoundaryWaits())
        entry.waits += 1
        entry.prefetched += int(was_prefetched)
        start_host = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            wait()
            end.record()
            entry.events.append((start, end))
        else:
            wait()
        entry.host_ms += (time.perf_counter() - start_host) * 1e3
