"""The Muon update of matrices: the step's one road to the fused kernels and Newton-Schulz.

Owns the math of the Muon route, as ``muon_route`` calls it: momentum and Nesterov into the
normalised Newton-Schulz input, the iteration (``NewtonSchulz.iterate_normalized``), the learning
rate's scale for an (m, n) matrix (``adjust_lr``) and the decayed, scaled update of the fp32
masters, the element-wise parts through ``dmuon_kernels.fused``. On CUDA with Triton a batch of B
(rows, cols) matrices costs a constant number of launches, whatever B: the input in two passes
(one over g and the momentum, one over the Newton-Schulz buffer), and the update none: the
iteration's last product writes it into the masters (``updated_matrices_``, [Note: the update
epilogue] in ``dmuon_kernels.update_epilogue``), or one pass where the output is needed
(NorMuon, the overlapped step: ``apply_matrices_``); the torch fallback (CPU) uses multi-tensor
``_foreach_`` ops. It must not hold optimizer state
(``muon_route`` creates the momentum buffers and passes them in) nor choose which matrices share
a Newton-Schulz call (``muon_route`` does).

The tensor-parallel path takes the same kernels one matrix at a time (``momentum_``,
``orthogonalized``, ``apply_update_``).

Batches: the element-wise passes take every matrix of one (rows, cols) in one call (the fused
kernels materialise nothing, and ``dmuon_kernels.fused``'s torch fallback bounds what it holds
itself); where a variant makes fp32 copies of whole matrices (an int8 momentum dequantised,
NorMuon's rescaled update) a batch holds at most ``MATERIALISED_BATCH_BYTES`` of them.

Two opt-in variants of the update live here too (``docs/update-rules.md``):

- NorMuon (``normuon_rows``): a per-row second moment of the Newton-Schulz output, after it;
- low-precision momentum (``MOMENTUM_DTYPES``): the buffer stored in bf16, the arithmetic in
  fp32 ([Note: low-precision momentum] in ``dmuon_kernels.fused``); or in int8 with block
  scales ([Note: 8-bit momentum]).

[Note: NorMuon]
Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable" (arXiv
2510.05491, 2025), Algorithm 1. For the (m, n) Newton-Schulz output O of a matrix, with a per-row
(per output neuron) state v of shape (m,), zero at the start:

    v = β2·v + (1 − β2)·mean_cols(O ⊙ O)          (no bias correction, as in the paper)
    Ô = O / (sqrt(v) + ε)                          (row i divided by sqrt(v_i) + ε)
    Ô = Ô · sqrt(min(m, n)) / ‖Ô‖_F

then the usual ``W = W·(1 − lr·wd) − lr·scale·Ô`` with the learning-rate rule's ``scale``. The
last line is the paper's rescale written so it composes with every ``adjust_lr``: Ô gets the
Frobenius norm of an exactly orthogonal O, so the update has the norm (and RMS) the
learning-rate rule gives an exactly orthogonal update. Plain Muon's Newton-Schulz output is only
near-orthogonal (its singular values spread around 1), so its norm is not that in general: on
the CPU tiny decoder it measured 0.90-1.03 of it, i.e. NorMuon's steps up to about 11% larger
(``docs/update-rules.md``). With ``adjust_lr="match_rms_adamw"`` this is the paper's
``η̂ = 0.2·η·sqrt(m·n) / ‖Ô‖_F`` exactly (update RMS 0.2·lr); with ``"spectral"`` or None the
update's RMS is ``lr·scale / sqrt(max(m, n))``, as for plain Muon. Since the rescale removes any
common factor of the rows, a bias correction of v would change nothing but ε's weight. The
paper's defaults: β2 = 0.95; ε guards the division (1e-8 here). Cost: one more fp32 pass over
O (read, row sums, divide, norm, scale: about 6·m·n FLOPs, nothing next to Newton-Schulz) and
m fp32 numbers of state per matrix.

[Note: 8-bit momentum]
``momentum_dtype="int8"`` stores the momentum of an (m, n) matrix as int8 q (m, n) and fp32
scales s (m, ceil(n / INT8_BLOCK)): each run of ``INT8_BLOCK`` consecutive elements of a row
shares the scale s = max |x| of the run, and x ≈ q · s / 127 with q = round(127 · x / s) (round to
nearest; an all-zero run stores s = 0). Blocks follow rows, so a row block or an expert of the
buffer is a slice of both tensors. Each step dequantises a batch to fp32, runs the same fp32
momentum arithmetic as any dtype, and quantises the new buffer back: 1 + 4 / INT8_BLOCK bytes
per element instead of 4. The state has other names than a float buffer's
(``momentum_int8``, ``momentum_scale``), so a checkpoint never loads one into the other: a
change between int8 and a float dtype across a checkpoint restarts the momentum, with
``dmuon.checkpoint``'s warning. Not fused: the torch ops run per matrix (a few launches each).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dmuon_kernels.fused import (
    DEFAULT_NS_EPS,
    compile_step_kernels_ahead,
    muon_apply_updates_,
    muon_momentum_,
    muon_normalize,
    muon_normalized_inputs_,
)
from dmuon_kernels.update_epilogue import update_gemm_launches

if TYPE_CHECKING:
    from dmuon_kernels.newton_schulz import NewtonSchulz

MATERIALISED_BATCH_BYTES = 256 * 2**20
"""fp32 copies of whole matrices a batch holds at once where a variant makes them (int8
momentum, NorMuon); the plain update makes none and takes a shape's matrices in one batch."""
MUON_RMS_MATCH = 0.2
"""``adjust_lr="match_rms_adamw"`` scales the update by this times sqrt(max(m, n)), so its RMS
matches AdamW's."""
MOMENTUM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
"""The dtypes a Muon momentum buffer may be stored in, by name (the arithmetic is fp32)."""
INT8_BLOCK = 256
"""Elements of a row sharing one scale of an int8 momentum ([Note: 8-bit momentum])."""
_INT8_LEVELS = 127
NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-8


