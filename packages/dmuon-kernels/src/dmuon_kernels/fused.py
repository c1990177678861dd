"""The element-wise parts of a Muon step, fused into as few passes over memory as the math allows.

Owns momentum + Nesterov, the division by the Frobenius norm + cast to the Newton-Schulz dtype,
and decoupled weight decay + the scaled update; Newton-Schulz's own input stage
(``normalize_frobenius``) too. On CUDA with Triton each pass is one Triton launch for a whole
list of same-shape matrices; elsewhere (CPU, no Triton, layouts the kernels do not take) a
plain-torch fallback computes the same values up to rounding (``DMUON_FUSED_TRITON=0`` sends CUDA
tensors there too, e.g. to rule the kernels out). It must not run Newton-Schulz,
know about parameters or optimizers, or synchronise with the host.

The math (SPEC "The optimizer math"), with μ the momentum and g the gradient of a matrix:
first step ``buf = g``, then ``buf = μ·buf + g``; the update is ``u = g + μ·buf`` with Nesterov,
else ``u = buf``; Newton-Schulz's input is ``u / (‖u‖_F + eps)`` in its dtype; after it,
``W = W·(1 − lr·wd) − lr·scale·O`` into the fp32 master.

The step, a batch of B same-shape matrices at a time:

- ``muon_normalized_inputs_``: two passes. The first reads g and buf once, writes buf and u into
  the Newton-Schulz input buffer, each 64x64 tile divided by a power of two near its largest
  value (so it fits fp16 whatever the gradient's scale), and sums u² per tile; the second
  rescales that buffer in place to ``u / (‖u‖ + eps)`` (2 bytes read and written per element
  instead of reading g and buf again). In fp16 or bf16 the tile's value is rounded twice (at
  most one unit in the last place instead of half); the torch fallback rounds once.
- ``muon_apply_updates_``: one pass, the decay and the scaled update together.

``compile_step_kernels_ahead`` starts compiling, in background threads, the Triton kernels those
two will launch for given matrix shapes, so that a first step does not compile them one by one.

Single matrices (the tensor-parallel path normalises a matrix gathered from momentum chunks):
``muon_momentum_`` (one pass: buf, u and Σu²), ``muon_normalize`` (one pass, given Σu²),
``muon_apply_update_``.

[Note: low-precision momentum]
A momentum buffer may be stored in bf16 (half the memory of fp32). Every pass reads it up to
fp32, does the arithmetic in fp32 and rounds the new buffer once on store (round to nearest);
the Nesterov update ``u = g + μ·buf`` uses the unrounded fp32 ``buf``. The Triton kernels and the
torch fallback do the same, so they agree up to fp32 rounding before the store.

[Note: overflow-safe normalisation]
A finite gradient can have a Frobenius norm whose square overflows fp32 (‖u‖ > ~1.8e19): an
fp32 sum of squares is then inf and u / (inf + eps) is zero, so Newton-Schulz would return zeros.
Every norm here is accumulated in float64 (squares of any finite fp32 value and sums of 2^40 of
them are finite), and the quotient is taken as ``(u·2^-k) / ((‖u‖ + eps)·2^-k)`` in fp32 with
2^(k-1) <= ‖u‖ < 2^k: scaling by a power of two is exact, so this is the IEEE quotient
``u / fp32(‖u‖ + eps)`` bit for bit wherever that one does not overflow, and it never overflows
(k is clamped to [-126, 126], so 2^-k is a normal fp32). The fused first pass uses the same idea
per tile. No extra pass over memory: the sums ride on the pass that reads u anyway.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from dmuon_kernels._env import FUSED_TRITON_ENV, env_flag

DEFAULT_NS_EPS = 1e-7
# A CUDA grid's second dimension, which the kernels give to the matrices of a batch.
MAX_KERNEL_BATCH = 65535
FALLBACK_BATCH_BYTES = 256 * 2**20
"""fp32 Muon inputs the torch fallback of ``muon_normalized_inputs_`` materialises at once; a
longer list goes through it in runs of this size (the Triton kernels materialise nothing)."""
_EXPONENT_BOUND = 126  # 2^±126 are normal fp32 numbers

_triton_module: object | None = None
_triton_checked = False


def triton_available() -> bool:
    """Whether Triton is importable (its kernels then run on CUDA tensors)."""
    global _triton_checked
    if not _triton_checked:
        _triton_checked = True
        if importlib.util.find_spec("triton") is not None:
            global _triton_module
            try:
                from dmuon_kernels import _fused_triton

                _triton_module = _fused_triton
            except Exception:  # a broken Triton install leaves the torch fallback in charge
                _triton_module = None
    return _triton_module is not None


def _kernels(*tensors: Tensor | None):  # -> the Triton module, or None for the torch fallback
    if not all(t is None or t.is_cuda for t in tensors):
        return None
    return _enabled_kernels()


def _enabled_kernels():  # -> the Triton module for CUDA tensors, or None
    if not env_flag(FUSED_TRITON_ENV, default=True):  # read per call, like the other switches
        return None
    return _triton_module if triton_available() else None


# ---- validation and layouts ---------------------------------------------------------------------


def _as_matrix(t: Tensor) -> Tensor:
    """A 2-D view (rows, cols) of ``t``: leading dim kept, trailing dims flattened (as Muon does)."""
    if t.dim() == 2:
        return t
    if t.dim() < 2:
        return t.reshape(1, -1)
    return t.reshape(t.shape[0], -1)


def _check_same_shape(label: str, a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{label}: shapes must match, got {tuple(a.shape)} and {tuple(b.shape)}; pass the "
            "momentum buffer / update of the same parameter"
        )


def _rows_contiguous(tensors: Sequence[Tensor], shape: tuple[int, ...]) -> bool:
    """Every tensor is a (rows, cols) matrix of the first one's dtype with contiguous rows."""
    dtype = tensors[0].dtype
    return all(
        t.shape == shape
        and t.dtype == dtype
        and t.stride(-1) == 1
        and (shape[0] == 1 or t.stride(0) == shape[1])
        for t in tensors
    )


