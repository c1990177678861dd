"""The Hopper (SM90) CuTe DSL SYRK kernel: ``D = alpha·A·Bᵀ + beta·C`` on one triangle, mirrored.

B is A itself for ``syrk`` (A·Aᵀ), and a second operand for ``symmetric_product``, whose A·Bᵀ is
symmetric by contract (B symmetric and commuting with A, so A·Bᵀ = A·B = B·A).

Owns the SM90 device code and its compilation (one compiled function per dtype, with/without C
and tile configuration). It imports nvidia-cutlass-dsl at module level, so only ``syrk.cute`` may
import it, lazily; it must not look at torch tensors (``syrk.cute`` prepares the operands and
passes raw pointers and sizes). ``syrk._cute_kernel`` holds the SM80 design, used on other
architectures (wgmma exists only on 9.x) and selectable on Hopper.

Design: a persistent, warp-specialised kernel. Each CTA has three warpgroups:

- warpgroup 0 is the producer: its first warp walks the CTA's output tiles and, for each, loads
  the k-tiles of the tile's row block of A and column block of B into a ring of shared-memory stages
  with TMA bulk tensor copies that complete on the stage's mbarrier (``cutlass.pipeline``
  PipelineTmaAsync); it gives most of its registers to the consumers (``setmaxnreg``);
- warpgroups 1 and 2 are consumers in ping-pong: they take the CTA's tiles alternately, each
  computing a whole tile with warpgroup MMA (``wgmma``, both operands in shared memory, fp32
  accumulators) and then running its epilogue while the other one's MMAs run. The producer fills
  the ring tile after tile; a consumer starts a tile's mainloop only once the other one has
  passed the end of the previous tile's (a pair of named barriers), because an mbarrier's parity
  wait cannot tell a stage's fill for this tile from one two laps of the ring ahead. With
  ``consumers=1`` a single consumer warpgroup takes every tile (no ping-pong).
- ``cooperative=True`` instead makes the CTA tile twice as tall (2·tile x tile): both consumers
  work on every tile, each on its own tile x tile half, sharing the column block's operand tile
  (3 operand tiles per stage instead of 4 for the same work: less traffic per flop, no epilogue
  overlap). Its triangle has 2r + 2 tiles in row block r, so that the column blocks reach the
  diagonal.

Epilogue, one of two (``Sm90TileConfig.epilogue``, ``syrk._cute_tiles``):

- ``"direct"``: each consumer thread stores its accumulator elements (on or below the diagonal)
  and their mirrors straight to global memory, one element at a time;
- ``"smem"`` (staged): each consumer has a tile x tile buffer in shared memory; it writes the
  rounded tile into it and TMA-stores it to D[row block, col block], then writes the transpose
  and stores it to D[col block, row block] (a diagonal tile is symmetrised in the buffer and
  stored once). The stores run asynchronously: the buffer is only waited for (until the TMA
  unit has read it) when it is next written, so in ping-pong they overlap the other consumer's
  mainloop and this consumer's next one. Needs M a multiple of 8 (TMA's 16-byte strides).
  The buffer is swizzled in 128-byte atoms (few bank conflicts, but ptxas spills about 1 KB
  per thread once the buffer-filling loops are in: each element's swizzled address is
  computed apart, and they are loop-invariant, so likely hoisted out of the tile loop) or,
  with ``"smem_flat"``, plain row-major (each address is the thread's base plus a constant:
  no spills, but 4- to 8-way bank conflicts on its 2-byte writes).

Schedule: the grid is at most one CTA per SM; CTA ``b`` takes linear tile indices
``b, b + grid, ...`` over ``batch x tiles·(tiles+1)/2`` lower-triangle tiles (cooperative:
``batch x R·(R+1)`` tiles, R the number of 2·tile row blocks); a linear index maps to (matrix,
row block, column block) with the block on or below the diagonal, so only the lower triangle is
computed.

Contract with the caller:

- A and B are (batch, M, K_pad), K contiguous, K_pad a multiple of 8 (TMA strides are
  multiples of 16 bytes) and the bases 16-byte aligned; any M; TMA fills rows beyond M and columns beyond K_pad
  with zeros, so edge tiles need no padding in memory;
- D and C are (batch, M, M) contiguous: stores and C loads are predicated on M (TMA stores
  clip at M); an element
  (row, col) of a tile is kept when col <= row and written to D[row, col] and D[col, row], so D is
  exactly symmetric and only C's lower triangle is read;
- every index fits in int32 (``syrk.cute`` splits larger batches).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from dmuon_kernels.syrk._cute_runtime import ELEMENT_TYPES, compile_with_placeholders
from dmuon_kernels.syrk._cute_tiles import (
    DIRECT,
    STAGED_FLAT,
    TMA_ALIGNMENT_ELEMENTS,
    WARPGROUP_THREADS,
    Sm90TileConfig,
)

_PRODUCER_REGISTERS = 40  # the producer warpgroup keeps few registers...
_CONSUMER_REGISTERS = 232  # ...so each consumer can hold a 128x128 fp32 accumulator
_ORDER_BARRIER = 1  # named barriers 1 and 2 order the consumers' mainloops (0 is syncthreads)
_EPILOGUE_BARRIER = 3  # named barriers 3 and 4: one per consumer's staged epilogue
_AS_IS, _TRANSPOSED, _SYMMETRIC = 0, 1, 2  # how the staged epilogue fills its buffer


class SyrkSm90Kernel:
    """Compile-time parameters of one kernel; ``__call__`` is the host-side jit entry point."""

    def __init__(
        self, element_type: type[cutlass.Numeric], has_c: bool, config: Sm90TileConfig
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
        k_pad: Int32,
        batch: Int32,
        ctas: Int32,
        alpha: Float32,
        beta: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.config
        k_pad = cute.assume(k_pad, divby=TMA_ALIGNMENT_ELEMENTS)
        a_layout = cute.make_layout(
            (m, k_pad, batch),
            stride=(k_pad, 1, cute.assume(m * k_pad, divby=TMA_ALIGNMENT_ELEMENTS)),
        )
        out_layout = cute.make_layout((m, m, batch), stride=(m, 1, m * m))
        mA = cute.make_tensor(a_ptr, a_layout)
        mB = cute.make_tensor(b_ptr, a_layout)
        mD = cute.make_tensor(d_ptr, out_layout)
        mC = cute.make_tensor(c_ptr, out_layout)

        # The MMA operands are tile x tile_k tiles of A (rows of the output block) and of B
        # (rows of the column block), K-major, one TMA descriptor each (for syrk both describe
        # A); the row operand has one slot per row half per stage.
        a_layout = self.operand_layout(cfg.stages * cfg.halves)
        b_layout = self.operand_layout(cfg.stages)
        tma_atom, tma_tensor = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mA,
            cute.slice_(b_layout, (None, None, 0)),
            (cfg.tile, cfg.tile_k),
        )
        tma_atom_b, tma_tensor_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mB,
            cute.slice_(b_layout, (None, None, 0)),
            (cfg.tile, cfg.tile_k),
        )
        # The staged epilogue stores tile x tile blocks of D (and of its transpose) from one
        # shared-memory buffer per consumer with TMA; the direct one passes the A descriptor
        # in its place, unused (TMA cannot describe D when M is not a multiple of 8).
        store_atom, mD_tma, d_layout = tma_atom, tma_tensor, b_layout
        if cutlass.const_expr(cfg.epilogue != DIRECT):
            m_aligned = cute.assume(m, divby=TMA_ALIGNMENT_ELEMENTS)
            d_gmem = cute.make_layout(
                (m, m, batch),
                stride=(m_aligned, 1, cute.assume(m * m, divby=TMA_ALIGNMENT_ELEMENTS)),
            )
            d_layout = self.output_layout()
            store_atom, mD_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(),
                cute.make_tensor(d_ptr, d_gmem),
                cute.slice_(d_layout, (None, None, 0)),
                (cfg.tile, cfg.tile),
            )
        row_tiles = (m + cfg.halves * cfg.tile - 1) // (cfg.halves * cfg.tile)
        k_tiles = (k_pad + cfg.tile_k - 1) // cfg.tile_k
        tiles_per_matrix = row_tiles * (row_tiles + 1) // 2
        if cutlass.const_expr(cfg.cooperative):
            tiles_per_matrix = row_tiles * (row_tiles + 1)
        self.kernel(
            tma_atom,
            tma_tensor,
            tma_atom_b,
            tma_tensor_b,
            mD,
            mC,
            a_layout,
            b_layout,
            store_atom,
            mD_tma,
            d_layout,
            m,
            k_tiles,
            tiles_per_matrix,
            tiles_per_matrix * batch,
            alpha,
            beta,
        ).launch(grid=(ctas, 1, 1), block=(cfg.threads, 1, 1), min_blocks_per_mp=1, stream=stream)

    def operand_layout(self, slots: int):
        """Swizzled K-major shared-memory layout of ``slots`` tile x tile_k operand tiles."""
        cfg = self.config
        return sm90_utils.make_smem_layout_a(
            cutlass.utils.LayoutEnum.ROW_MAJOR,
            (cfg.tile, cfg.tile, cfg.tile_k),
            self.element_type,
            slots,
        )

    def output_layout(self):
        """Shared-memory layout of one tile x tile row-major output buffer per consumer:
        swizzled in 128-byte atoms like the operands (STAGED), or plain (STAGED_FLAT: every
        element's address is the thread's base plus a constant, so no per-element address
        stays live in registers, at the price of bank conflicts)."""
        cfg = self.config
        if cutlass.const_expr(cfg.epilogue == STAGED_FLAT):
            return cute.make_layout(
                (cfg.tile, cfg.tile, cfg.consumers), stride=(cfg.tile, 1, cfg.tile * cfg.tile)
            )
        return sm90_utils.make_smem_layout_a(
            cutlass.utils.LayoutEnum.ROW_MAJOR,
            (cfg.tile, cfg.tile, cfg.tile),
            self.element_type,
            cfg.consumers,
        )

    @cute.jit
    def tile_coordinates(self, linear: Int32, tiles_per_matrix: Int32):
        """(matrix, row block, column block) of a linear lower-triangle tile index.

        Row r starts at r(r+1)/2 (r + 1 tiles a row), or at r(r+1) when cooperative (2r + 2
        tiles a row); a float square root guesses r and one step each way fixes it.
        """
        matrix = linear // tiles_per_matrix
        local = linear - matrix * tiles_per_matrix
        # starts(r) = r(r+1)/per_unit, so r = (sqrt(4·per_unit·local + 1) - 1) / 2
        per_unit = 1 if cutlass.const_expr(self.config.cooperative) else 2
        guess = (cute.math.sqrt(Float32(4 * per_unit * local + 1)) - Float32(1.0)) * Float32(0.5)
        row = Int32(guess)
        if (row + 1) * (row + 2) // per_unit <= local:
            row = row + 1
        if row * (row + 1) // per_unit > local:
            row = row - 1
        col = local - row * (row + 1) // per_unit
        return matrix, row, col

    @cute.kernel
    def kernel(
        self,
        tma_atom: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mD: cute.Tensor,
        mC: cute.Tensor,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
        store_atom: cute.CopyAtom,
        mD_tma: cute.Tensor,
        d_layout: cute.Layout | cute.ComposedLayout,
        m: Int32,
        k_tiles: Int32,
        tiles_per_matrix: Int32,
        total_tiles: Int32,
        alpha: Float32,
        beta: Float32,
    ):
        cfg = self.config
        dtype = self.element_type
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = warp // 4  # 0: producer warpgroup, 1 and 2: consumers

        if warp == 0:
            cpasync.prefetch_descriptor(tma_atom)
            cpasync.prefetch_descriptor(tma_atom_b)
            if cutlass.const_expr(cfg.epilogue != DIRECT):
                cpasync.prefetch_descriptor(store_atom)

        smem = cutlass.utils.SmemAllocator()
        barriers = smem.allocate_array(cutlass.Int64, 2 * cfg.stages, byte_alignment=8)
        sA = smem.allocate_tensor(
            dtype, a_layout.outer, byte_alignment=1024, swizzle=a_layout.inner
        )
        sB = smem.allocate_tensor(
            dtype, b_layout.outer, byte_alignment=1024, swizzle=b_layout.inner
        )
        sD = sB  # the staged epilogue's output buffers, one per consumer
        if cutlass.const_expr(cfg.epilogue != DIRECT):
            if cutlass.const_expr(cfg.epilogue == STAGED_FLAT):
                sD = smem.allocate_tensor(dtype, d_layout, byte_alignment=1024)
            else:
                sD = smem.allocate_tensor(
                    dtype, d_layout.outer, byte_alignment=1024, swizzle=d_layout.inner
                )
        operand_bytes = cute.size_in_bytes(dtype, cute.slice_(b_layout, (None, None, 0)))
        ring = pipeline.PipelineTmaAsync.create(
            num_stages=cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # one arrival per consumer warp that reads a stage: one warpgroup in ping-pong, both
            # when cooperative
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * cfg.halves),
            tx_count=(cfg.halves + 1) * operand_bytes,
            barrier_storage=barriers,
        )

        if role == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGISTERS)
            if warp == 0:
                sA_flat = cute.group_modes(sA, 0, 2)  # (TILE·TK, stage)
                sB_flat = cute.group_modes(sB, 0, 2)
                sequence = Int32(0)  # this CTA's tile count so far
                for linear in cutlass.range(cta, total_tiles, ctas, unroll=1):
                    matrix, row, col = self.tile_coordinates(linear, tiles_per_matrix)
                    mA_b = mA_tma[None, None, matrix]
                    # rows: 128-row block `row` (ping-pong) or blocks 2·row and 2·row + 1
                    gA = cute.local_tile(mA_b, (cfg.tile, cfg.tile_k), (row * cfg.halves, None))
                    gB = cute.local_tile(
                        mB_tma[None, None, matrix], (cfg.tile, cfg.tile_k), (col, None)
                    )
                    tAsA, tAgA = cpasync.tma_partition(
                        tma_atom, 0, cute.make_layout(1), sA_flat, cute.group_modes(gA, 0, 2)
                    )
                    tHsH, tHgH = tAsA, tAgA  # the second row half (cooperative only)
                    if cutlass.const_expr(cfg.cooperative):
                        gH = cute.local_tile(mA_b, (cfg.tile, cfg.tile_k), (row * 2 + 1, None))
                        tHsH, tHgH = cpasync.tma_partition(
                            tma_atom, 0, cute.make_layout(1), sA_flat, cute.group_modes(gH, 0, 2)
                        )
                    tBsB, tBgB = cpasync.tma_partition(
                        tma_atom_b, 0, cute.make_layout(1), sB_flat, cute.group_modes(gB, 0, 2)
                    )
                    state = self.ring_state(sequence * k_tiles, producer=True)
                    for k_tile in cutlass.range(k_tiles, unroll=1):
                        ring.producer_acquire(state)
                        full = ring.producer_get_barrier(state)
                        cute.copy(
                            tma_atom,
                            tAgA[None, k_tile],
                            tAsA[None, state.index * cfg.halves],
                            tma_bar_ptr=full,
                        )
                        if cutlass.const_expr(cfg.cooperative):
                            cute.copy(
                                tma_atom,
                                tHgH[None, k_tile],
                                tHsH[None, state.index * 2 + 1],
                                tma_bar_ptr=full,
                            )
                        cute.copy(
                            tma_atom_b,
                            tBgB[None, k_tile],
                            tBsB[None, state.index],
                            tma_bar_ptr=full,
                        )
                        ring.producer_commit(state)
                        state.advance()
                    sequence = sequence + 1
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGISTERS)
            consumer = role - 1
            wg_tidx = tidx - role * WARPGROUP_THREADS
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                dtype,
                dtype,
                OperandMajorMode.K,
                OperandMajorMode.K,
                Float32,
                (1, 1, 1),
                (64, cfg.tile),
            )
            thr_mma = tiled_mma.get_slice(wg_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # (MMA, M, K, stage)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            cD = cute.make_identity_tensor((cfg.tile, cfg.tile))
            tCcD = thr_mma.partition_C(cD)  # (MMA, MMA_M, MMA_N) coordinates in the tile
            acc = cute.make_rmem_tensor(tCcD.shape, Float32)
            k_blocks = cute.size(tCrA, mode=[2])

            # Ping-pong: this CTA's tiles alternate between the consumers. Cooperative: both
            # take every tile, each its own row half (A slot and output row block).
            pingpong = cfg.consumers == 2 and not cfg.cooperative
            turns = 1 if cutlass.const_expr(cfg.cooperative) else cfg.consumers
            half = consumer if cutlass.const_expr(cfg.cooperative) else 0
            sequence = consumer if cutlass.const_expr(pingpong) else 0
            first = cta + consumer * ctas if cutlass.const_expr(pingpong) else cta
            for linear in cutlass.range(first, total_tiles, turns * ctas, unroll=1):
                matrix, row, col = self.tile_coordinates(linear, tiles_per_matrix)
                if cutlass.const_expr(pingpong):  # noqa: SIM102 (compile-time if)
                    # Wait until the other consumer has passed the end of the previous tile's
                    # mainloop (it signals barrier 1 + its index); the CTA's first tile has none.
                    if sequence > 0:
                        cute.arch.barrier(
                            barrier_id=_ORDER_BARRIER + 1 - consumer,
                            number_of_threads=2 * WARPGROUP_THREADS,
                        )
                read = self.ring_state(sequence * k_tiles, producer=False)
                release = self.ring_state(sequence * k_tiles, producer=False)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                for k_tile in cutlass.range(k_tiles, unroll=1):
                    ring.consumer_wait(read)
                    warpgroup.fence()
                    for k_block in cutlass.range_constexpr(k_blocks):
                        cute.gemm(
                            tiled_mma,
                            acc,
                            tCrA[None, None, k_block, read.index * cfg.halves + half],
                            tCrB[None, None, k_block, read.index],
                            acc,
                        )
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.commit_group()
                    # Keep one k-tile of MMAs in flight; the one before it is done, so its
                    # stage goes back to the producer.
                    warpgroup.wait_group(1)
                    if k_tile > 0:
                        ring.consumer_release(release)
                        release.advance()
                    read.advance()
                if cutlass.const_expr(pingpong):  # noqa: SIM102 (compile-time if)
                    # Every stage of this tile has been waited for: the other consumer may
                    # start the next tile (signalled only when there is one, so no arrival is
                    # left unmatched at exit).
                    if linear + ctas < total_tiles:
                        cute.arch.barrier_arrive(
                            barrier_id=_ORDER_BARRIER + consumer,
                            number_of_threads=2 * WARPGROUP_THREADS,
                        )
                warpgroup.wait_group(0)
                ring.consumer_release(release)

                out_row = row * cfg.halves + half
                if cutlass.const_expr(cfg.epilogue != DIRECT):
                    # a cooperative upper half (column block above it) or a half beyond M
                    # has nothing to store
                    if col <= out_row and out_row * cfg.tile < m:
                        self.staged_epilogue(
                            acc,
                            tCcD,
                            sD[None, None, consumer],
                            store_atom,
                            mD_tma,
                            mC,
                            m,
                            matrix,
                            out_row,
                            col,
                            alpha,
                            beta,
                            wg_tidx,
                            _EPILOGUE_BARRIER + consumer,
                        )
                else:
                    self.epilogue(acc, tCcD, mD, mC, m, matrix, out_row, col, alpha, beta)
                sequence = sequence + turns
            if cutlass.const_expr(cfg.epilogue != DIRECT):  # noqa: SIM102 (compile-time if)
                # the last stores must have read the buffer before the CTA's memory goes
                if wg_tidx == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    def ring_state(self, count, *, producer: bool) -> pipeline.PipelineState:
        """The ring position after ``count`` stages; the producer's phase starts flipped (its
        first pass finds every stage empty)."""
        stages = self.config.stages
        phase = (count // stages) % 2
        if producer:
            phase = phase ^ 1
        return pipeline.PipelineState(stages, Int32(count), Int32(count % stages), Int32(phase))

    @cute.jit
    def epilogue(
        self,
        acc: cute.Tensor,
        tCcD: cute.Tensor,
        mD: cute.Tensor,
        mC: cute.Tensor,
        m: Int32,
        matrix: Int32,
        row_block: Int32,
        col_block: Int32,
        alpha: Float32,
        beta: Float32,
    ):
        """Element (r, c) of the tile is D[row0 + r, col0 + c]: keep it on or below the
        diagonal, apply alpha/beta in fp32, round once, store it and its mirror."""
        dtype = self.element_type
        row0 = row_block * self.config.tile
        col0 = col_block * self.config.tile
        for e in cutlass.range_constexpr(cute.size(acc)):
            coord = tCcD[e]
            row = row0 + coord[0]
            col = col0 + coord[1]
            if row < m:  # noqa: SIM102  (nested ifs: the plainest form for the DSL)
                if col <= row:
                    value = alpha * acc[e]
                    if cutlass.const_expr(self.has_c):
                        value = value + beta * mC[row, col, matrix].to(Float32)
                    out = value.to(dtype)
                    mD[row, col, matrix] = out
                    mD[col, row, matrix] = out

    @cute.jit
    def staged_epilogue(
        self,
        acc: cute.Tensor,
        tCcD: cute.Tensor,
        sD: cute.Tensor,
        store_atom: cute.CopyAtom,
        mD_tma: cute.Tensor,
        mC: cute.Tensor,
        m: Int32,
        matrix: Int32,
        row_block: Int32,
        col_block: Int32,
        alpha: Float32,
        beta: Float32,
        wg_tidx: Int32,
        barrier_id: Int32,
    ):
        """The epilogue through shared memory: compute alpha·acc + beta·C in fp32 in place (a
        second fragment of rounded values would not fit in the consumer's registers), write the
        tile rounded into this consumer's buffer and store it to D[row block, col block]
        with one TMA store, then write its transpose into the same buffer and store that to
        D[col block, row block]. A diagonal tile is made symmetric in the buffer (its lower
        elements and their mirrors) and stored once. TMA clips rows and columns beyond M.
        One thread issues the stores; the warpgroup's named barrier orders the buffer's
        writes with them, and the next tile waits only until the stores have read it."""
        row0 = row_block * self.config.tile
        col0 = col_block * self.config.tile
        if cutlass.const_expr(self.has_c):
            for e in cutlass.range_constexpr(cute.size(acc)):
                coord = tCcD[e]
                row = row0 + coord[0]
                col = col0 + coord[1]
                from_c = Float32(0.0)
                if row < m and col <= row:  # only C's lower triangle is read
                    from_c = mC[row, col, matrix].to(Float32)
                acc[e] = alpha * acc[e] + beta * from_c
        else:
            acc.store(acc.load() * alpha)

        self.buffer_free(wg_tidx, barrier_id)
        if row_block == col_block:
            self.fill_buffer(acc, tCcD, sD, _SYMMETRIC)
            self.store_buffer(
                sD, store_atom, mD_tma, matrix, row_block, col_block, wg_tidx, barrier_id
            )
        else:
            self.fill_buffer(acc, tCcD, sD, _AS_IS)
            self.store_buffer(
                sD, store_atom, mD_tma, matrix, row_block, col_block, wg_tidx, barrier_id
            )
            self.buffer_free(wg_tidx, barrier_id)
            self.fill_buffer(acc, tCcD, sD, _TRANSPOSED)
            self.store_buffer(
                sD, store_atom, mD_tma, matrix, col_block, row_block, wg_tidx, barrier_id
            )

    @cute.jit
    def fill_buffer(self, values: cute.Tensor, tCcD: cute.Tensor, sD: cute.Tensor, how: int):
        """Write this thread's tile elements, rounded once to the element type, into the
        buffer: as they are, transposed, or (a diagonal tile) the lower ones and their
        mirrors."""
        for e in cutlass.range_constexpr(cute.size(values)):
            coord = tCcD[e]
            value = values[e].to(self.element_type)
            if cutlass.const_expr(how == _AS_IS):
                sD[coord[0], coord[1]] = value
            elif cutlass.const_expr(how == _TRANSPOSED):
                sD[coord[1], coord[0]] = value
            else:
                if coord[1] <= coord[0]:
                    sD[coord[0], coord[1]] = value
                    sD[coord[1], coord[0]] = value

    @cute.jit
    def buffer_free(self, wg_tidx: Int32, barrier_id: Int32):
        """Wait until the warpgroup's earlier TMA stores have read its buffer."""
        if wg_tidx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def store_buffer(
        self,
        sD: cute.Tensor,
        store_atom: cute.CopyAtom,
        mD_tma: cute.Tensor,
        matrix: Int32,
        row_block: Int32,
        col_block: Int32,
        wg_tidx: Int32,
        barrier_id: Int32,
    ):
        """TMA-store the buffer to D's tile (row block, col block) once every thread's writes
        are visible to the async proxy."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WARPGROUP_THREADS)
        if wg_tidx == 0:
            tile = self.config.tile
            gD = cute.local_tile(mD_tma[None, None, matrix], (tile, tile), (row_block, col_block))
            tDsD, tDgD = cpasync.tma_partition(
                store_atom,
                0,
                cute.make_layout(1),
                cute.group_modes(sD, 0, 2),
                cute.group_modes(gD, 0, 2),
            )
            cute.copy(store_atom, tDsD, tDgD)
            cute.arch.cp_async_bulk_commit_group()


def compile_syrk(dtype_name: str, has_c: bool, config: Sm90TileConfig):
    """Compile the kernel for ``dtype_name`` ("float16"/"bfloat16"); the returned function takes
    ``(a_ptr, b_ptr, d_ptr, c_ptr, m, k_pad, batch, ctas, alpha, beta, stream)``."""
    kernel = SyrkSm90Kernel(ELEMENT_TYPES[dtype_name], has_c, config)
    return compile_with_placeholders(
        kernel, dtype_name, Int32(1), Int32(8), Int32(1), Int32(1), Float32(1.0), Float32(0.0)
    )


# The adapter (syrk.cute) calls these on whichever kernel module runs.
__all__ = ["ELEMENT_TYPES", "compile_syrk"]
