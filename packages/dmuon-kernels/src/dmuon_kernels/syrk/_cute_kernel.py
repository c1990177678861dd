"""The CuTe DSL SYRK kernel: ``D = alpha·A·Bᵀ + beta·C`` on the tiles of one triangle, mirrored.

B is A itself for ``syrk`` (A·Aᵀ), and a second operand for ``symmetric_product``, whose A·Bᵀ is
symmetric by contract (B symmetric and commuting with A).

Owns the device code and its compilation (one compiled function per dtype, with/without C and
tile configuration). It imports nvidia-cutlass-dsl at module level, so only ``syrk.cute`` may
import it, lazily; it must not look at torch tensors (``syrk.cute`` prepares the operands and
passes raw pointers and sizes).

The kernel is the SM80 design (warp-level ``mma.sync`` m16n8k16 with fp32 accumulators,
``cp.async`` 16-byte loads into swizzled shared memory, ``ldmatrix`` to registers, a multi-stage
pipeline); it runs unchanged on SM90 and newer. Contract with the caller:

- A and B are (batch, M_pad, K_pad), K contiguous, with M_pad a multiple of the tile and K_pad
  a multiple of the k-tile; the padding is zero (``syrk.cute`` pads), so no load needs a predicate;
- D and C are (batch, M, M) contiguous, M the true size: stores and C loads are predicated on M;
- CTA (x, y) of the (tiles, tiles, batch) grid computes output tile (row y, column x) only when
  x <= y, writes its elements on and below the diagonal and mirrors them, so D is exactly
  symmetric and C's lower triangle is the only part read;
- every index fits in int32 (``syrk.cute`` splits larger batches).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from dmuon_kernels.syrk._cute_runtime import ELEMENT_TYPES, compile_with_placeholders
from dmuon_kernels.syrk._cute_tiles import Sm80TileConfig

_BYTES_PER_COPY = 16  # cp.async moves 16 bytes per thread per instruction


class SyrkKernel:
    """Compile-time parameters of one kernel; ``__call__`` is the host-side jit entry point."""

    def __init__(
        self, element_type: type[cutlass.Numeric], has_c: bool, config: Sm80TileConfig
    ):  # the config checked its own fields when it was built
        self.element_type = element_type
        self.has_c = has_c
        self.config = config

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        d_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        m: Int32,
        m_tiles: Int32,
        k_tiles: Int32,
        batch: Int32,
        alpha: Float32,
        beta: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.config
        m_pad = cute.assume(m_tiles * cfg.tile, divby=cfg.tile)
        k_pad = cute.assume(k_tiles * cfg.tile_k, divby=cfg.tile_k)
        a_layout = cute.make_layout(
            (m_pad, k_pad, batch), stride=(k_pad, 1, cute.assume(m_pad * k_pad, divby=64))
        )
        out_layout = cute.make_layout((m, m, batch), stride=(m, 1, m * m))
        mA = cute.make_tensor(a_ptr, a_layout)
        mB = cute.make_tensor(b_ptr, a_layout)
        mD = cute.make_tensor(d_ptr, out_layout)
        mC = cute.make_tensor(c_ptr, out_layout)
        self.kernel(mA, mB, mD, mC, m, k_tiles, alpha, beta).launch(
            grid=(m_tiles, m_tiles, batch), block=(cfg.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mD: cute.Tensor,
        mC: cute.Tensor,
        m: Int32,
        k_tiles: Int32,
        alpha: Float32,
        beta: Float32,
    ):
        cfg = self.config
        dtype = self.element_type
        tidx, _, _ = cute.arch.thread_idx()
        tile_col, tile_row, batch_idx = cute.arch.block_idx()

        # Shared memory for both operand tiles, allocated unconditionally (before any branch).
        # Rows of 64 elements (128 bytes) swizzled so that ldmatrix reads are bank-conflict free.
        swizzle_atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        s_layout = cute.tile_to_shape(swizzle_atom, (cfg.tile, cfg.tile_k, cfg.stages), (0, 1, 2))
        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(dtype, s_layout, byte_alignment=128)
        sB = smem.allocate_tensor(dtype, s_layout, byte_alignment=128)

        # Lower triangle of tiles only: tile (row, col) with col <= row; the rest exit at once.
        if tile_col <= tile_row:
            mA_b = mA[None, None, batch_idx]  # (M_pad, K_pad)
            mB_b = mB[None, None, batch_idx]
            gA = cute.local_tile(mA_b, (cfg.tile, cfg.tile_k), (tile_row, None))  # (T, TK, k)
            gB = cute.local_tile(mB_b, (cfg.tile, cfg.tile_k), (tile_col, None))

            # Global -> shared: each thread moves 16 bytes (8 elements) per cp.async.
            per_copy = _BYTES_PER_COPY * 8 // dtype.width
            threads_k = cfg.tile_k // per_copy
            g2s_atom = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                dtype,
                num_bits_per_copy=_BYTES_PER_COPY * 8,
            )
            g2s = cute.make_tiled_copy_tv(
                g2s_atom,
                cute.make_layout((cfg.threads // threads_k, threads_k), stride=(threads_k, 1)),
                cute.make_layout((1, per_copy)),
            )
            thr_g2s = g2s.get_slice(tidx)
            tAgA = thr_g2s.partition_S(gA)  # (CPY, CPY_M, CPY_K, k)
            tAsA = thr_g2s.partition_D(sA)  # (CPY, CPY_M, CPY_K, stage)
            tBgB = thr_g2s.partition_S(gB)
            tBsB = thr_g2s.partition_D(sB)

            # Warp-level MMA: each warp owns a (tile/warps_m) x (tile/warps_n) block of D.
            mma_op = warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16))
            tiled_mma = cute.make_tiled_mma(
                mma_op,
                (cfg.warps_m, cfg.warps_n, 1),
                permutation_mnk=(cfg.warps_m * 16, cfg.warps_n * 16, 16),
            )
            thr_mma = tiled_mma.get_slice(tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA[None, None, 0]))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB[None, None, 0]))
            cD = cute.make_identity_tensor((cfg.tile, cfg.tile))
            tCcD = thr_mma.partition_C(cD)  # (MMA, MMA_M, MMA_N) coordinates in the tile
            acc = cute.make_rmem_tensor(tCcD.shape, Float32)
            acc.fill(0.0)

            # Shared -> registers with ldmatrix (four 8x8 matrices per instruction).
            s2r_A = cute.make_tiled_copy_A(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), dtype), tiled_mma
            )
            s2r_B = cute.make_tiled_copy_B(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), dtype), tiled_mma
            )
            thr_s2r_A = s2r_A.get_slice(tidx)
            thr_s2r_B = s2r_B.get_slice(tidx)
            tCsA = thr_s2r_A.partition_S(sA)  # (CPY, CPY_M, CPY_K, stage)
            tCsB = thr_s2r_B.partition_S(sB)
            tCrA_view = thr_s2r_A.retile(tCrA)
            tCrB_view = thr_s2r_B.retile(tCrB)

            # Prologue: start the first stages-1 k-tiles (an empty group when there are fewer,
            # so the wait counts below stay the same for every K).
            for stage in cutlass.range_constexpr(cfg.stages - 1):
                if stage < k_tiles:
                    cute.copy(g2s, tAgA[None, None, None, stage], tAsA[None, None, None, stage])
                    cute.copy(g2s, tBgB[None, None, None, stage], tBsB[None, None, None, stage])
                cute.arch.cp_async_commit_group()

            k_blocks = cute.size(tCrA, mode=[2])
            for k_tile in cutlass.range(k_tiles):
                # k-tile `k_tile` has landed once at most stages-2 younger groups are pending;
                # the barrier also tells every thread that the slot refilled below (read in the
                # previous iteration) is free.
                cute.arch.cp_async_wait_group(cfg.stages - 2)
                cute.arch.sync_threads()
                next_tile = k_tile + (cfg.stages - 1)
                if next_tile < k_tiles:
                    next_slot = next_tile % cfg.stages
                    cute.copy(
                        g2s, tAgA[None, None, None, next_tile], tAsA[None, None, None, next_slot]
                    )
                    cute.copy(
                        g2s, tBgB[None, None, None, next_tile], tBsB[None, None, None, next_slot]
                    )
                cute.arch.cp_async_commit_group()

                slot = k_tile % cfg.stages
                for k_block in cutlass.range_constexpr(k_blocks):
                    cute.copy(
                        s2r_A, tCsA[None, None, k_block, slot], tCrA_view[None, None, k_block]
                    )
                    cute.copy(
                        s2r_B, tCsB[None, None, k_block, slot], tCrB_view[None, None, k_block]
                    )
                    cute.gemm(
                        tiled_mma,
                        acc,
                        tCrA[None, None, k_block],
                        tCrB[None, None, k_block],
                        acc,
                    )
            cute.arch.cp_async_wait_group(0)

            # Epilogue: element (r, c) of the tile is D[row0 + r, col0 + c]. Keep those on or
            # below the diagonal, apply alpha/beta in fp32, round once, store it and its mirror.
            row0 = tile_row * cfg.tile
            col0 = tile_col * cfg.tile
            for e in cutlass.range_constexpr(cute.size(acc)):
                coord = tCcD[e]
                row = row0 + coord[0]
                col = col0 + coord[1]
                # Nested ifs, not `and`: both operands are device values, and nested ifs are
                # the plainest form for the DSL's preprocessor.
                if row < m:  # noqa: SIM102
                    if col <= row:
                        value = alpha * acc[e]
                        if cutlass.const_expr(self.has_c):
                            value = value + beta * mC[row, col, batch_idx].to(Float32)
                        out = value.to(dtype)
                        mD[row, col, batch_idx] = out
                        mD[col, row, batch_idx] = out


def compile_syrk(dtype_name: str, has_c: bool, config: Sm80TileConfig):
    """Compile the kernel for ``dtype_name`` ("float16"/"bfloat16"); the returned function takes
    ``(a_ptr, b_ptr, d_ptr, c_ptr, m, m_tiles, k_tiles, batch, alpha, beta, stream)``."""
    kernel = SyrkKernel(ELEMENT_TYPES[dtype_name], has_c, config)
    return compile_with_placeholders(
        kernel, dtype_name, Int32(1), Int32(1), Int32(1), Int32(1), Float32(1.0), Float32(0.0)
    )


# The adapter (syrk.cute) calls these on whichever kernel module runs.
__all__ = ["ELEMENT_TYPES", "compile_syrk"]
