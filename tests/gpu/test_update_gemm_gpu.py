"""The Triton update GEMM on CUDA (``dmuon_kernels._update_gemm_triton``, [Note: the update
epilogue]): the fp32 master within fp32 accumulation of the float64 update, its copy exactly the
master rounded, for wide and tall masters, fp16 and bf16 factors; the compile ahead derives the
launch the update makes; ``final_update_`` with copies lands where cuBLAS and a copy do, and a
``dmuon.Muon`` step with either writes the owner's segments. (On the CPU:
tests/kernels/test_update_gemm_interpreted.py, tests/core/test_step_writes_segments.py.)"""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels import _fused_triton
from dmuon_kernels._update_gemm_triton import (
    DEFAULT_TILES,
    TileConfig,
    _update_gemm_kernel,
    update_gemm_,
    update_gemm_launches,
)
from dmuon_kernels.update_epilogue import final_update_
from tests.gpu.tiny_training import train
from tests.numerics import relative_error

DECAY, STEP = 0.998, 0.02
# (n, m): the factor is n x n, X n x m; 200 x 770 has no side a multiple of a tile.
SHAPES = {"square": (512, 512), "wide": (256, 1024), "odd": (200, 770), "k/v": (1024, 4096)}
SMALL_TILES = TileConfig(64, 64, 32, 4, 4, 3)


def operands(n: int, m: int, tall: bool, dtype: torch.dtype):
    generator = torch.Generator(device="cuda").manual_seed(n + m)
    left = (torch.randn(n, n, device="cuda", generator=generator) / n**0.5).to(dtype)
    X = (torch.randn(n, m, device="cuda", generator=generator) / m**0.5).to(dtype)
    master = torch.randn((m, n) if tall else (n, m), device="cuda", generator=generator) * 0.02
    first, second = (X.mT, left.mT) if tall else (left, X)
    return left, X, first, second, master


@pytest.mark.parametrize("tiles", [DEFAULT_TILES, SMALL_TILES], ids=["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_update_gemm_writes_the_exact_update_and_the_master_rounded(shape, tall, dtype, tiles):
    _, _, first, second, master = operands(*shape, tall, dtype)
    expected = DECAY * master.double() - STEP * (first.double() @ second.double())
    for copy_dtype in (torch.bfloat16, torch.float16):
        updated = master.clone()
        copy = torch.full_like(master, float("nan"), dtype=copy_dtype)
        update_gemm_(first, second, updated, copy, decay=DECAY, step=STEP, tiles=tiles)
        assert relative_error(updated.double(), expected) < 1e-6
        assert torch.equal(copy, updated.to(copy_dtype))


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
def test_final_update_with_copies_lands_where_cublas_and_a_copy_do(monkeypatch, tall):
    n, m = SHAPES["odd"]
    left, X, _, _, master = operands(n, m, tall, torch.float16)
    results = {}
    for gemm in ("triton", "cublas"):
        monkeypatch.setenv("DMUON_UPDATE_GEMM", gemm)
        updated, copy = master.clone(), torch.empty_like(master, dtype=torch.bfloat16)
        final_update_(left[None], X[None], [updated], decay=DECAY, steps=[STEP], copies=[copy])
        assert torch.equal(copy, updated.to(torch.bfloat16)), gemm
        results[gemm] = updated
    product = left.double() @ X.double()
    exact_update = -STEP * (product.mT if tall else product)
    for gemm, updated in results.items():
        update = updated.double() - DECAY * master.double()
        assert relative_error(update, exact_update) < 1e-5, gemm


def test_the_compile_ahead_derives_the_launch_the_update_makes():
    """After compiling the derived launches ahead, the updates of a wide and a tall master of
    those shapes compile nothing more."""
    device = torch.device("cuda", torch.cuda.current_device())
    rows_cols = [(1024, 4096), (4096, 1024)]
    launches = [
        launch
        for rows, cols in rows_cols
        for launch in update_gemm_launches(
            rows, cols, ns_dtype=torch.float16, copy_dtype=torch.bfloat16
        )
    ]
    _fused_triton.compile_step_ahead(device, launches)
    _fused_triton._await_compiles_ahead()
    compiled = len(_update_gemm_kernel.device_caches[device.index][0])
    for rows, cols in rows_cols:
        _, _, first, second, master = operands(1024, 4096, rows > cols, torch.float16)
        copy = torch.empty_like(master, dtype=torch.bfloat16)
        update_gemm_(first, second, master, copy, decay=DECAY, step=STEP)
    torch.cuda.synchronize()
    assert len(_update_gemm_kernel.device_caches[device.index][0]) == compiled


@pytest.mark.parametrize("gemm", ["cublas", "triton"])
def test_a_muon_step_writes_each_segment_from_its_update(monkeypatch, gemm):
    """One step of a bf16 tiny decoder from the same weights with each update GEMM: the owner's
    segments are the masters rounded (written by the step, which the publish then skips), the
    Triton kernel runs only when asked for, and the two updates agree to fp32 accumulation."""
    monkeypatch.setenv("DMUON_UPDATE_GEMM", gemm)
    initial, _, _ = train(monkeypatch, epilogue=True, steps=0)
    masters, segments, kernels = train(monkeypatch, epilogue=True, steps=1, profiled=True)
    assert any("_update_gemm_kernel" in name for name in kernels) == (gemm == "triton"), kernels
    for name in masters:
        assert torch.equal(segments[name], masters[name].to(torch.bfloat16)), name
    monkeypatch.setenv("DMUON_UPDATE_GEMM", "cublas")
    reference, _, _ = train(monkeypatch, epilogue=True, steps=1)
    for name in masters:
        update, expected = masters[name] - initial[name], reference[name] - initial[name]
        assert relative_error(update, expected) < 1e-4, name
