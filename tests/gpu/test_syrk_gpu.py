"""Every SYRK backend on the GPU against an fp32 product, with quack's relative rule: a kernel's
error against the fp32 product may be at most twice cuBLAS's own error on the same inputs (plus
a quarter of the dtype's rounding unit, so two correctly rounding kernels never fail on a draw).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dmuon_kernels import NewtonSchulz, get_ns_backend
from dmuon_kernels.syrk import (
    autotune,
    get_backend,
    matmul,
    resolve_kernel,
    symmetric_product,
    syrk,
)
from dmuon_kernels.syrk.cache import cache_file_name
from tests.numerics import assert_within_twice_cublas, fp32_product, relative_error
from tests.numerics import syrk_operands as operands

DTYPES = (torch.float16, torch.bfloat16)
# (batch, M, K): aligned, M and K not multiples of 8 (padding path), a batch, a tall-ish one.
SHAPES = ((None, 256, 1024), (None, 200, 777), (3, 128, 512), (None, 1024, 256))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha_beta", [(1.0, 0.0), (0.75, -1.25)], ids=["plain", "with_c"])
def test_quack_syrk_is_within_twice_cublas_error_of_fp32(needs_quack, shape, dtype, alpha_beta):
    alpha, beta = alpha_beta
    A, C = operands(*shape, dtype)
    C = C if beta else None
    reference = fp32_product(A, A.mT, C, alpha, beta)
    out = syrk(A, C=C, alpha=alpha, beta=beta, kernel="quack")
    cublas_out = syrk(A, C=C, alpha=alpha, beta=beta, kernel="cublas")
    assert out.shape == cublas_out.shape and out.dtype == dtype
    assert torch.equal(out, out.mT), "quack mirrors its upper triangle: exactly symmetric"
    assert_within_twice_cublas(out, cublas_out, reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quack_accepts_transposed_views(needs_quack, dtype):
    X, _ = operands(None, 768, 256, dtype, seed=1)  # tall: Newton-Schulz uses Xᵀ·X = syrk(X.mT)
    A = X.mT  # (256, 768), M-contiguous
    reference = fp32_product(A, A.mT, None, 1.0, 0.0)
    assert_within_twice_cublas(syrk(A, kernel="quack"), syrk(A, kernel="cublas"), reference, dtype)


@pytest.mark.parametrize("batch", [None, 4], ids=["single", "batched"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quack_symmetric_product_is_within_twice_cublas_error(needs_quack, batch, dtype):
    S, C = operands(batch, 512, 512, dtype, seed=2)
    S = ((S.float() + S.float().mT) / 2).to(dtype)
    R = S.float() @ S.float()
    B = (0.5 * S.float() + 0.1 * R).to(dtype)  # a polynomial in S: S·B is symmetric
    reference = fp32_product(S, B, C, 1.0, 0.5)
    out = symmetric_product(S, B, C=C, beta=0.5, kernel="quack")
    cublas_out = symmetric_product(S, B, C=C, beta=0.5, kernel="cublas")
    # tiles off the diagonal are mirrored; inside diagonal tiles both triangles are computed, and
    # S·B of rounded S, B is symmetric only up to rounding
    assert relative_error(out, out.mT.float()) <= 4 * relative_error(cublas_out, reference)
    assert_within_twice_cublas(out, cublas_out, reference, dtype)


@pytest.mark.parametrize(
    "shape", [(None, 256, 256, 1024), (4, 128, 128, 512), (None, 200, 200, 777)], ids=str
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_c", [False, True], ids=["plain", "with_c"])
def test_quack_matmul_is_within_twice_cublas_error(needs_quack, shape, dtype, with_c):
    batch, M, K, N = shape
    lead = () if batch is None else (batch,)
    generator = torch.Generator(device="cuda").manual_seed(7)
    A, B, C = (
        torch.randn((*lead, *dims), device="cuda", generator=generator).mul_(K**-0.25).to(dtype)
        for dims in ((M, K), (K, N), (M, N))
    )
    C, alpha, beta = (C, 1.0, 0.8) if with_c else (None, 1.0, 0.0)
    reference = fp32_product(A, B, C, alpha, beta)
    out = matmul(A, B, C=C, alpha=alpha, beta=beta, kernel="quack")
    cublas_out = matmul(A, B, C=C, alpha=alpha, beta=beta, kernel="cublas")
    assert out.shape == cublas_out.shape
    assert_within_twice_cublas(out, cublas_out, reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_auto_gives_exactly_the_chosen_backends_result(dtype):
    A, C = operands(None, 512, 2048, dtype, seed=3)
    for kwargs in ({}, {"C": C, "alpha": 0.5, "beta": -1.0}):
        out = syrk(A, kernel="auto", **kwargs)
        chosen = resolve_kernel("auto", A, kwargs.get("C"))
        expected = get_backend(chosen).syrk(
            A, kwargs.get("C"), kwargs.get("alpha", 1.0), kwargs.get("beta", 0.0)
        )
        assert torch.equal(out, expected), chosen


def test_auto_verdicts_are_written_to_the_cache_folder_per_gpu_model(needs_quack):
    A, _ = operands(None, 2048, 8192, torch.float16, seed=4)  # MIN_TUNED_FLOP exactly: tuned
    syrk(A, kernel="auto")
    path = Path(os.environ["DMUON_CACHE_DIR"]) / cache_file_name(autotune.gpu_model(A.device))
    verdicts = json.loads(path.read_text())["verdicts"]
    mine = {
        v["candidate"]: v
        for v in verdicts.values()
        if v["shape"] == [2048, 8192] and v["dtype"] == "float16"
    }
    assert "quack" in mine  # the SM90 prior's pick at this edge, tuned first
    if mine["quack"]["backend"] == "quack" and torch.cuda.get_device_capability() == (9, 0):
        assert set(mine) == {"quack"}  # it won: cute's kernel was not compiled for it
    for candidate, verdict in mine.items():
        assert verdict["backend"] in (candidate, "cublas")
        assert verdict["candidate_error"] <= 2 * verdict["cublas_error"] + 1e-4


def test_a_problem_under_min_tuned_flop_runs_cublas_under_auto_without_a_verdict(needs_quack):
    A, _ = operands(None, 256, 768, torch.float16, seed=5)
    assert autotune.SyrkProblem.of(A, None).flop < autotune.MIN_TUNED_FLOP
    out = syrk(A, kernel="auto")
    assert resolve_kernel("auto", A) == "cublas"
    assert torch.equal(out, get_backend("cublas").syrk(A, None, 1.0, 0.0))
    path = Path(os.environ["DMUON_CACHE_DIR"]) / cache_file_name(autotune.gpu_model(A.device))
    verdicts = json.loads(path.read_text())["verdicts"] if path.exists() else {}
    assert not [v for v in verdicts.values() if v["shape"] == [256, 768]]


def test_kernel_quack_constructs_and_is_reported(needs_quack):
    ns = NewtonSchulz(kernel="quack")
    assert ns.kernel == "quack"
    assert get_ns_backend(ns).startswith("Gram NS · kernel=quack (SM")
    assert "Tri Dao quack" in get_ns_backend(ns)


def test_quack_refuses_fp32_with_the_fix(needs_quack):
    from dmuon_kernels.syrk import quack

    with pytest.raises(ValueError, match=r"takes float16 or bfloat16, got A\.dtype=torch\.float32"):
        quack.syrk(torch.zeros(8, 8, device="cuda"), None, 1.0, 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [None, 2], ids=["single", "batched"])
def test_cublas_block_assembled_syrk_is_as_accurate_as_the_full_product(dtype, batch):
    from dmuon_kernels.syrk import cublas

    M, K = 4096, 8192  # large enough for the backend to assemble block columns
    blocks = cublas.symmetric_block_count(M, K, batch or 1)
    assert blocks > 1
    A, C = operands(batch, M, K, dtype, seed=5)
    A3, C3 = A.reshape(-1, M, K), C.reshape(-1, M, M)
    full = torch.baddbmm(C3, A3, A3.mT, beta=-1.25, alpha=0.75).reshape(C.shape)
    out = syrk(A, C=C, alpha=0.75, beta=-1.25, kernel="cublas")
    assert_within_twice_cublas(out, full, fp32_product(A, A.mT, C, 0.75, -1.25), dtype)
    edge = cublas.block_edges(M, blocks)[1]
    assert torch.equal(out[..., :edge, edge:], out[..., edge:, :edge].mT)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cublas_block_assembled_symmetric_product_is_as_accurate_as_the_full_product(dtype):
    from dmuon_kernels.syrk import cublas

    batch, M = 2, 4096
    assert cublas.symmetric_block_count(M, M, batch) > 1
    _, C = operands(batch, M, 8, dtype, seed=6)
    Z, Q = C, symmetric_product(C, C, kernel="cublas")  # two polynomials in C: they commute
    out = symmetric_product(Z, Q, C=C, beta=0.5, kernel="cublas")
    full = torch.baddbmm(C, Z, Q, beta=0.5)
    assert_within_twice_cublas(out, full, fp32_product(Z, Q, C, 1.0, 0.5), dtype)
