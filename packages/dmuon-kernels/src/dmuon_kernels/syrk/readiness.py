"""Whether "auto" may confirm its fast kernels per shape in this process yet.

Owns one process-wide gate. While a background compile job builds the kernels a
``dmuon.Muon`` will need (``dmuon_kernels.background_compile``), the gate is closed: the
dispatcher answers cuBLAS for every "auto" product instead of asking the autotuner, so no kernel
is compiled or tuned inside a training step. Opening it (the switch, on a step every rank agreed
on) advances the registry generation, which forgets every remembered per-call choice and makes
each ``NewtonSchulz`` drop its CUDA graphs: the next call of each shape tunes (loading the
compiled kernels from disk) and captures again.

It decides nothing about which kernel wins; a kernel named explicitly (not "auto") is never
gated. A leaf over ``syrk.registry``: it must not import torch, the autotuner or anything from
dmuon.
"""

from __future__ import annotations

from dmuon_kernels.syrk.registry import advance_registry_generation

_deferred_because: str | None = None


def defer_tuning(reason: str) -> None:
    """Close the gate: "auto" runs cuBLAS for every product until ``resume_tuning``."""
    global _deferred_because
    _deferred_because = reason


def tuning_deferred() -> bool:
    """True while "auto" must run cuBLAS without tuning (a background compile is pending)."""
    return _deferred_because is not None


def deferred_because() -> str | None:
    """Why the gate is closed, for reports; None when it is open."""
    return _deferred_because


def resume_tuning() -> None:
    """Open the gate and make every cached choice stale, so each shape is tuned on its next
    call (a no-op when it is open)."""
    global _deferred_because
    if _deferred_because is None:
        return
    _deferred_because = None
    advance_registry_generation()