def lr_scale(adjust_lr: str | None, rows: int, cols: int) -> float:
    """The factor on ``lr`` for an (rows, cols) matrix (``dmuon.Muon``'s ``adjust_lr``)."""
    if adjust_lr == "match_rms_adamw":  # the update's RMS matches AdamW's
        return MUON_RMS_MATCH * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":  # the update's spectral norm scales with sqrt(fan-out / fan-in)
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def matrix_shape_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(m, n) of a weight's shape: trailing dims flattened into n."""
    return shape[0], math.prod(shape[1:])


def oriented(matrix: Tensor, transposed: bool) -> Tensor:
    """Newton-Schulz works on rows <= cols; a tall weight sees its slice transposed."""
    return matrix.mT if transposed else matrix


def orthogonalized_matrices(
    newton_schulz: NewtonSchulz,
    grads: list[Tensor],
    momenta: list[Tensor],
    first_steps: list[bool],
    *,
    momentum: float,
    nesterov: bool,
    scales: list[Tensor] | None = None,
    graph_max_numel: int | None = None,
    new_momenta: list[Tensor] | None = None,
) -> Tensor:
    """B matrices of one Newton-Schulz shape (an (m, n) and an (n, m) matrix share one), with
    equal (rows, cols) adjacent: ``normalized_batch``, then one batched Newton-Schulz; returns
    its output (B, short, long). ``graph_max_numel``: see ``NewtonSchulz.iterate_normalized``.
    The overlapped step runs it during backward with ``new_momenta`` (fp32 or bf16 buffers like
    ``momenta``, which are then only read), so the optimizer state stays as it is
    (``dmuon.overlap``)."""
    inputs = normalized_batch(
        newton_schulz, grads, momenta, first_steps, momentum=momentum, nesterov=nesterov,
        scales=scales, new_momenta=new_momenta,
    )  # fmt: skip
    return newton_schulz.iterate_normalized(inputs, graph_max_numel=graph_max_numel)


