"""The update GEMM's Triton kernel on CPU tensors through Triton's interpreter, against float64.

Run by ``test_update_gemm_interpreted`` in a fresh interpreter with ``TRITON_INTERPRET=1``
(Triton reads it when the kernel is defined). Each case runs
``_update_gemm_triton.update_gemm_`` on a wide or a tall (transposed operands) master, with
tiles smaller than the matrix and larger than it, K a multiple of the K tile or not, and prints
one JSON line: the master's error against the float64 update and the copy's largest distance
from the master rounded, in units in the last place.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from dmuon_kernels._update_gemm_triton import DEFAULT_TILES, TileConfig, update_gemm_  # noqa: E402

SMALL_TILES = TileConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=2)
DECAY, STEP = 0.98, 0.03


def ulps(actual: torch.Tensor, expected: torch.Tensor) -> float:
    big = torch.maximum(actual.abs(), expected.abs()).to(expected.dtype)
    spacing = (torch.nextafter(big, torch.full_like(big, float("inf"))) - big).double()
    return ((actual.double() - expected.double()).abs() / spacing).max().item()


def case(n: int, m: int, tall: bool, operand_dtype, copy_dtype, tiles: TileConfig) -> dict:
    generator = torch.Generator().manual_seed(n * m)
    left = (torch.randn(n, n, generator=generator) / n**0.5).to(operand_dtype)
    X = (torch.randn(n, m, generator=generator) / m**0.5).to(operand_dtype)
    master = torch.randn((m, n) if tall else (n, m), generator=generator) * 0.02
    first, second = (X.mT, left.mT) if tall else (left, X)
    expected = DECAY * master.double() - STEP * (first.double() @ second.double())
    copy = torch.full(master.shape, float("nan"), dtype=copy_dtype)
    update_gemm_(first, second, master, copy, decay=DECAY, step=STEP, tiles=tiles)
    error = ((master.double() - expected).norm() / expected.norm()).item()
    return {
        "case": f"{'tall' if tall else 'wide'} n={n} m={m} {operand_dtype} -> {copy_dtype} "
        f"tiles {tiles.block_m}x{tiles.block_n}x{tiles.block_k}",
        "master_error": error,
        "copy_ulps": ulps(copy, master.to(copy_dtype)),
    }


def main() -> None:
    for tiles in (SMALL_TILES, DEFAULT_TILES):
        for n, m in ((40, 72), (32, 96)):  # K = 40: masked K tiles; K = 32: whole ones (small)
            for tall in (False, True):
                # fp16 operands only: the interpreter's tl.dot does not read bf16 (numpy has
                # no bf16); tests/gpu runs bf16 operands compiled.
                for copy_dtype in (torch.bfloat16, torch.float16):
                    print(
                        json.dumps(case(n, m, tall, torch.float16, copy_dtype, tiles)), flush=True
                    )


if __name__ == "__main__":
    main()
