"""Triton kernels behind ``dmuon_kernels.fused`` (imported only when Triton is installed).

Owns the kernels, their launch geometry and the offset tables that let one launch cover a list
of tensors. Validation, fallbacks and the public names live in ``fused``; this module assumes
CUDA tensors of the shapes, dtypes and row-contiguous layouts ``fused`` checked.

Every kernel walks (rows, cols) matrices in square tiles (``TILE_ROWS`` x ``TILE_COLS``) on a
grid (tiles, matrices), so a transposed operand is read or written in whole lines. A list of B
same-shape tensors reaches a kernel as its first tensor plus a table of element offsets from it
(``offset_table``): one launch for the list, whatever B. Offsets are stored in units of ``VEC``
elements (16 bytes) when every tensor is 16-byte aligned, which tells Triton that the rows it
loads are aligned (vector loads) without trusting anything it cannot see.

Arithmetic is fp32 (sums of squares in fp64); quotients are IEEE-rounded (``div_rn``) to match
the torch fallback. See [Note: overflow-safe normalisation] in ``fused`` for the power-of-two
scales.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from dmuon_kernels._env import progress_lines_enabled
from dmuon_kernels._log import COMPILE, log_rank_tagged, record_phase

TILE_ROWS, TILE_COLS = 64, 64
WARPS = 4
VECTOR_BYTES = 16
# Device offset tables kept per (device, stream, offsets): the gradients of a step usually sit at
# the same offsets from each other every step, so a table is built once (bound: see below).
_tables: dict[tuple, Tensor] = {}
MAX_CACHED_TABLES = 512


@triton.jit
def _tile(rows, cols, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """This program's tile: its index in the matrix, row and column indices, bounds mask."""
    tile = tl.program_id(0)
    tiles_per_row = tl.cdiv(cols, TILE_C)
    r = ((tile // tiles_per_row).to(tl.int64) * TILE_R + tl.arange(0, TILE_R))[:, None]
    c = ((tile % tiles_per_row).to(tl.int64) * TILE_C + tl.arange(0, TILE_C))[None, :]
    return tile, r, c, (r < rows) & (c < cols)


@triton.jit
def _sum_of_squares(x):  # fp32 tile -> fp64 scalar
    x64 = x.to(tl.float64)
    return tl.sum(tl.sum(x64 * x64, axis=1), axis=0)


# Triton compiles one specialisation per integer argument that is 1, divisible by 16 or neither;
# ``batch`` only indexes the offset table, so specialising on it would compile the same kernel
# again for each group size class a step meets (a first step's compiles are its cost).
@triton.jit(do_not_specialize=["batch"])
def _momentum_kernel(
    grad_ptr,  # first of B gradients (rows, cols), rows contiguous, any float dtype
    buf_ptr,  # first of B momentum buffers (rows, cols), rows contiguous; read
    new_ptr,  # first of B buffers the new momentum goes to (the buffers themselves: in place)
    # int64 (4, B): gradient offsets / GRAD_VEC, buffer offsets / BUF_VEC, first-step flags,
    # new-buffer offsets / BUF_VEC
    table_ptr,
    out_ptr,  # (B, rows, cols) at strides (out_bs, out_rs, out_cs): u, or u scaled per tile
    exponent_ptr,  # int32 (B, tiles): the tile's scale is 2^-exponent (OUT_MODE 2)
    partial_ptr,  # fp64 (B, tiles): the tile's sum of u²
    batch,
    rows,
    cols,
    out_bs,
    out_rs,
    out_cs,
    momentum,
    NESTEROV: tl.constexpr,
    OUT_MODE: tl.constexpr,  # 0: no output (u is the buffer), 1: u, 2: u scaled per tile
    GRAD_VEC: tl.constexpr,
    BUF_VEC: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):
    matrix = tl.program_id(1)
    tile, r, c, mask = _tile(rows, cols, TILE_R, TILE_C)
    element = r * cols + c
    grad_at = grad_ptr + tl.load(table_ptr + matrix) * GRAD_VEC + element
    buf_at = buf_ptr + tl.load(table_ptr + batch + matrix) * BUF_VEC + element
    first_step = tl.load(table_ptr + 2 * batch + matrix) != 0
    new_at = new_ptr + tl.load(table_ptr + 3 * batch + matrix) * BUF_VEC + element
    g = tl.load(grad_at, mask=mask, other=0.0).to(tl.float32)
    # A first step's buffer is uninitialised: loaded, then discarded by the where.
    b = tl.load(buf_at, mask=mask, other=0.0).to(tl.float32)
    b = tl.where(first_step, g, b * momentum + g)
    tl.store(new_at, b.to(new_ptr.dtype.element_ty), mask=mask)
    if NESTEROV:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
        u = g + b * momentum
    else:
        u = b
    tiles = tl.cdiv(rows, TILE_R) * tl.cdiv(cols, TILE_C)
    tl.store(partial_ptr + matrix * tiles + tile, _sum_of_squares(u))
    if OUT_MODE == 2:
        # u / 2^e with 2^(e-1) <= max|u| < 2^e: the tile fits the output dtype's range whatever
        # the gradient's scale, rounded once; the second pass multiplies 2^e back.
        peak = tl.max(tl.max(tl.abs(u), axis=1), axis=0)
        field = (peak.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the peak
        field = tl.minimum(tl.maximum(field, 1), 252)
        tl.store(exponent_ptr + matrix * tiles + tile, field - 126)
        u = u * ((253 - field) << 23).to(tl.float32, bitcast=True)  # 2^(126 - field)
    if OUT_MODE != 0:
        out_at = out_ptr + matrix.to(tl.int64) * out_bs + r * out_rs + c * out_cs
        tl.store(out_at, u.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _square_sum_kernel(
    src_ptr,  # (B, rows, cols) at strides (src_bs, src_rs, src_cs)
    partial_ptr,  # fp64 (B, tiles): the tile's sum of squares
    rows,
    cols,
    src_bs,
    src_rs,
    src_cs,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):
    matrix = tl.program_id(1)
    tile, r, c, mask = _tile(rows, cols, TILE_R, TILE_C)
    src_at = src_ptr + matrix.to(tl.int64) * src_bs + r * src_rs + c * src_cs
    x = tl.load(src_at, mask=mask, other=0.0).to(tl.float32)
    tiles = tl.cdiv(rows, TILE_R) * tl.cdiv(cols, TILE_C)
    tl.store(partial_ptr + matrix * tiles + tile, _sum_of_squares(x))


@triton.jit
def _normalize_kernel(
    src_ptr,  # (B, rows, cols) at strides (src_bs, src_rs, src_cs)
    dst_ptr,  # (B, rows, cols) at strides (dst_bs, dst_rs, dst_cs); may be src itself
    sq_ptr,  # fp64 (B,): each matrix's sum of squares (of the unscaled values)
    exponent_ptr,  # int32 (B, tiles): src holds x / 2^exponent per tile (TILE_SCALED)
    rows,
    cols,
    src_bs,
    src_rs,
    src_cs,
    dst_bs,
    dst_rs,
    dst_cs,
    eps,
    TILE_SCALED: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):
    matrix = tl.program_id(1)
    tile, r, c, mask = _tile(rows, cols, TILE_R, TILE_C)
    # x / (norm + eps) as (x·2^-k) / ((norm + eps)·2^-k), 2^(k-1) <= norm < 2^k: the same
    # rounded quotient, and no overflow whatever the norm.
    norm = tl.sqrt(tl.load(sq_ptr + matrix))  # fp64
    k = ((norm.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1022
    k = tl.minimum(tl.maximum(k, -126), 126)
    scale64 = ((1023 - k) << 52).to(tl.float64, bitcast=True)  # 2^-k
    denominator = ((norm + eps) * scale64).to(tl.float32)
    src_at = src_ptr + matrix.to(tl.int64) * src_bs + r * src_rs + c * src_cs
    x = tl.load(src_at, mask=mask, other=0.0).to(tl.float32)
    if TILE_SCALED:
        tiles = tl.cdiv(rows, TILE_R) * tl.cdiv(cols, TILE_C)
        shift = tl.load(exponent_ptr + matrix * tiles + tile) - k  # <= 1: max|x| <= norm
        bits = ((127 + tl.maximum(shift, -126)) << 23).to(tl.int32)
        factor = bits.to(tl.float32, bitcast=True)
        factor = tl.where(shift >= -126, factor, 0.0)  # below 2^-126 of the norm: flushed
    else:
        factor = scale64.to(tl.float32)
    y = tl.div_rn(x * factor, denominator)
    dst_at = dst_ptr + matrix.to(tl.int64) * dst_bs + r * dst_rs + c * dst_cs
    tl.store(dst_at, y.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["batch"])  # as _momentum_kernel
def _apply_update_kernel(
    master_ptr,  # first of B masters (rows, cols), rows contiguous; updated in place
    ortho_ptr,  # first of B updates (rows, cols) at strides (ortho_rs, ortho_cs)
    table_ptr,  # int64 (2, B): master offsets / MASTER_VEC, update offsets / ORTHO_VEC
    batch,
    rows,
    cols,
    ortho_rs,
    ortho_cs,
    decay,
    step,
    MASTER_VEC: tl.constexpr,
    ORTHO_VEC: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
):
    matrix = tl.program_id(1)
    _, r, c, mask = _tile(rows, cols, TILE_R, TILE_C)
    master_at = master_ptr + tl.load(table_ptr + matrix) * MASTER_VEC + r * cols + c
    ortho_at = ortho_ptr + tl.load(table_ptr + batch + matrix) * ORTHO_VEC
    ortho_at += r * ortho_rs + c * ortho_cs
    w = tl.load(master_at, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(ortho_at, mask=mask, other=0.0).to(tl.float32)
    w = w * decay - o * step
    tl.store(master_at, w.to(master_ptr.dtype.element_ty), mask=mask)


# ---- host side ----------------------------------------------------------------------------------


def tile_count(rows: int, cols: int) -> int:
    return triton.cdiv(rows, TILE_ROWS) * triton.cdiv(cols, TILE_COLS)


def vector_width(tensors: Sequence[Tensor]) -> int:
    """Elements per 16 bytes when every tensor starts 16-byte aligned, else 1."""
    if all(t.data_ptr() % VECTOR_BYTES == 0 for t in tensors):
        return VECTOR_BYTES // tensors[0].element_size()
    return 1


def offsets(tensors: Sequence[Tensor], vec: int) -> list[int]:
    """Each tensor's offset from the first, in units of ``vec`` elements."""
    base, unit = tensors[0].data_ptr(), tensors[0].element_size() * vec
    return [(t.data_ptr() - base) // unit for t in tensors]


def offset_table(values: list[int], device: torch.device) -> Tensor | None:
    """``values`` as an int64 tensor on ``device``, cached per stream; None while a CUDA graph is
    being captured and the table is not cached yet (a copy from host memory cannot be captured
    safely: the caller falls back to torch)."""
    if device.type != "cuda":  # Triton's interpreter (tests on the CPU)
        return torch.tensor(values, dtype=torch.int64, device=device)
    key = (device, torch.cuda.current_stream(device).cuda_stream, tuple(values))
    table = _tables.get(key)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        if len(_tables) >= MAX_CACHED_TABLES:
            _tables.clear()  # the caching allocator reuses the memory in stream order: safe
        host = torch.tensor(values, dtype=torch.int64).pin_memory()
        table = _tables[key] = host.to(device, non_blocking=True)
    return table


def momentum_pass(
    grads: Sequence[Tensor],  # B (rows, cols), rows contiguous, one dtype
    buffers: Sequence[Tensor],  # B (rows, cols), rows contiguous, one dtype
    first_steps: Sequence[bool],
    momentum: float,
    nesterov: bool,
    out: Tensor | None,  # (B, rows, cols), any strides; None: u is the buffer (no Nesterov)
    scaled: bool,
    new_buffers: Sequence[Tensor] | None = None,  # B (rows, cols) like ``buffers``; default: them
) -> tuple[Tensor, Tensor | None] | None:
    """Pass 1: the new momentum into ``new_buffers`` (the buffers themselves by default), u (or
    u scaled per tile) into ``out``; returns each matrix's sum of u² (fp64 (B,)) and the tile
    exponents (int32 (B, tiles); None unless ``scaled``), or None when no table can be made
    now."""
    _await_compiles_ahead()
    batch = len(grads)
    rows, cols = grads[0].shape
    device = grads[0].device
    in_place = new_buffers is None
    new_buffers = buffers if in_place else new_buffers
    grad_vec = vector_width(grads)
    buf_vec = vector_width(buffers if in_place else [*buffers, *new_buffers])
    buffer_offsets = offsets(buffers, buf_vec)
    new_offsets = buffer_offsets if in_place else offsets(new_buffers, buf_vec)
    table = offset_table(
        [*offsets(grads, grad_vec), *buffer_offsets, *map(int, first_steps), *new_offsets],
        device,
    )
    if table is None:
        return None
    tiles = tile_count(rows, cols)
    partial = torch.empty((batch, tiles), dtype=torch.float64, device=device)
    exponents = torch.empty((batch, tiles), dtype=torch.int32, device=device) if scaled else None
    mode = 0 if out is None else (2 if scaled else 1)
    target = new_buffers[0] if out is None else out
    strides = (0, 0, 0) if out is None else out.stride()
    _momentum_kernel[(tiles, batch)](
        grads[0], buffers[0], new_buffers[0], table, target,
        partial if exponents is None else exponents, partial, batch, rows, cols, *strides, momentum,
        NESTEROV=nesterov, OUT_MODE=mode, GRAD_VEC=grad_vec, BUF_VEC=buf_vec,
        TILE_R=TILE_ROWS, TILE_C=TILE_COLS, num_warps=WARPS,
    )  # fmt: skip
    return partial.sum(dim=1), exponents


def square_sums(src: Tensor) -> Tensor:
    """Each matrix's sum of squares of src (B, rows, cols), any strides: fp64 (B,)."""
    _await_compiles_ahead()
    batch, rows, cols = src.shape
    tiles = tile_count(rows, cols)
    partial = torch.empty((batch, tiles), dtype=torch.float64, device=src.device)
    _square_sum_kernel[(tiles, batch)](
        src, partial, rows, cols, *src.stride(),
        TILE_R=TILE_ROWS, TILE_C=TILE_COLS, num_warps=WARPS,
    )  # fmt: skip
    return partial.sum(dim=1)


def normalize(
    src: Tensor, out: Tensor, square_sum: Tensor, eps: float, exponents: Tensor | None = None
) -> None:
    """out = src / (sqrt(square_sum) + eps) per matrix of (B, rows, cols) src and out (any
    strides; out may be src); with ``exponents``, src holds each tile divided by 2^exponent."""
    _await_compiles_ahead()
    batch, rows, cols = src.shape
    tiles = tile_count(rows, cols)
    scaled = exponents is not None
    _normalize_kernel[(tiles, batch)](
        src, out, square_sum, exponents if scaled else square_sum,
        rows, cols, *src.stride(), *out.stride(), eps,
        TILE_SCALED=scaled, TILE_R=TILE_ROWS, TILE_C=TILE_COLS, num_warps=WARPS,
    )  # fmt: skip


def apply_update(
    masters: Sequence[Tensor],  # B (rows, cols), rows contiguous, one dtype
    updates: Sequence[Tensor],  # B (rows, cols), one dtype and one set of strides
    decay: float,
    step: float,
) -> bool:
    """master = master·decay − update·step for every pair; False when no table can be made now."""
    _await_compiles_ahead()
    rows, cols = masters[0].shape
    master_vec, ortho_vec = vector_width(masters), vector_width(updates)
    table = offset_table(
        [*offsets(masters, master_vec), *offsets(updates, ortho_vec)], masters[0].device
    )
    if table is None:
        return False
    _apply_update_kernel[(tile_count(rows, cols), len(masters))](
        masters[0], updates[0], table, len(masters), rows, cols, *updates[0].stride(),
        decay, step, MASTER_VEC=master_vec, ORTHO_VEC=ortho_vec,
        TILE_R=TILE_ROWS, TILE_C=TILE_COLS, num_warps=WARPS,
    )  # fmt: skip
    return True


# ---- compiles ahead: see [Note: compiles ahead] -------------------------------------------------

# [Note: compiles ahead]
# Triton compiles a kernel when a launch first meets a new specialisation (the dtypes, the
# constexprs, whether each integer is 1 or a multiple of 16, whether each pointer is 16-byte
# aligned): about 0.7 s each on the H200, most of it in ptxas, and a first step meets 6 to 8 of
# them one after the other. ``compile_step_ahead`` derives the launches a step makes for matrices
# of given shapes and dtypes, and compiles them all at once in threads, before the step: ptxas
# runs in its own process, so the threads overlap (8 kernels in 1.6 s instead of 5.6 on the
# H200, benchmarks/results/parallel-compile-h200-2026-12-03-10139d4.json). Each kernel's first
# specialisation on a device compiles before its others, in this call or a later one (Triton
# creates a kernel's per-device cache on its first compile, and two threads doing that at once
# would each fill their own); nothing is started twice in a process. Every launcher
# first waits for what is pending (``_await_compiles_ahead``), so a kernel is never compiled
# twice. A specialisation the derivation misses (an expert's buffer at an odd offset, say)
# compiles at its launch, as without this; one derived in vain costs a background compile. The
# threads only compile: no allocation, launch or module load (the CUDA context loads a kernel at
# its first launch), none of which a CUDA-graph capture elsewhere in the process would allow.

_pending_compiles: list[Future] = []
# Across calls (one per param group and device): what was started, and each kernel's first
# compile on each device, which its other specialisations wait for.
_started: set[tuple] = set()
_first_compiles: dict[tuple, Future] = {}
# The integer arguments the kernels are declared ``do_not_specialize`` on.
_UNSPECIALISED = frozenset({"batch"})


class Unaligned(NamedTuple):
    """A pointer argument of ``dtype`` that is not 16-byte aligned (a bare dtype is aligned)."""

    dtype: torch.dtype


def pointer_of(tensor: Tensor) -> torch.dtype | Unaligned:
    """How a launch's tensor argument specialises a kernel: its dtype, and its alignment."""
    aligned = tensor.data_ptr() % VECTOR_BYTES == 0
    return tensor.dtype if aligned else Unaligned(tensor.dtype)


def _specialisation(value: object) -> object:
    """What Triton keys a compile on for one argument: a pointer's dtype and alignment, an
    integer's class (1, a multiple of 16, other; 64-bit beyond int32), a float's type."""
    if isinstance(value, torch.dtype | Unaligned):
        return value
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        width = 64 if not -(2**31) <= value < 2**31 else 32
        return (width, 1 if value == 1 else 16 if value % 16 == 0 else 0)
    if isinstance(value, float):
        return float
    return type(value)


def specialisation_key(kernel, args: Sequence[object], options: dict) -> tuple:
    """The compile key of a launch of ``kernel`` with ``args`` (tensors as ``pointer_of``) and
    keyword ``options`` (constexprs and launch options), in the terms of ``_specialisation``."""
    classes = tuple(
        "any" if name in _UNSPECIALISED else _specialisation(arg)
        for name, arg in zip(kernel.arg_names, args)  # the rest are keyword constexprs
    )
    return (kernel.fn.__name__, classes, tuple(sorted(options.items())))


def step_launches(
    rows: int,
    cols: int,
    *,
    grad_dtype: torch.dtype,
    momentum_dtype: torch.dtype,
    nesterov: bool,
    ns_dtype: torch.dtype,
    master_dtype: torch.dtype,
    normuon: bool,
    aligned_gradients: bool = False,
) -> list[tuple[object, tuple, dict]]:
    """``(kernel, args, options)`` of each launch a step makes for a batch of several (rows,
    cols) matrices, tensors given as ``pointer_of`` gives them: momentum into the Newton-Schulz
    buffer (B, short, long), transposed for a tall matrix, its normalisation in place, and the
    update from the Newton-Schulz output (its ``.mT`` for a tall matrix) or, with ``normuon``,
    from NorMuon's fp32 (B, rows, cols) stack. Buffers and masters are taken 16-byte
    aligned. A gradient may be a view of a larger buffer at any offset, so momentum is derived
    for each case, unless ``aligned_gradients`` says every gradient starts 16-byte aligned."""
    tall = rows > cols
    out_strides = (rows * cols, 1, rows) if tall else (rows * cols, cols, 1)
    update_dtype = torch.float32 if normuon else ns_dtype
    update_strides = (1, rows) if tall and not normuon else (cols, 1)
    tiles = dict(TILE_R=TILE_ROWS, TILE_C=TILE_COLS, num_warps=WARPS)
    vec = {d: VECTOR_BYTES // d.itemsize for d in (grad_dtype, momentum_dtype, master_dtype)}
    # The updates of a batch sit one matrix apart: the second is aligned when a matrix's bytes
    # are a multiple of 16 (a batch of one always is).
    update_vecs = [VECTOR_BYTES // update_dtype.itemsize]
    if rows * cols * update_dtype.itemsize % VECTOR_BYTES:
        update_vecs.append(1)
    batch = 2  # not specialised on
    # (the first gradient's pointer, GRAD_VEC): all aligned; some not; the first not
    gradients = ((grad_dtype, vec[grad_dtype]), (grad_dtype, 1), (Unaligned(grad_dtype), 1))
    if aligned_gradients:
        gradients = gradients[:1]
    momentum_launches = [
        (
            _momentum_kernel,
            (grad, momentum_dtype, momentum_dtype, torch.int64, ns_dtype, torch.int32,
             torch.float64, batch, rows, cols, *out_strides, 0.5),
            dict(NESTEROV=nesterov, OUT_MODE=2, GRAD_VEC=grad_vec, BUF_VEC=vec[momentum_dtype],
                 **tiles),
        )
        for grad, grad_vec in gradients
    ]  # fmt: skip
    update_launches = [
        (
            _apply_update_kernel,
            (master_dtype, update_dtype, torch.int64, batch, rows, cols, *update_strides, 0.5, 0.5),
            dict(MASTER_VEC=vec[master_dtype], ORTHO_VEC=update_vec, **tiles),
        )
        for update_vec in update_vecs
    ]
    return [
        *momentum_launches,
        (
            _normalize_kernel,
            (ns_dtype, ns_dtype, torch.float64, torch.int32, rows, cols, *out_strides,
             *out_strides, 0.5),
            dict(TILE_SCALED=True, **tiles),
        ),
        *update_launches,
    ]  # fmt: skip


def compile_step_ahead(device: torch.device, launches: Iterable[tuple[object, tuple, dict]]) -> int:
    """Start compiling ``launches`` (``step_launches``'s) on ``device`` in background threads;
    returns how many distinct specialisations were started. See [Note: compiles ahead]."""
    distinct: dict[tuple, tuple[object, tuple, dict]] = {}
    for kernel, args, options in launches:
        key = (device, specialisation_key(kernel, args, options))
        if key not in _started:
            distinct.setdefault(key, (kernel, args, options))
    if not distinct:
        return 0
    _started.update(distinct)
    pool = ThreadPoolExecutor(
        max_workers=min(len(distinct), os.cpu_count() or 1), thread_name_prefix="dmuon-triton"
    )
    for kernel, args, options in distinct.values():
        # An unaligned pointer needs a real address: a tensor one element into its storage,
        # allocated here (a CUDA allocation in another thread could break a graph capture).
        args = tuple(
            torch.empty(2, dtype=a.dtype, device=device)[1:] if isinstance(a, Unaligned) else a
            for a in args
        )
        after = _first_compiles.get((kernel, device))
        future = pool.submit(_warm_up, device, kernel, args, options, after)
        _first_compiles.setdefault((kernel, device), future)
        _pending_compiles.append(future)
    pool.shutdown(wait=False)  # the threads end with their compiles
    if progress_lines_enabled():
        log_rank_tagged(
            f"compiling {len(distinct)} Triton kernel specialisations of the fused step ahead, "
            "in background threads (once per process; loaded from Triton's cache when there)"
        )
    return len(distinct)


def _warm_up(device: torch.device, kernel, args: tuple, options: dict, after: Future | None):
    if after is not None:
        after.exception()  # wait; its failure is reported by _await_compiles_ahead
    with torch.cuda.device(device):
        compiled = kernel.warmup(*args, grid=(1, 1), **options)
    _build_launcher(compiled)


def _build_launcher(compiled) -> None:
    """Build ``compiled``'s host launcher, which its first launch would otherwise build: Triton
    3.6 (the H200's) compiles a C launcher per kernel signature with the system compiler, in a
    subprocess, and keeps it in its cache, where the first launch then finds it. The first
    launches of a Qwen2's step took 1.8 s before and none after
    (cold-start-h200-2026-12-03-ed742fc-qwen2.json). Builds nothing on the GPU; a Triton whose
    launcher is generic (3.9) builds it in no time."""
    launcher_cls = getattr(triton.runtime.driver.active, "launcher_cls", None)
    if launcher_cls is not None and hasattr(compiled, "metadata"):
        launcher_cls(compiled.src, compiled.metadata)


def _await_compiles_ahead() -> None:
    """Wait for the compiles ``compile_step_ahead`` started (a no-op once they are done)."""
    if not _pending_compiles:
        return
    pending = list(_pending_compiles)
    _pending_compiles.clear()
    start = time.perf_counter()
    errors = [error for error in (future.exception() for future in pending) if error is not None]
    phase = record_phase(COMPILE, "Triton: the fused step's kernels compiled ahead", start)
    if errors:
        log_rank_tagged(
            f"compiling {len(errors)} of {len(pending)} Triton kernel specialisations ahead "
            f"failed ({type(errors[0]).__name__}: {errors[0]}); each compiles when first "
            "launched instead"
        )
    elif progress_lines_enabled():
        log_rank_tagged(
            f"{len(pending)} Triton kernel specialisations of the fused step ready (the step "
            f"waited {phase.seconds:.1f} s for them)"
        )
