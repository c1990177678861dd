"""CuTe DSL compiles in one process: one at a time, and some of them ahead in a background thread.

Owns the lock every nvidia-cutlass-dsl compile of this package runs under (quack's kernel
variants and dmuon's CuTe kernels) and the one background thread that compiles kernels ahead of
their first use. nvidia-cutlass-dsl 4.5 keeps its compile session in process globals: two
compiles at once in two threads fail ("Please start a session before accessing session data",
benchmarks/results/parallel-compile-h200-2026-12-03-10139d4.json), so compiles take turns; a
compile ahead only moves one off the critical path, into the time the first forward and backward
take. Launching an already compiled kernel takes no turn. It knows no kernel library: the
backends pass callables.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

_one_at_a_time = threading.Lock()
_background: ThreadPoolExecutor | None = None
_pending: dict[Hashable, Future] = {}  # queued, not yet taken by ``finish``
_queued: set[Hashable] = set()  # every key ever queued in this process


@contextlib.contextmanager
def one_compile_at_a_time() -> Iterator[None]:
    """Hold the process's DSL compile turn (waiting for a compile ahead that holds it)."""
    with _one_at_a_time:
        yield


def compile_ahead(key: Hashable, compile: Callable[[], None]) -> bool:
    """Queue ``compile`` for the background thread, unless ``key`` was queued before in this
    process; returns whether it was queued. Compiles run in the order they were queued, each in
    its turn (``one_compile_at_a_time``)."""
    global _background
    if key in _queued:
        return False
    if _background is None:
        _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmuon-dsl")

    def run() -> None:
        with one_compile_at_a_time():
            compile()

    _queued.add(key)
    _pending[key] = _background.submit(run)
    return True


def pending(key: Hashable) -> bool:
    """Whether a compile ahead was queued under ``key`` and not yet taken by ``finish``."""
    return key in _pending


def finish(key: Hashable) -> BaseException | None:
    """Wait for the compile ahead pending under ``key``; its exception, or None when it
    succeeded. The key is no longer pending afterwards."""
    return _pending.pop(key).exception()
