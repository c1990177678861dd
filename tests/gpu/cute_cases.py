"""The cases the CuTe SYRK GPU tests run, and the tile configuration each one names.

Shared by tests/gpu/test_cute_gpu.py and tests/kernels/test_cute_on_cpu.py: building the names
is pure Python, so the CPU suite checks that every configuration the GPU tests ask for exists
(a missing name would only show up as a KeyError on the GPU machine otherwise).
"""

from __future__ import annotations

import math

import torch

from dmuon_kernels.syrk import cute as cute_backend
from tests.numerics import batch_dims

# (path, epilogue): the SM90 kernel with each epilogue it offers (direct stores; staged through
# a swizzled ("smem") or a plain ("smem_flat") shared-memory buffer), each on the tiling the
# adapter chooses for the shape; the SM80 kernel (direct stores only) as its path chooses.
VARIANTS = (
    (cute_backend.SM90, cute_backend.DIRECT),
    (cute_backend.SM90, cute_backend.STAGED),
    (cute_backend.SM90, cute_backend.STAGED_FLAT),
    (cute_backend.SM80, cute_backend.DIRECT),
)
VARIANT_IDS = ("sm90", "sm90_smem", "sm90_smem_flat", "sm80")

# (batch, M, K): aligned; M and K off every tile multiple; a batch; K below one k-tile; a long K
# that is not a multiple of 64; two big enough for the 128-wide tiles (padded, unpadded); tiny; a
# 4-D batch; several tiles per persistent CTA (K not a multiple of 8); a batch of 128-wide tiles
# whose M is off the tile, so one CTA's tiles span matrices; one that Hopper runs with the
# cooperative 256x128 tiling.
SHAPES = (
    (None, 256, 1024),
    (None, 200, 777),
    (3, 128, 512),
    (None, 1000, 24),
    (None, 300, 4100),
    (None, 2100, 320),
    (None, 2048, 512),
    (None, 5, 3),
    ((2, 2), 72, 96),
    (None, 4096, 200),
    (4, 1100, 72),
    (None, 8192, 40),
)


def variant_config(M: int, batch: int, device: torch.device, variant: tuple[str, str]) -> str:
    """The TILE_CONFIGS name a variant runs for ``batch`` M x M outputs on ``device``: the
    path's choice for the shape, on SM90 turned into its twin with the variant's epilogue."""
    path, epilogue = variant
    name = cute_backend.choose_config(M, batch, device, path)
    return cute_backend.with_epilogue(name, epilogue) if path == cute_backend.SM90 else name


def shape_config(shape: tuple, device: torch.device, variant: tuple[str, str]) -> str:
    """``variant_config`` for a SHAPES entry."""
    batch, M, _ = shape
    return variant_config(M, math.prod(batch_dims(batch)), device, variant)