def updated_matrices_(
    newton_schulz: NewtonSchulz,
    masters: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    first_steps: list[bool],
    *,
    momentum: float,
    nesterov: bool,
    lr: float,
    weight_decay: float,
    adjust_lr: str | None,
    scales: list[Tensor] | None = None,
    copies: list[Tensor | None] | None = None,
) -> None:
    """The whole Muon step of B matrices of one Newton-Schulz shape: ``normalized_batch``, then
    Newton-Schulz whose last product writes the decayed, scaled update into each fp32 master
    (rows, cols), in place (``NewtonSchulz.update_masters_``: on CUDA the output is never
    stored, [Note: the update epilogue] in ``dmuon_kernels.update_epilogue``). ``copies[i]``
    (None, or a (rows, cols) tensor in a narrower dtype) receives the new master rounded, from
    the same product where the kernel allows."""
    inputs = normalized_batch(
        newton_schulz, grads, momenta, first_steps, momentum=momentum, nesterov=nesterov,
        scales=scales,
    )  # fmt: skip
    newton_schulz.update_masters_(
        inputs,
        masters,
        lr=lr,
        weight_decay=weight_decay,
        scales=[lr_scale(adjust_lr, *master.shape) for master in masters],
        copies=copies,
    )


def normalized_batch(
    newton_schulz: NewtonSchulz,
    grads: list[Tensor],
    momenta: list[Tensor],
    first_steps: list[bool],
    *,
    momentum: float,
    nesterov: bool,
    scales: list[Tensor] | None = None,
    new_momenta: list[Tensor] | None = None,
) -> Tensor:
    """Momentum and Nesterov into ``momenta`` (or from them into ``new_momenta``) and the
    normalised Newton-Schulz input of B matrices, written into ``newton_schulz``'s buffer for
    it, which is returned (B, short, long). ``grads`` and ``momenta`` are fp32 (rows, cols)
    matrices (``momenta`` fp32 or bf16, or int8 with their ``scales``); ``first_steps[i]``: the
    momentum buffer is new (``buf = g``)."""
    if new_momenta is not None and scales is not None:
        raise ValueError("normalized_batch: new_momenta does not take int8 momenta")
    rows, cols = grads[0].shape
    inputs = newton_schulz.normalized_buffer(
        (len(grads), min(rows, cols), max(rows, cols)), grads[0].device
    )
    materialised = None if scales is None else MATERIALISED_BATCH_BYTES  # dequantised momenta
    for start, stop in _batches(grads, materialised):
        normalized_inputs_(
            grads[start:stop],
            momenta[start:stop],
            first_steps[start:stop],
            momentum,
            nesterov,
            out=inputs[start:stop],
            scales=None if scales is None else scales[start:stop],
            new_momenta=None if new_momenta is None else new_momenta[start:stop],
        )
    return inputs


def apply_matrices_(
    masters: list[Tensor],
    orthogonal: Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr: str | None,
    normuon: tuple[list[Tensor], float, float] | None = None,
) -> None:
    """Decay and the scaled update of each fp32 master (rows, cols), in place, from its
    Newton-Schulz output (``orthogonal[i]``, (short, long)); at commit for the overlapped step.
    ``normuon``: (each matrix's row second moment, beta2, eps) for NorMuon's rows first."""
    materialised = None if normuon is None else MATERIALISED_BATCH_BYTES  # NorMuon's updates
    for start, stop in _batches(masters, materialised):
        rows, cols = masters[start].shape
        updates = [oriented(ortho, rows > cols) for ortho in orthogonal[start:stop]]
        if normuon is not None:
            moments, beta2, eps = normuon
            updates = normuon_rows(updates, moments[start:stop], beta2, eps)
        apply_updates_(
            masters[start:stop],
            updates,
            lr,
            weight_decay,
            lr_scale(adjust_lr, rows, cols),
        )


def compile_kernels_ahead(
    newton_schulz: NewtonSchulz,
    device: torch.device,
    shapes: set[tuple[int, int]],
    *,
    nesterov: bool,
    momentum_dtype: torch.dtype,
    normuon: bool,
    copies: dict[torch.dtype, set[tuple[int, int]]] | None = None,
) -> int:
    """Start compiling the fused kernels the step will launch for fp32 matrices of ``shapes``
    on ``device`` (the first step then waits for them instead of compiling each in turn);
    returns how many were started (0 without Triton on CUDA). The gradients are views of their
    messages, each 16-byte aligned ([Note: aligned gradients in a message] in ``dmuon.group``).
    ``copies``: the shapes whose update also writes a copy, by the copy's dtype (the update GEMM
    that writes both, where it is chosen: ``dmuon_kernels.update_epilogue``)."""
    ns_dtype = newton_schulz.iteration_dtype(device)
    more_launches = [
        launch
        for dtype, copied in (copies or {}).items()
        for launch in update_gemm_launches(sorted(copied), ns_dtype, dtype)
    ]
    return compile_step_kernels_ahead(
        device,
        sorted(shapes),
        # an int8 momentum reaches the kernels dequantised ([Note: 8-bit momentum])
        momentum_dtype=torch.float32 if momentum_dtype == torch.int8 else momentum_dtype,
        nesterov=nesterov,
        ns_dtype=ns_dtype,
        normuon=normuon,
        aligned_gradients=True,
        more_launches=more_launches,
    )


