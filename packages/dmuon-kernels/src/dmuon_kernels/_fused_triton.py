"""Triton kernels behind ``dmuon_kernels.fused`` (imported only when Triton is installed).

Owns the kernels and their launch geometry. Validation, fallbacks and the public names live in
``fused``; this module assumes CUDA tensors of matching shapes, as ``fused`` guarantees.
Arithmetic is fp32 throughout; square roots and divisions are IEEE-rounded (``sqrt_rn``,
``div_rn``) to match the torch fallback.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# 1-D passes: elements per program (16 per thread with 8 warps: four 16-byte fp32 accesses).
BLOCK_1D = 4096
WARPS_1D = 8
# 2-D passes: square tiles so a transposed operand is read and written in whole lines.
TILE_ROWS, TILE_COLS = 64, 64
WARPS_2D = 4


@triton.jit
def _momentum_kernel(
    grad_ptr,  # (n,) any float dtype
    buf_ptr,  # (n,) updated in place
    update_ptr,  # (n,) written when WRITE_UPDATE
    partial_ptr,  # (programs,) fp32 partial sums of update²
    n,
    momentum,
    NESTEROV: tl.constexpr,
    FIRST_STEP: tl.constexpr,
    WRITE_UPDATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if FIRST_STEP:
        b = g
    else:
        b = tl.load(buf_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * momentum + g
    tl.store(buf_ptr + offsets, b.to(buf_ptr.dtype.element_ty), mask=mask)
    if NESTEROV:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
        u = g + b * momentum
    else:
        u = b
    if WRITE_UPDATE:
        tl.store(update_ptr + offsets, u.to(update_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + pid, tl.sum(u * u, axis=0))


@triton.jit
def _normalize_kernel(
    src_ptr,  # (batch, rows, cols), strides (src_bs, src_rs, src_cs)
    dst_ptr,  # (batch, rows, cols), strides (dst_bs, dst_rs, dst_cs)
    norm_ptr,  # (batch,) fp32, stride norm_bs: the norm, or its square when SQUARED
    rows,
    cols,
    src_bs,
    src_rs,
    src_cs,
    dst_bs,
    dst_rs,
    dst_cs,
    norm_bs,
    eps,
    SQUARED: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):
    batch = tl.program_id(2).to(tl.int64)
    r = (tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R))[:, None]
    c = (tl.program_id(1).to(tl.int64) * TILE_C + tl.arange(0, TILE_C))[None, :]
    mask = (r < rows) & (c < cols)
    norm = tl.load(norm_ptr + batch * norm_bs).to(tl.float32)
    if SQUARED:
        norm = tl.sqrt_rn(norm)
    src = src_ptr + batch * src_bs + r * src_rs + c * src_cs
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    y = tl.div_rn(x, norm + eps)
    dst = dst_ptr + batch * dst_bs + r * dst_rs + c * dst_cs
    tl.store(dst, y.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _recompute_normalize_kernel(
    grad_ptr,  # (rows, cols) contiguous
    buf_ptr,  # (rows, cols) contiguous, already updated
    dst_ptr,  # (rows, cols), strides (dst_rs, dst_cs)
    sq_norm_ptr,  # () fp32
    rows,
    cols,
    dst_rs,
    dst_cs,
    momentum,
    eps,
    NESTEROV: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):
    r = (tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R))[:, None]
    c = (tl.program_id(1).to(tl.int64) * TILE_C + tl.arange(0, TILE_C))[None, :]
    mask = (r < rows) & (c < cols)
    denominator = tl.sqrt_rn(tl.load(sq_norm_ptr)) + eps
    b = tl.load(buf_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
    if NESTEROV:
        g = tl.load(grad_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
        u = g + b * momentum
    else:
        u = b
    y = tl.div_rn(u, denominator)
    tl.store(dst_ptr + r * dst_rs + c * dst_cs, y.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _apply_update_kernel(
    master_ptr,  # (rows, cols) contiguous, updated in place
    ortho_ptr,  # (rows, cols), strides (ortho_rs, ortho_cs)
    rows,
    cols,
    ortho_rs,
    ortho_cs,
    decay,
    step,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):
    r = (tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R))[:, None]
    c = (tl.program_id(1).to(tl.int64) * TILE_C + tl.arange(0, TILE_C))[None, :]
    mask = (r < rows) & (c < cols)
    w = tl.load(master_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(ortho_ptr + r * ortho_rs + c * ortho_cs, mask=mask, other=0.0).to(tl.float32)
    w = w * decay - o * step
    tl.store(master_ptr + r * cols + c, w.to(master_ptr.dtype.element_ty), mask=mask)


def _grid_2d(rows: int, cols: int) -> tuple[int, int]:
    return triton.cdiv(rows, TILE_ROWS), triton.cdiv(cols, TILE_COLS)


def _momentum_pass(
    grad: Tensor, buf: Tensor, momentum: float, nesterov: bool, first_step: bool, update: Tensor
) -> Tensor:
    n = grad.numel()
    programs = max(1, triton.cdiv(n, BLOCK_1D))
    partial = torch.empty(programs, dtype=torch.float32, device=grad.device)
    if n == 0:
        return partial.zero_().sum()
    _momentum_kernel[(programs,)](
        grad, buf, update, partial, n, momentum,
        NESTEROV=nesterov, FIRST_STEP=first_step, WRITE_UPDATE=update is not buf,
        BLOCK=BLOCK_1D, num_warps=WARPS_1D,
    )  # fmt: skip
    return partial.sum()  # fixed-order reduction: deterministic


def momentum(
    grad: Tensor, buf: Tensor, momentum: float, nesterov: bool, first_step: bool
) -> tuple[Tensor, Tensor]:
    update = torch.empty_like(buf) if nesterov else buf
    return update, _momentum_pass(grad, buf, momentum, nesterov, first_step, update)


def normalize(src: Tensor, norm: Tensor, eps: float, out: Tensor, *, squared: bool) -> None:
    """out = src / (norm + eps) (sqrt(norm) when ``squared``); src/out (rows, cols) or
    (batch, rows, cols), norm one value per matrix."""
    if src.numel() == 0:
        return
    src3, out3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (src, out))
    batch, rows, cols = src3.shape
    norm = norm.float().reshape(-1)
    if norm.numel() != batch:
        norm = norm.expand(batch)
    norm_stride = norm.stride(0) if batch > 1 else 0
    _normalize_kernel[(*_grid_2d(rows, cols), batch)](
        src3, out3, norm, rows, cols, *src3.stride(), *out3.stride(), norm_stride, eps,
        SQUARED=squared, TILE_R=TILE_ROWS, TILE_C=TILE_COLS, num_warps=WARPS_2D,
    )  # fmt: skip


def momentum_normalize(
    grad: Tensor,
    buf: Tensor,
    momentum: float,
    nesterov: bool,
    first_step: bool,
    eps: float,
    out: Tensor,
) -> Tensor:
    # Pass 1 updates buf and sums u² without storing u (the update aliases buf: no extra write).
    sq_norm = _momentum_pass(grad, buf, momentum, nesterov, first_step, buf)
    rows, cols = grad.shape
    if grad.numel():
        _recompute_normalize_kernel[_grid_2d(rows, cols)](
            grad, buf, out, sq_norm, rows, cols, *out.stride(), momentum, eps,
            NESTEROV=nesterov, TILE_R=TILE_ROWS, TILE_C=TILE_COLS, num_warps=WARPS_2D,
        )  # fmt: skip
    return sq_norm


def apply_update(master: Tensor, ortho: Tensor, decay: float, step: float) -> None:
    rows, cols = master.shape
    if master.numel() == 0:
        return
    _apply_update_kernel[_grid_2d(rows, cols)](
        master, ortho, rows, cols, *ortho.stride(), decay, step,
        TILE_R=TILE_ROWS, TILE_C=TILE_COLS, num_warps=WARPS_2D,
    )  # fmt: skip
