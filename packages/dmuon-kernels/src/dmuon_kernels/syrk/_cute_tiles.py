"""The tilings of the CuTe DSL SYRK kernels: one config class per kernel, and the named ones.

Owns ``Sm80TileConfig`` (the warp-MMA kernel, ``syrk._cute_kernel``) and ``Sm90TileConfig``
(the wgmma kernel, ``syrk._cute_sm90_kernel``), the checks a tiling must pass to compile, and
``TILE_CONFIGS``, every tiling the adapter (``syrk.cute``) can run by name. The kernel modules
compile exactly these objects, so a tiling is written once. Plain standard library: the adapter
and the CPU tests use it without nvidia-cutlass-dsl; it must not import cutlass, torch or
anything from this package. Which tiling runs for a shape is the adapter's choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

SM80 = "sm80"
SM90 = "sm90"

_WARP_THREADS = 32
WARPGROUP_THREADS = 128
# TMA strides are multiples of 16 bytes: 8 elements of fp16/bf16 (the SM90 kernel's K_pad, and
# M for a staged epilogue's stores).
TMA_ALIGNMENT_ELEMENTS = 8

# SM90 epilogues. "direct": each thread stores its elements and their mirrors to global memory;
# staged: the tile goes through a shared-memory buffer and leaves by TMA stores, the buffer
# swizzled in 128-byte atoms ("smem") or plain row-major ("smem_flat"). TMA needs D's rows 16
# bytes apart, so a staged epilogue needs M a multiple of 8.
DIRECT = "direct"
STAGED = "smem"
STAGED_FLAT = "smem_flat"
STAGED_EPILOGUES = (STAGED, STAGED_FLAT)
EPILOGUES = (DIRECT, *STAGED_EPILOGUES)


@dataclass(frozen=True, slots=True)
class Sm80TileConfig:
    """A tiling of the SM80 kernel: tile x tile CTA tiles, k-tile, pipeline stages, warp grid."""

    path: ClassVar[str] = SM80
    tile: int
    tile_k: int
    stages: int
    warps_m: int
    warps_n: int

    def __post_init__(self) -> None:
        if self.tile_k % 64 != 0:
            raise ValueError(f"tile_k must be a multiple of 64 (one swizzle atom), got {self}")

    @property
    def threads(self) -> int:
        return _WARP_THREADS * self.warps_m * self.warps_n


@dataclass(frozen=True, slots=True)
class Sm90TileConfig:
    """A tiling of the SM90 kernel: square tile, k-tile, shared-memory ring depth, consumer
    warpgroups, cooperative 2·tile x tile CTA tiles or not, and the epilogue."""

    path: ClassVar[str] = SM90
    tile: int
    tile_k: int
    stages: int
    consumers: int = 2  # 2: ping-pong warpgroups; 1: one consumer warpgroup
    cooperative: bool = False  # both consumers on one 2·tile x tile output tile
    epilogue: str = DIRECT  # one of EPILOGUES

    def __post_init__(self) -> None:
        if self.tile % 64 != 0 or self.tile_k % 64 != 0:
            raise ValueError(
                f"tile and tile_k must be multiples of 64 (wgmma rows, one 128-byte swizzle "
                f"atom), got {self}"
            )
        if self.consumers not in (1, 2):
            raise ValueError(f"consumers must be 1 or 2, got {self}")
        if self.cooperative and self.consumers != 2:
            raise ValueError(f"the cooperative kernel has two consumers, got {self}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {self}")

    @property
    def threads(self) -> int:
        """A producer warpgroup and the consumers."""
        return WARPGROUP_THREADS * (1 + self.consumers)

    @property
    def halves(self) -> int:
        """Row halves of a CTA tile: operand tiles of A per stage besides the column block's."""
        return 2 if self.cooperative else 1

    @property
    def rows(self) -> int:
        """Rows of one CTA tile."""
        return self.halves * self.tile

    def triangle_tiles(self, M: int) -> int:
        """CTA tiles of one M x M lower triangle (a cooperative row block has 2r + 2)."""
        row_blocks = -(-M // self.rows)
        return row_blocks * (row_blocks + 1) * self.halves // 2


TileConfig = Sm80TileConfig | Sm90TileConfig

# Every tiling the adapter runs by name: what ``choose_config`` picks per shape class, the
# direct twins a staged epilogue falls back to, and the SM90 tilings with each epilogue (the
# GPU tests run all of them).
TILE_CONFIGS: dict[str, TileConfig] = {
    "128x128_4warps": Sm80TileConfig(tile=128, tile_k=64, stages=3, warps_m=2, warps_n=2),
    "64x64_4warps": Sm80TileConfig(tile=64, tile_k=64, stages=4, warps_m=2, warps_n=2),
    "sm90_128x128": Sm90TileConfig(tile=128, tile_k=64, stages=5),
    "sm90_256x128": Sm90TileConfig(tile=128, tile_k=64, stages=4, cooperative=True),
    "sm90_64x64": Sm90TileConfig(tile=64, tile_k=64, stages=8),
    # The same tilings with a staged epilogue (one tile x tile output buffer per consumer in
    # shared memory, so the cooperative ring has a stage less to fit in 227 KiB).
    "sm90_128x128_smem": Sm90TileConfig(tile=128, tile_k=64, stages=5, epilogue=STAGED),
    "sm90_256x128_smem": Sm90TileConfig(
        tile=128, tile_k=64, stages=3, cooperative=True, epilogue=STAGED
    ),
    "sm90_64x64_smem": Sm90TileConfig(tile=64, tile_k=64, stages=8, epilogue=STAGED),
    "sm90_128x128_smem_flat": Sm90TileConfig(tile=128, tile_k=64, stages=5, epilogue=STAGED_FLAT),
    "sm90_256x128_smem_flat": Sm90TileConfig(
        tile=128, tile_k=64, stages=3, cooperative=True, epilogue=STAGED_FLAT
    ),
    "sm90_64x64_smem_flat": Sm90TileConfig(tile=64, tile_k=64, stages=8, epilogue=STAGED_FLAT),
}