def _batches(masters: list[Tensor], max_bytes: int | None) -> Iterator[tuple[int, int]]:
    """[start, stop) runs of matrices of one (rows, cols); with ``max_bytes``, each run holds
    at most that many bytes of fp32 copies of its matrices (one matrix at least)."""
    start = 0
    while start < len(masters):
        shape = masters[start].shape
        per_batch = len(masters)
        if max_bytes is not None:
            per_batch = max(1, max_bytes // (4 * max(1, shape.numel())))
        stop = start + 1
        while stop < len(masters) and stop - start < per_batch and masters[stop].shape == shape:
            stop += 1
        yield start, stop
        start = stop


def normalized_inputs_(
    grads: list[Tensor],
    momenta: list[Tensor],
    first_steps: list[bool],
    momentum: float,
    nesterov: bool,
    out: Tensor,
    eps: float = DEFAULT_NS_EPS,
    scales: list[Tensor] | None = None,
    new_momenta: list[Tensor] | None = None,
) -> None:
    """Momentum (``buf = momentum·buf + g``, or ``buf = g`` on a first step) then the Muon
    input ``u = g + momentum·buf`` (Nesterov) or ``u = buf``, each divided by its Frobenius norm
    (+ ``eps``) and written into ``out``: (B, rows, cols), or its ``.mT`` for tall matrices, in
    the Newton-Schulz dtype. ``grads`` are B fp32 (rows, cols) matrices, ``momenta`` their fp32
    or bf16 buffers, or int8 ones with their ``scales`` ([Note: 8-bit momentum]); with
    ``new_momenta`` (not for int8) the new buffers go there and ``momenta`` are only read."""
    if scales is None:
        muon_normalized_inputs_(
            grads, momenta, first_steps, momentum, nesterov, out, eps, new_momenta=new_momenta
        )
        return
    wide = [dequantized(q, scale) for q, scale in zip(momenta, scales, strict=True)]
    muon_normalized_inputs_(grads, wide, first_steps, momentum, nesterov, out, eps)
    for q, scale, value in zip(momenta, scales, wide):
        quantize_(q, scale, value)


# ---- int8 momentum: see [Note: 8-bit momentum]


def int8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape of an int8 momentum of ``shape`` (..., n): (..., ceil(n / block))."""
    return (*shape[:-1], -(-shape[-1] // INT8_BLOCK))


def _blocks(x: Tensor, blocks: int) -> Tensor:
    """(..., n) -> (..., blocks, INT8_BLOCK), the last run zero-padded."""
    padding = blocks * INT8_BLOCK - x.shape[-1]
    return torch.nn.functional.pad(x, (0, padding)).unflatten(-1, (blocks, INT8_BLOCK))


def dequantized(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 values of an int8 momentum q (..., n) with its scales (..., blocks)."""
    values = _blocks(q.to(torch.float32), scale.shape[-1]) * (scale / _INT8_LEVELS).unsqueeze(-1)
    return values.flatten(-2)[..., : q.shape[-1]]


def quantize_(q: Tensor, scale: Tensor, values: Tensor) -> None:
    """Store fp32 ``values`` (..., n) into the int8 q and its scales, in place (views allowed)."""
    runs = _blocks(values.to(torch.float32), scale.shape[-1])
    peak = runs.abs().amax(dim=-1)  # (..., blocks)
    scale.copy_(peak)
    step = (peak / _INT8_LEVELS).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    q.copy_(runs.div(step).round_().flatten(-2)[..., : q.shape[-1]])


def apply_updates_(
    masters: list[Tensor], orthogonal: list[Tensor], lr: float, weight_decay: float, scale: float
) -> None:
    """``master = master·(1 − lr·weight_decay) − lr·scale·ortho`` for every pair (fp32 masters,
    Newton-Schulz outputs in any float dtype and strides)."""
    muon_apply_updates_(masters, orthogonal, lr, weight_decay, scale)


# ---- one matrix at a time: the tensor-parallel path (momentum per chunk, the gathered matrix
# normalised and orthogonalised on its runner, the update per chunk; see ``dmuon.tp``)


def momentum_(
    grad: Tensor, buf: Tensor, first_step: bool, momentum: float, nesterov: bool
) -> Tensor:
    """Momentum of one chunk in place; returns its Muon input ``u`` (unnormalised)."""
    update, _ = muon_momentum_(grad, buf, momentum, nesterov=nesterov, first_step=first_step)
    return update


def orthogonalized(
    newton_schulz: NewtonSchulz, updates: dict[int, tuple[Tensor, tuple[int, ...]]]
) -> dict[int, Tensor]:
    """Newton-Schulz of whole (unnormalised) Muon inputs ``{i: (u, its parameter's shape)}``,
    batched by shape; each result in its parameter's shape and the Newton-Schulz dtype."""
    by_ns_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (_, shape) in updates.items():
        rows, cols = matrix_shape_of(shape)
        by_ns_shape[(min(rows, cols), max(rows, cols))].append(i)
    results = {}
    for (short, long), indices in by_ns_shape.items():
        first = updates[indices[0]][0]
        inputs = newton_schulz.normalized_buffer((len(indices), short, long), first.device)
        for i, ns_input in zip(indices, inputs):
            update, shape = updates[i]
            rows, cols = matrix_shape_of(shape)
            normalized_input_(update.reshape(rows, cols), out=oriented(ns_input, rows > cols))
        orthogonal = newton_schulz.iterate_normalized(inputs)
        for i, ortho in zip(indices, orthogonal):
            rows, cols = matrix_shape_of(updates[i][1])
            results[i] = oriented(ortho, rows > cols).reshape(updates[i][1])
    return results


def normalized_input_(update: Tensor, out: Tensor, eps: float = DEFAULT_NS_EPS) -> None:
    """``u / (‖u‖_F + eps)`` of one whole matrix into ``out`` (its shape, any strides, the
    Newton-Schulz dtype); overflow-safe for any finite ``u``."""
    muon_normalize(update, None, out.dtype, eps, out)


def apply_update_(
    master: Tensor,
    orthogonal: Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr: str | None,
    matrix_shape: tuple[int, ...],
) -> None:
    """``master = master·(1 − lr·weight_decay) − lr·scale·ortho`` for one chunk of a matrix of
    ``matrix_shape`` (the whole parameter's shape, which decides the scale)."""
    scale = lr_scale(adjust_lr, *matrix_shape_of(matrix_shape))
    muon_apply_updates_([master], [orthogonal], lr, weight_decay, scale)


# ---- NorMuon: see [Note: NorMuon]


def normuon_rows(
    orthogonal: list[Tensor], second_moments: list[Tensor], beta2: float, eps: float
) -> list[Tensor]:
    """NorMuon's row normalisation of B Newton-Schulz outputs of one (rows, cols) shape (any
    dtype, any strides): each row's second moment updated in place in ``second_moments`` (B fp32
    (rows,) vectors), returns the B fp32 (rows, cols) updates Ô of [Note: NorMuon]."""
    update = torch.stack([o.to(torch.float32) for o in orthogonal])  # (B, rows, cols)
    rows, cols = update.shape[-2:]
    moments = torch.stack(second_moments)  # (B, rows)
    moments.mul_(beta2).add_(update.square().mean(dim=-1), alpha=1.0 - beta2)
    for moment, new in zip(second_moments, moments.unbind(0), strict=True):
        moment.copy_(new)
    update.div_(moments.sqrt_().add_(eps).unsqueeze(-1))
    # A zero gradient gives a zero Ô: the clamp keeps it zero instead of 0/0.
    norms = torch.linalg.matrix_norm(update).clamp_min_(torch.finfo(torch.float32).tiny)
    update.mul_((math.sqrt(min(rows, cols)) / norms).view(-1, 1, 1))
    return list(update.unbind(0))
