"""The elementwise parts of a Muon step, fused into as few passes over memory as the math allows.

Owns momentum + Nesterov, normalisation + cast to the Newton-Schulz dtype, and decoupled weight
decay + the scaled update. On CUDA with Triton installed each function is one Triton kernel over
the tensors; elsewhere (CPU, no Triton, layouts the kernels do not take) a plain-torch fallback
computes the same values up to rounding (the kernels may fuse a multiply-add). It must not run
Newton-Schulz, know about parameters or optimizers, or synchronise with the host.

The math (SPEC "The optimizer math"), with μ the momentum and g the gradient:

- ``muon_momentum_``: first step ``buf = g``, then ``buf = μ·buf + g``; the update is
  ``u = g + μ·buf`` with Nesterov, else ``u = buf``; also returns ``Σu²`` (partial sums per block,
  added in a fixed order, so it is deterministic). One pass: reads g and buf, writes buf and u.
- ``muon_normalize``: ``u / (sqrt(Σu²) + eps)`` cast to the iteration dtype, into any layout (e.g.
  transposed, so Newton-Schulz gets rows <= cols contiguous). One pass; the norm stays on the GPU.
- ``muon_momentum_normalize_``: both of the above without materialising u: the second pass
  recomputes u from g and the new buf (the same bytes as reading u back, one buffer less).
- ``muon_apply_update_``: ``W = W·(1 − lr·wd) − lr·scale·O`` into the fp32 master, any layout of
  O (Newton-Schulz returns tall matrices as transposed views). One pass.
- ``normalize_cast``: ``(X / (norm + eps)).to(dtype)`` per matrix of a batch, one pass (Newton-
  Schulz's input stage; bit-identical to the torch expression).

The norm needs every element of u before any can be scaled, so two passes is the minimum for the
first three; the update is one.
"""

from __future__ import annotations

import importlib.util
import math

import torch
from torch import Tensor

DEFAULT_NS_EPS = 1e-7

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
    return _triton_module if triton_available() else None


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
        buf: the momentum buffer (fp32 recommended), same shape as grad; updated in place.
        momentum: μ.
        nesterov: ``u = g + μ·buf`` when True, else ``u = buf``.
        first_step: ``buf = g`` instead of ``μ·buf + g`` (the buffer's old content is ignored).

    Returns:
        ``update``: u in buf's dtype (``buf`` itself when ``nesterov=False``); ``sq_norm``: a
        0-dim fp32 tensor on the same device holding Σu² (no host synchronisation).
    """
    _check_same_shape("muon_momentum_", grad, buf)
    kernels = _kernels(grad, buf)
    if kernels is not None and grad.is_contiguous() and buf.is_contiguous():
        return kernels.momentum(grad, buf, float(momentum), nesterov, first_step)
    if first_step:
        buf.copy_(grad)
    else:
        buf.mul_(momentum).add_(grad)
    update = torch.add(grad, buf, alpha=momentum).to(buf.dtype) if nesterov else buf
    return update, _sum_of_squares(update)


def _sum_of_squares(t: Tensor) -> Tensor:
    flat = t.reshape(-1).float()
    return torch.dot(flat, flat) if flat.numel() else flat.new_zeros(())


def muon_normalize(
    update: Tensor,
    sq_norm: Tensor,
    dtype: torch.dtype = torch.float16,
    eps: float = DEFAULT_NS_EPS,
    out: Tensor | None = None,
) -> Tensor:
    """``update / (sqrt(sq_norm) + eps)`` cast to ``dtype``, written into ``out`` if given.

    ``out`` may have any strides (e.g. ``torch.empty(n, m, dtype=...).mT`` for a transposed,
    row-contiguous result) and must have update's shape; it defaults to a contiguous tensor.
    """
    if out is None:
        out = torch.empty(update.shape, dtype=dtype, device=update.device)
    _check_same_shape("muon_normalize", update, out)
    kernels = _kernels(update, out, sq_norm)
    if kernels is not None:
        kernels.normalize(_as_matrix(update), sq_norm, float(eps), _as_matrix(out), squared=True)
        return out
    out.copy_(update.float() / (sq_norm.sqrt() + eps))
    return out


def normalize_cast(
    X: Tensor,  # (n, m) or (B, n, m), any strides
    norm: Tensor,  # one Frobenius norm per matrix: (1, 1) or (B, 1, 1)
    eps: float,
    dtype: torch.dtype,
    out: Tensor | None = None,  # X's shape, ``dtype``
) -> Tensor:  # ``out``, else a new contiguous tensor
    """``(X / (norm + eps)).to(dtype)`` in one pass on CUDA (Newton-Schulz's input stage).

    Equal to the torch expression bit for bit: the sum and the quotient are IEEE-rounded fp32,
    then rounded once to ``dtype``.
    """
    kernels = _kernels(X, norm)
    if kernels is None or X.dim() not in (2, 3) or norm.numel() not in (1, math.prod(X.shape[:-2])):
        result = (X / (norm + eps)).to(dtype)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(X.shape, dtype=dtype, device=X.device)
    kernels.normalize(X, norm, float(eps), out, squared=False)
    return out


def muon_momentum_normalize_(
    grad: Tensor,
    buf: Tensor,
    momentum: float,
    nesterov: bool = True,
    first_step: bool = False,
    dtype: torch.dtype = torch.float16,
    eps: float = DEFAULT_NS_EPS,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``muon_momentum_`` then ``muon_normalize`` in two passes, without materialising u.

    Returns ``(X, sq_norm)`` with X the normalised update in ``dtype`` (in ``out`` if given).
    """
    _check_same_shape("muon_momentum_normalize_", grad, buf)
    if out is None:
        out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    _check_same_shape("muon_momentum_normalize_", grad, out)
    kernels = _kernels(grad, buf, out)
    if kernels is not None and grad.is_contiguous() and buf.is_contiguous():
        sq_norm = kernels.momentum_normalize(
            _as_matrix(grad), _as_matrix(buf), float(momentum), nesterov, first_step,
            float(eps), _as_matrix(out),
        )  # fmt: skip
        return out, sq_norm
    update, sq_norm = muon_momentum_(grad, buf, momentum, nesterov, first_step)
    muon_normalize(update, sq_norm, dtype, eps, out)
    return out, sq_norm


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
    decay, step = 1.0 - float(lr) * float(weight_decay), float(lr) * float(scale)
    kernels = _kernels(master, ortho)
    if kernels is not None and master.is_contiguous():
        kernels.apply_update(_as_matrix(master), _as_matrix(ortho), decay, step)
        return master
    if decay != 1.0:
        master.mul_(decay)
    return master.add_(ortho, alpha=-step)


__all__ = [
    "DEFAULT_NS_EPS",
    "muon_apply_update_",
    "muon_momentum_",
    "muon_momentum_normalize_",
    "muon_normalize",
    "normalize_cast",
    "triton_available",
]
