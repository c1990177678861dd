"""The update GEMM with two outputs, in Triton (imported only when Triton is installed).

Owns one kernel: ``W = decay·W − step·(A·B)`` for an fp32 master W, and the same values rounded
into a second tensor (the weight forward computes with), in one epilogue, so the master is read
once and written once and the narrow copy costs no pass of its own; see [Note: the update
epilogue] in ``dmuon_kernels.update_epilogue``, which validates the operands and chooses this
kernel. Operands of any strides (a tall master takes ``Xᵀ·Lᵀ``, both transposed views).

The tiles: each program computes a BLOCK_M x BLOCK_N tile of W over K in BLOCK_K steps with fp32
accumulation (``tl.dot``: warpgroup MMA on Hopper), programs ordered in groups of GROUP_M row
tiles so that neighbours share their B column tiles in L2. Rows and columns past the edge are
loaded from wrapped-around indices (in bounds, discarded at the store) instead of masked, so only
a K that is not a multiple of BLOCK_K costs masked loads. Offsets are 64-bit: a master may hold
more than 2³¹ elements.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from dmuon_kernels._fused_triton import _await_compiles_ahead


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# The best of bench_update_gemm.py's candidates on most shapes on an H100 (5 of 8;
# benchmarks/results/update-gemm-h100-2026-12-06-df98817.json).
DEFAULT_TILES = TileConfig(
    block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3
)


@triton.jit
def _update_gemm_kernel(
    a_ptr,  # (M, K), the iteration dtype
    b_ptr,  # (K, N), the iteration dtype
    master_ptr,  # (M, N) fp32, read and written
    copy_ptr,  # (M, N), the narrow dtype, written
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_wm,
    stride_wn,
    stride_cm,
    stride_cn,
    decay,
    step,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_size
    tile_n = (pid % per_group) // group_size

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Wrapped indices: in bounds, and contiguous runs the loads can vectorise. A vector never
    # straddles the wrap: its width divides the leading stride's alignment, and each operand's
    # contiguous side is its leading stride (L, X and their transposes are whole tensors).
    a_rows = tl.max_contiguous(tl.multiple_of(rows % M, BLOCK_M), BLOCK_M).to(tl.int64)
    b_cols = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :].to(tl.int64) * stride_ak
    b_ptrs = b_ptr + ks[:, None].to(tl.int64) * stride_bk + b_cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    r = rows.to(tl.int64)[:, None]
    c = cols.to(tl.int64)[None, :]
    inside = (r < M) & (c < N)
    w_ptrs = master_ptr + r * stride_wm + c * stride_wn
    w = tl.load(w_ptrs, mask=inside, other=0.0)
    w = decay * w - step * acc
    tl.store(w_ptrs, w, mask=inside)
    tl.store(
        copy_ptr + r * stride_cm + c * stride_cn,
        w.to(copy_ptr.dtype.element_ty),
        mask=inside,
    )


def update_gemm_(
    first: Tensor,
    second: Tensor,
    master: Tensor,
    copy: Tensor,
    *,
    decay: float,
    step: float,
    tiles: TileConfig = DEFAULT_TILES,
) -> None:
    """``master = decay·master − step·(first·second)`` and ``copy = master`` rounded, in one
    launch: ``first`` (M, K), ``second`` (K, N), ``master`` fp32 and ``copy`` (M, N), all
    CUDA tensors of any strides (``update_epilogue`` has checked shapes, dtypes and device)."""
    _await_compiles_ahead()
    M, K = first.shape
    N = second.shape[1]
    grid = (triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n),)
    _update_gemm_kernel[grid](
        first, second, master, copy, M, N, K,
        *first.stride(), *second.stride(), *master.stride(), *copy.stride(),
        decay, step,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, EVEN_K=K % tiles.block_k == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def update_gemm_launches(
    rows: int, cols: int, *, ns_dtype: torch.dtype, copy_dtype: torch.dtype
) -> list[tuple[object, tuple, dict]]:
    """``(kernel, args, options)`` of the launch ``update_gemm_`` makes for a contiguous fp32
    (rows, cols) master and its contiguous copy, as [Note: compiles ahead] in
    ``dmuon_kernels._fused_triton`` takes them: L·X for a wide master, Xᵀ·Lᵀ for a tall one,
    with n = min(rows, cols) and m = max(rows, cols)."""
    n, m = min(rows, cols), max(rows, cols)
    if rows <= cols:  # first = L (n, n), second = X (n, m)
        sizes, strides = (n, m, n), (n, 1, m, 1)
    else:  # first = Xᵀ (m, n), second = Lᵀ (n, n)
        sizes, strides = (m, n, n), (1, m, 1, n)
    tiles = DEFAULT_TILES
    args = (ns_dtype, ns_dtype, torch.float32, copy_dtype, *sizes, *strides,
            cols, 1, cols, 1, 0.5, 0.5)  # fmt: skip
    options = dict(
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, EVEN_K=n % tiles.block_k == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return [(_update_gemm_kernel, args, options)]
