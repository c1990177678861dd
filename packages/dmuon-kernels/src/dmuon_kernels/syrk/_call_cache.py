"""The per-call memo of ``syrk.dispatch``'s decision: operand signature -> backend function.

Owns only remembering. The first call of ``syrk``/``symmetric_product``/``matmul`` with a given
signature (operation, kernel argument, and shape, strides, dtype and device of A, B and C)
validates its operands and resolves the backend through ``syrk.dispatch``, which may autotune;
later calls with the same signature look the backend function up in one dict and run it. That
keeps the host cost of a warmed call near a bare torch.mm launch: no kernel-name validation, no
device-capability query, no autotune lookup and no shape validation again (the shapes are in the
key, so the operands were validated when the entry was made).

[Note: what the memo keys on, and what invalidates it]

- The signature above. Strides are in it because backends choose layouts from them.
- The backend registry's generation: registering or unregistering a backend forgets every entry.
- Autotune verdicts: an entry is made only after the autotuner returned its verdict for the
  problem; a call made while a CUDA graph is being captured is never remembered (the autotuner
  answers cuBLAS provisionally then, without tuning).
- Environment variables: none. Resolving a SYRK kernel reads no ``DMUON_*`` variable
  (``DMUON_NS_KERNEL`` steers Newton-Schulz, read when a NewtonSchulz is built and by each
  ``newton_schulz()`` call; ``DMUON_CACHE_DIR`` is read when a verdict file is first needed).
- A different device is a different signature.

``clear()`` forgets everything (tests, or after changing backends by other means). The memo is
bounded: past ``MAX_ENTRIES`` signatures (shapes that never repeat) it starts over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from dmuon_kernels.syrk.registry import registry_generation

# Past this many signatures the memo is dropped and refilled (a bound for workloads whose
# shapes never repeat; a model has a few dozen).
MAX_ENTRIES = 4096

Signature = tuple
BackendFunction = Callable[..., Tensor]

_entries: dict[Signature, BackendFunction] = {}
_generation = registry_generation()


def _operand(t: Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def signature(
    op: str, kernel: object, A: object, B: object = None, C: object = None
) -> Signature | None:
    """The memo key of a call, or None when an operand is not a tensor (the full path then
    raises the precise error)."""
    if not isinstance(A, Tensor):
        return None
    if (B is not None and not isinstance(B, Tensor)) or (
        C is not None and not isinstance(C, Tensor)
    ):
        return None
    return (op, kernel, A.shape, A.stride(), A.dtype, A.device, _operand(B), _operand(C))


def lookup(key: Signature | None) -> BackendFunction | None:
    """The remembered backend function for ``key``, or None."""
    global _generation
    if key is None:
        return None
    generation = registry_generation()
    if generation != _generation:
        _entries.clear()
        _generation = generation
        return None
    try:
        return _entries.get(key)
    except TypeError:  # an unhashable kernel argument: the full path says what is wrong
        return None


def remember(key: Signature | None, function: BackendFunction, A: Tensor) -> None:
    """Record ``function`` for ``key``, unless a CUDA graph capture is running (the answer may
    be provisional then)."""
    if key is None:
        return
    if A.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    with contextlib.suppress(TypeError):  # an unhashable kernel argument: not remembered
        _entries[key] = function


def clear() -> None:
    """Forget every remembered resolution."""
    _entries.clear()


def size() -> int:
    """How many signatures are remembered (for tests and reports)."""
    return len(_entries)