# ---- the torch side of [Note: overflow-safe normalisation] --------------------------------------


def _square_sums(X: Tensor) -> Tensor:
    """Σx² of each matrix of X (..., rows, cols), accumulated in float64: (..., 1, 1)."""
    return X.to(torch.float64).square().sum(dim=(-2, -1), keepdim=True)


def _power_of_two(exponent: Tensor) -> Tensor:
    """2**exponent as float64, exactly (an integer tensor in [-1022, 1023])."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _divided_by_norm(X: Tensor, square_sum: Tensor, eps: float) -> Tensor:
    """X / (sqrt(square_sum) + eps) in fp32 per matrix (square_sum float64, broadcastable)."""
    norm = square_sum.to(torch.float64).sqrt()
    exponent = torch.frexp(norm).exponent.clamp_(-_EXPONENT_BOUND, _EXPONENT_BOUND)
    scale = _power_of_two(-exponent)
    denominator = ((norm + eps) * scale).to(torch.float32)
    return (X.to(torch.float32) * scale.to(torch.float32)).div_(denominator)


# ---- Newton-Schulz's input stage ----------------------------------------------------------------


def normalize_frobenius(
    X: Tensor,  # (n, m) or (B, n, m), any strides, any float dtype
    *,
    eps: float,
    dtype: torch.dtype,
    out: Tensor | None = None,  # X's shape, ``dtype``, any strides
) -> Tensor:  # ``out``, else a new contiguous tensor
    """``X / (‖X‖_F + eps)`` per matrix, cast to ``dtype``: two passes (the norm, the quotient),
    overflow-safe for every finite X ([Note: overflow-safe normalisation])."""
    kernels = _kernels(X)
    if kernels is None or X.dim() not in (2, 3) or X.numel() == 0:
        result = _divided_by_norm(X, _square_sums(X), eps).to(dtype)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(X.shape, dtype=dtype, device=X.device)
    X3, out3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (X, out))
    if X3.shape[0] > MAX_KERNEL_BATCH:
        return out.copy_(_divided_by_norm(X, _square_sums(X), eps))
    kernels.normalize(X3, out3, kernels.square_sums(X3), eps)
    return out


# ---- the step: batches of same-shape matrices ---------------------------------------------------


def muon_normalized_inputs_(
    grads: Sequence[Tensor],  # B (rows, cols) gradients, any float dtype
    momenta: Sequence[Tensor],  # B (rows, cols) momentum buffers (fp32 or bf16); updated in place
    first_steps: Sequence[bool],
    momentum: float,
    nesterov: bool,
    out: Tensor,  # (B, rows, cols), or (B, cols, rows) for the transposed matrices
    eps: float = DEFAULT_NS_EPS,
    new_momenta: Sequence[Tensor] | None = None,  # B buffers like ``momenta``; default: them
) -> None:
    """Momentum, then each matrix's Muon input ``u`` divided by its Frobenius norm (+ ``eps``)
    and cast to ``out``'s dtype, into ``out``: ``buf = momentum·buf + g`` (``buf = g`` where
    ``first_steps`` says so), ``u = g + momentum·buf`` with ``nesterov``, else ``u = buf``.
    The new ``buf`` goes to ``new_momenta`` when given (``momenta`` are then only read: the
    overlapped step's speculation keeps the optimizer state as it is), else into ``momenta``.

    ``out`` holds the matrices as they are, or transposed (Newton-Schulz takes rows <= cols);
    any strides. Two passes on CUDA (see the module docstring); no host synchronisation.
    """
    batch = len(grads)
    if not batch or len(momenta) != batch or len(first_steps) != batch or out.shape[0] != batch:
        raise ValueError(
            "muon_normalized_inputs_ takes B >= 1 gradients, momentum buffers and first-step "
            f"flags and an output of B matrices; got {len(grads)}, {len(momenta)}, "
            f"{len(first_steps)} and an output of shape {tuple(out.shape)}"
        )
    if new_momenta is not None and (
        len(new_momenta) != batch
        or any(n.shape != m.shape or n.dtype != m.dtype for n, m in zip(new_momenta, momenta))
    ):
        raise ValueError(
            "muon_normalized_inputs_: new_momenta must be one buffer per momentum buffer, of its "
            "shape and dtype"
        )
    shape = tuple(grads[0].shape)
    if len(shape) != 2 or out.shape[-2:] not in (shape, shape[::-1]):
        raise ValueError(
            f"muon_normalized_inputs_: the output must be (B, rows, cols) or (B, cols, rows) for "
            f"gradients of shape {shape}; got {tuple(out.shape)}"
        )
    oriented = out if out.shape[-2:] == shape else out.mT  # (B, rows, cols)
    kernels = _kernels(grads[0], momenta[0], out)
    if (
        kernels is not None
        and batch <= MAX_KERNEL_BATCH
        and grads[0].numel() > 0
        and _rows_contiguous(grads, shape)
        and _rows_contiguous(momenta, shape)
        and (new_momenta is None or _rows_contiguous(new_momenta, shape))
    ):
        summed = kernels.momentum_pass(
            grads, momenta, first_steps, float(momentum), nesterov, oriented, scaled=True,
            new_buffers=new_momenta,
        )  # fmt: skip
        if summed is not None:
            square_sums, exponents = summed
            kernels.normalize(oriented, oriented, square_sums, float(eps), exponents)
            return
    for grad, buf in zip(grads, momenta, strict=True):
        _check_same_shape("muon_normalized_inputs_", grad, buf)
    if new_momenta is not None:  # the fallback updates in place: into the new buffers
        torch._foreach_copy_(list(new_momenta), list(momenta))
        momenta = new_momenta
    per_run = max(1, FALLBACK_BATCH_BYTES // (4 * max(1, math.prod(shape))))
    for start in range(0, batch, per_run):
        stop = start + per_run
        _normalized_inputs_torch(
            grads[start:stop],
            momenta[start:stop],
            first_steps[start:stop],
            momentum,
            nesterov,
            oriented[start:stop],
            eps,
        )


def _normalized_inputs_torch(
    grads: Sequence[Tensor],
    momenta: Sequence[Tensor],
    first_steps: Sequence[bool],
    momentum: float,
    nesterov: bool,
    oriented: Tensor,  # (B, rows, cols), any strides
    eps: float,
) -> None:
    """``muon_normalized_inputs_`` in plain torch, its B inputs materialised in fp32."""
    batch, shape = len(grads), tuple(grads[0].shape)
    # [Note: low-precision momentum]: the arithmetic in fp32, the buffer rounded once on store.
    wide = [buf if buf.dtype == torch.float32 else buf.float() for buf in momenta]
    continuing = [i for i, first in enumerate(first_steps) if not first]
    starting = [i for i, first in enumerate(first_steps) if first]
    if continuing:
        buffers = [wide[i] for i in continuing]
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, [grads[i] for i in continuing])
    if starting:
        torch._foreach_copy_([wide[i] for i in starting], [grads[i] for i in starting])
    narrow = [i for i, buf in enumerate(momenta) if buf is not wide[i]]
    if narrow:
        torch._foreach_copy_([momenta[i] for i in narrow], [wide[i] for i in narrow])
    update = torch.empty((batch, *shape), dtype=torch.float32, device=grads[0].device)
    updates = list(update.unbind(0))
    if nesterov:
        torch._foreach_copy_(updates, grads)
        torch._foreach_add_(updates, wide, alpha=momentum)
    else:
        torch._foreach_copy_(updates, wide)
    oriented.copy_(_divided_by_norm(update, _square_sums(update), eps))


def decay_and_step(lr: float, weight_decay: float, scale: float) -> tuple[float, float]:
    """``(1 − lr·weight_decay, lr·scale)``: the factors of ``master·decay − step·update``,
    computed once here for every way of applying it (bit for bit the same floats)."""
    return 1.0 - float(lr) * float(weight_decay), float(lr) * float(scale)


def muon_apply_updates_(
    masters: Sequence[Tensor],  # B fp32 master weights; updated in place
    updates: Sequence[Tensor],  # B Newton-Schulz outputs of the masters' shapes, any strides
    lr: float,
    weight_decay: float,
    scale: float,
) -> None:
    """``master = master·(1 − lr·weight_decay) − lr·scale·update`` for every pair, one pass on
    CUDA. ``scale`` is Muon's ``0.2·sqrt(max(m, n))``."""
    if len(masters) != len(updates):
        raise ValueError(
            f"muon_apply_updates_: {len(masters)} masters but {len(updates)} updates; pass one "
            "Newton-Schulz output per master"
        )
    if not masters:
        return
    for master, update in zip(masters, updates, strict=True):
        _check_same_shape("muon_apply_update_", master, update)
    decay, step = decay_and_step(lr, weight_decay, scale)
    kernels = _kernels(masters[0], updates[0])
    if kernels is not None and len(masters) <= MAX_KERNEL_BATCH and masters[0].numel() > 0:
        master_views = [_as_matrix(m) for m in masters]
        update_views = [_as_matrix(u) for u in updates]
        shape = tuple(master_views[0].shape)
        strides, dtype = update_views[0].stride(), update_views[0].dtype
        if (
            _rows_contiguous(master_views, shape)
            and all(u.stride() == strides and u.dtype == dtype for u in update_views)
            and all(m.data_ptr() == v.data_ptr() for m, v in zip(masters, master_views))
            and kernels.apply_update(master_views, update_views, decay, step)
        ):
            return
    if decay != 1.0:
        torch._foreach_mul_(list(masters), decay)
    torch._foreach_add_(list(masters), list(updates), alpha=-step)


def compile_step_kernels_ahead(
    device: torch.device,
    shapes: Iterable[tuple[int, int]],
    *,
    momentum_dtype: torch.dtype,
    nesterov: bool,
    ns_dtype: torch.dtype,
    normuon: bool = False,
    grad_dtype: torch.dtype = torch.float32,
    master_dtype: torch.dtype = torch.float32,
    aligned_gradients: bool = False,
    more_launches: Sequence[tuple[object, tuple, dict]] = (),
) -> int:
    """Start compiling, in background threads, the Triton kernels that ``muon_normalized_inputs_``
    and ``muon_apply_updates_`` will launch for batches of (rows, cols) matrices of these dtypes
    (``normuon``: the updates are NorMuon's fp32 rows), so that a first step does not compile
    them one after the other; the first launch waits for them. Returns how many
    specialisations were started: 0 where the step would not use Triton (not CUDA, no Triton,
    ``DMUON_FUSED_TRITON=0``). ``aligned_gradients``: every gradient will start 16-byte aligned
    (else the variants for gradients at any offset compile too). ``more_launches``: other Triton
    launches of the step to compile with them (``update_epilogue.update_gemm_launches``). See
    [Note: compiles ahead] in ``dmuon_kernels._fused_triton``."""
    device = torch.device(device)
    kernels = _enabled_kernels() if device.type == "cuda" else None
    if kernels is None:
        return 0
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    launches = [
        launch
        for rows, cols in shapes
        if rows > 0 and cols > 0
        for launch in kernels.step_launches(
            rows, cols, grad_dtype=grad_dtype, momentum_dtype=momentum_dtype,
            nesterov=nesterov, ns_dtype=ns_dtype, master_dtype=master_dtype, normuon=normuon,
            aligned_gradients=aligned_gradients,
        )
    ]  # fmt: skip
    return kernels.compile_step_ahead(device, [*launches, *more_launches])


# ---- single matrices ----------------------------------------------------------------------------


def muon_momentum_(
    grad: Tensor,
    buf: Tensor,
    momentum: float,
    nesterov: bool = True,
    first_step: bool = False,
) -> tuple[Tensor, Tensor]:
    """Update the momentum buffer in place and return ``(update, sq_norm)``.

    Args:
        grad: the gradient g (any float dtype; read as fp32).
        buf: the momentum buffer (fp32 or bf16, see [Note: low-precision momentum]), same shape
            as grad; updated in place.
        momentum: μ.
        nesterov: ``u = g + μ·buf`` when True, else ``u = buf``.
        first_step: ``buf = g`` instead of ``μ·buf + g`` (the buffer's old content is ignored).

    Returns:
        ``update``: u in fp32 with ``nesterov``; without, the new buffer (``buf`` itself when
        it is fp32, or on CUDA; an fp32 copy of it on the torch fallback); ``sq_norm``: a
        0-dim float64 tensor on the same device holding Σu² (no host synchronisation).
    """
    _check_same_shape("muon_momentum_", grad, buf)
    kernels = _kernels(grad, buf)
    if kernels is not None and grad.numel() > 0 and grad.is_contiguous() and buf.is_contiguous():
        g, b = _as_matrix(grad), _as_matrix(buf)
        update = torch.empty_like(buf, dtype=torch.float32) if nesterov else buf
        summed = kernels.momentum_pass(
            [g], [b], [first_step], float(momentum), nesterov,
            _as_matrix(update).unsqueeze(0) if nesterov else None, scaled=False,
        )  # fmt: skip
        if summed is not None:
            return update, summed[0].reshape(())
    # [Note: low-precision momentum]: the arithmetic in fp32, the buffer rounded once on store.
    wide = buf if buf.dtype == torch.float32 else buf.float()
    if first_step:
        wide.copy_(grad)
    else:
        wide.mul_(momentum).add_(grad)
    if wide is not buf:
        buf.copy_(wide)
    update = torch.add(grad, wide, alpha=momentum).to(wide.dtype) if nesterov else wide
    return update, update.to(torch.float64).square().sum()


def muon_normalize(
    update: Tensor,
    sq_norm: Tensor | None = None,
    dtype: torch.dtype = torch.float16,
    eps: float = DEFAULT_NS_EPS,
    out: Tensor | None = None,
) -> Tensor:
    """``update / (sqrt(sq_norm) + eps)`` cast to ``dtype``, written into ``out`` if given.

    ``sq_norm`` is Σu² (as ``muon_momentum_`` returns it; converted to float64), or None to
    compute it here (one more pass). ``out`` may have any strides (e.g.
    ``torch.empty(n, m, dtype=...).mT`` for a transposed, row-contiguous result) and must have
    update's shape; it defaults to a contiguous tensor.
    """
    if out is None:
        out = torch.empty(update.shape, dtype=dtype, device=update.device)
    _check_same_shape("muon_normalize", update, out)
    kernels = _kernels(update, out, sq_norm)
    if kernels is not None and update.numel() > 0:
        src, dst = _as_matrix(update).unsqueeze(0), _as_matrix(out).unsqueeze(0)
        if dst.data_ptr() == out.data_ptr():  # a view, not a copy, of ``out``
            square_sum = (
                kernels.square_sums(src)
                if sq_norm is None
                else sq_norm.to(torch.float64).reshape(1)
            )
            kernels.normalize(src, dst, square_sum, float(eps))
            return out
    matrix = _as_matrix(update)
    square_sum = _square_sums(matrix) if sq_norm is None else sq_norm.reshape(1, 1)
    out.copy_(_divided_by_norm(matrix, square_sum, eps).reshape(update.shape))
    return out


def muon_apply_update_(
    master: Tensor,
    ortho: Tensor,
    lr: float,
    weight_decay: float = 0.0,
    scale: float = 1.0,
) -> Tensor:
    """``master = master·(1 − lr·weight_decay) − lr·scale·ortho`` in place; returns master.

    ``master`` is the fp32 master weight; ``ortho`` (any float dtype, any strides, same shape) is
    the Newton-Schulz output. ``scale`` is Muon's ``0.2·sqrt(max(m, n))``.
    """
    _check_same_shape("muon_apply_update_", master, ortho)
    muon_apply_updates_([master], [ortho], lr, weight_decay, scale)
    return master


__all__ = [
    "DEFAULT_NS_EPS",
    "compile_step_kernels_ahead",
    "decay_and_step",
    "muon_apply_update_",
    "muon_apply_updates_",
    "muon_momentum_",
    "muon_normalize",
    "muon_normalized_inputs_",
    "normalize_frobenius",
    "triton_available",
]
