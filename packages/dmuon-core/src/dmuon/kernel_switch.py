"""The switch from cuBLAS to the tuned Newton-Schulz kernels, on a step every rank agrees on.

Owns the calls ``dmuon.Muon`` makes: ``background_compile_wanted`` and ``start_for_optimizer``
at construction (this rank's Newton-Schulz shapes to the process's compile job, when one is
wanted) and ``at_step_boundary`` at the start of each step (while a job is pending anywhere: one
small all-reduce, then the same decision on every rank). The jobs, the gate and what the switch does
are ``dmuon_kernels.background_compile``'s ([Note: the switch] there). It must not touch
gradients, weights or optimizer state.

Every rank calls ``at_step_boundary`` as many times as the others (once per ``Muon.step``) and
each call is either a collective on every rank or on none: whether a job is pending is decided
by the same agreed value everywhere, and whether one started by ``background_compile_wanted``,
which ``dmuon.Muon`` checks every rank and pipeline stage agree on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmuon.muon_state import batches_of, entry_shape
from dmuon.param import MUON_ROUTE
from dmuon.step_group import StepGroup
from dmuon_kernels.background_compile import (
    FAILED,
    READY,
    BackgroundCompile,
    background_compile,
    job_spec,
    wants_background_compile,
)
from dmuon_kernels.newton_schulz import NewtonSchulz

if TYPE_CHECKING:
    from dmuon.hooks import DedicatedState
    from dmuon.overlap import OverlappedStep


def ns_inputs(
    state: DedicatedState, param_groups: list[dict], overlap: OverlappedStep | None = None
) -> list[tuple[int, int, int]]:
    """The Newton-Schulz inputs (B, short, long) of a ``dmuon.Muon``'s fused step on this rank:
    per Muon-route group, the calls ``muon_state.batches_of`` makes of its matrices (those of one
    (short, long) together, in runs of at most ``NS_CALL_BYTES``: a large model's matrices of
    one shape take several calls, never one that the job could not even allocate), or with
    ``overlap`` (``overlap_step=True``) of each unit's: that schedule batches per chunk of the
    model, during backward and in the step alike. The matrices are those
    ``muon_state.matrices_of`` gives (experts and row blocks each one); TP chunks,
    orthogonalised whole on their runner one at a time, are left out, as the fused kernels'
    compiles ahead leave them."""
    tp_chunks = {id(p.master) for p in state.iter_owned_masters() if p.is_tp_sharded}
    row_blocks = {id(p.master): p.row_blocks for p in state.iter_owned_masters()}
    inputs = []
    for index, group in enumerate(param_groups):
        if group["route"] != MUON_ROUTE:
            continue
        masters = [m for m in group["params"] if m.numel() and id(m) not in tp_chunks]
        units = [masters] if overlap is None else overlap.units_of(index, masters).values()
        for unit in units:
            for batch in batches_of(unit, row_blocks):
                rows, cols = entry_shape(batch[0])
                inputs.append((len(batch), min(rows, cols), max(rows, cols)))
    return inputs


def background_compile_wanted(newton_schulz: NewtonSchulz, state: DedicatedState) -> bool:
    """Whether this rank's ``dmuon.Muon`` starts a compile job: a fact every rank must share, as
    ``at_step_boundary`` is a collective on the ranks that did. It rests on each host's
    environment and cache folder (``wants_background_compile``), so ``dmuon.Muon`` checks at
    construction that the ranks agree, rather than letting a host that differs hang the first
    step."""
    return wants_background_compile(newton_schulz, state.device)


def start_for_optimizer(
    newton_schulz: NewtonSchulz,
    state: DedicatedState,
    param_groups: list[dict],
    overlap: OverlappedStep | None = None,
    compiles: BackgroundCompile | None = None,
) -> None:
    """Submit a ``dmuon.Muon``'s Newton-Schulz inputs (``ns_inputs``) on the model's device to
    the compile job; for a ``Muon`` that ``background_compile_wanted`` (then the step boundaries
    agree until the switch, on this rank even when it owns no matrix)."""
    compiles = background_compile() if compiles is None else compiles
    inputs = ns_inputs(state, param_groups, overlap)
    compiles.submit(job_spec(newton_schulz, state.device, inputs))


def at_step_boundary(
    step_group: StepGroup, step: int, compiles: BackgroundCompile | None = None
) -> None:
    """While a compile job is pending: agree on the ranks' states (the minimum over every rank
    of the step) and switch every rank on the step they are all READY, or keep cuBLAS on every
    rank once one FAILED. Nothing (no collective) once settled or when no job started."""
    compiles = background_compile() if compiles is None else compiles
    if not compiles.active:
        return
    agreed = step_group.agreed_minimum(compiles.local_state())
    if agreed == READY:
        compiles.switch(step)
    elif agreed == FAILED:
        compiles.keep_cublas(step)
