"""The rank-tagged logger (``[DMuon][rank=R/W] <message>`` on the ``dmuon_kernels`` logger) and
the record of first-use phases.

Owns the tag, making the lines visible without any logging set-up, and ``timed_phase``: the
first use of a shape or a library does slow work once per process (a library import, an autotune
candidate, a kernel compile or load, a CUDA-graph capture); each such piece is timed and kept in
a bounded in-memory record (``recorded_phases()``), so that a benchmark or a user can account for
every second of a first training step. Callers print their own progress lines with the measured
duration. A leaf: rank and world size come from the RANK / WORLD_SIZE environment variables (set
by torchrun and the test harness), so it imports neither torch.distributed nor anything from this
package.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger("dmuon_kernels")

# The kinds of first-use work ``timed_phase`` records.
IMPORT = "import"  # importing an optional kernel library (quack, nvidia-cutlass-dsl)
AUTOTUNE = "autotune"  # one autotune candidate: cross-check and timing (its compile inside)
COMPILE = "compile"  # a kernel built in this process (or, for quack, made ready: see quack.py)
LOAD = "load"  # a compiled kernel loaded from dmuon's disk cache
WAIT = "wait"  # waiting for another process (rank) to finish compiling a kernel
CAPTURE = "capture"  # a CUDA-graph capture, with its eager reference run and check
PHASE_KINDS = (IMPORT, AUTOTUNE, COMPILE, LOAD, WAIT, CAPTURE)
# The record keeps the latest phases only (a long job with shapes that never repeat).
MAX_RECORDED_PHASES = 10_000


class _CurrentStderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at emit time (it may be redirected after import)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)  # logging's rule: a failing handler never raises


def rank_tag() -> str:
    """``[DMuon][rank=R/W] `` from the RANK / WORLD_SIZE environment variables (default 0/1)."""
    rank = os.environ.get("RANK", "0")
    world_size = os.environ.get("WORLD_SIZE", "1")
    return f"[DMuon][rank={rank}/{world_size}] "


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (RANK unset counts as 0): the one that prints progress
    lines meant once per job."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _make_visible_by_default() -> None:
    # Progress lines must show up without any logging set-up, but an application that configured
    # logging (a handler on the root logger) gets them through its own handlers instead.
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        logger.addHandler(_CurrentStderrHandler())


def log_rank_tagged(message: str, *, level: int = logging.INFO) -> None:
    """Log ``message`` prefixed with ``[DMuon][rank=R/W] `` on the ``dmuon_kernels`` logger."""
    _make_visible_by_default()
    logger.log(level, "%s%s", rank_tag(), message)


@dataclass(slots=True)
class Phase:
    """One timed piece of first-use work: its kind (``PHASE_KINDS``), what it worked on, when it
    started (``time.perf_counter()`` of this process), its host seconds, and how many other
    phases of this thread enclosed it (0: none; a compile inside an autotune candidate is 1)."""

    kind: str
    what: str
    start: float
    seconds: float = 0.0
    depth: int = 0


_phases: collections.deque[Phase] = collections.deque(maxlen=MAX_RECORDED_PHASES)
_nesting = threading.local()


@contextlib.contextmanager
def timed_phase(kind: str, what: str) -> Iterator[Phase]:
    """Time the block as one ``kind`` phase about ``what`` and record it when the block ends
    (raising or not). The yielded ``Phase`` gets its ``seconds`` at the end, for the caller's
    progress line; the caller may change its ``kind`` inside the block (a lookup that turned out
    to be a load)."""
    depth = getattr(_nesting, "depth", 0)
    phase = Phase(kind, what, time.perf_counter(), depth=depth)
    _nesting.depth = depth + 1
    try:
        yield phase
    finally:
        _nesting.depth = depth
        phase.seconds = time.perf_counter() - phase.start
        _phases.append(phase)


def record_phase(kind: str, what: str, start: float) -> Phase:
    """Record a ``kind`` phase about ``what`` that began at ``start`` (``time.perf_counter()``)
    and ends now, at the current nesting depth; for work that no block encloses (a wait that
    began in a callback)."""
    phase = Phase(kind, what, start, time.perf_counter() - start, getattr(_nesting, "depth", 0))
    _phases.append(phase)
    return phase


def recorded_phases() -> list[Phase]:
    """The phases recorded so far in this process, oldest first by start."""
    return sorted(_phases, key=lambda phase: phase.start)


def clear_recorded_phases() -> None:
    """Forget the recorded phases (a benchmark does this before the step it accounts for)."""
    _phases.clear()
