"""The CuTe DSL SYRK kernels ("cute") on the GPU against an fp32 product, with quack's rule: the
error against the fp32 product may be at most twice cuBLAS's own error on the same inputs (plus a
quarter of the dtype's rounding unit, so two correctly rounding kernels never fail on a draw).

Both paths are tested wherever they run: the SM90 kernel (wgmma, TMA; compute capability 9.x,
where it is the default) with each epilogue (direct stores, or staged in a swizzled or a plain
shared-memory buffer and stored with TMA), on the tiling the adapter picks for the shape, and the
SM80 kernel (forced with ``path="sm80"`` on Hopper). The cases and the configuration names they
build live in tests/gpu/cute_cases.py, which the CPU suite checks. Skipped without CUDA, without
nvidia-cutlass-dsl, or on a GPU older than SM80.
"""

from __future__ import annotations

import math

import pytest
import torch

from dmuon_kernels.syrk import (
    autotune,
    backend_availability,
    get_backend,
    symmetric_product,
    syrk,
)
from dmuon_kernels.syrk import cute as cute_backend
from tests.gpu.cute_cases import SHAPES, VARIANT_IDS, VARIANTS, variant_config
from tests.numerics import assert_within_twice_cublas, fp32_product
from tests.numerics import syrk_operands as operands

DTYPES = (torch.float16, torch.bfloat16)
STAGED_CONFIGS = sorted(
    n
    for n, t in cute_backend.TILE_CONFIGS.items()
    if getattr(t, "epilogue", cute_backend.DIRECT) != cute_backend.DIRECT
)


@pytest.fixture
def needs_cute():
    available, reason = (
        backend_availability("cute")
        if torch.cuda.is_available()
        else (
            False,
            "no CUDA",
        )
    )
    if not available:
        pytest.skip(f"cute unavailable: {reason}")


def skip_unless_path_runs(path):
    if path == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the SM90 kernel needs compute capability 9.x")


def run_cute(A, C, alpha, beta, variant):
    """The SM80 kernel as ``path="sm80"`` runs it; the SM90 kernel with the variant's epilogue
    on the tiling the adapter picks for the shape (``cute_cases.variant_config``)."""
    if variant[0] == cute_backend.SM80:
        return cute_backend.syrk(A, C, alpha, beta, path=cute_backend.SM80)
    config = variant_config(A.shape[-2], math.prod(A.shape[:-2]), A.device, variant)
    return cute_backend.syrk(A, C, alpha, beta, config=config)


def run_cute_product(S, B, C, alpha, beta, variant):
    """``run_cute`` for ``symmetric_product``."""
    if variant[0] == cute_backend.SM80:
        return cute_backend.symmetric_product(S, B, C, alpha, beta, path=cute_backend.SM80)
    config = variant_config(S.shape[-2], math.prod(S.shape[:-2]), S.device, variant)
    return cute_backend.symmetric_product(S, B, C, alpha, beta, config=config)


def commuting_pair(batch, M, dtype, seed):
    """S symmetric and B = 0.5·S + 0.1·S², symmetrised after rounding (the kernels read B's
    transpose), so S·B is symmetric; and a symmetric C."""
    S, C = operands(batch, M, M, dtype, seed=seed)
    S = S.float()
    S = (S + S.mT) / 2
    B = 0.5 * S + 0.1 * (S @ S)
    return S.to(dtype), ((B + B.mT) / 2).to(dtype), C


def assert_complete_symmetric_and_accurate(out, cublas_out, reference, dtype):
    """Every element written, exactly symmetric, within twice cuBLAS's error of ``reference``."""
    assert out.shape == cublas_out.shape and out.dtype == dtype
    assert bool(out.isfinite().all()), "an output element was never written"
    assert torch.equal(out, out.mT), "cute writes each element once and mirrors it"
    assert_within_twice_cublas(out, cublas_out, reference, dtype)


def poison_allocator(numel, dtype):
    """Leave NaN in the caching allocator's next block of this size, so an output element the
    kernel never writes shows up as NaN instead of a lucky zero."""
    poison = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del poison


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha_beta", [(1.0, 0.0), (0.75, -1.25)], ids=["plain", "with_c"])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_cute_syrk_is_within_twice_cublas_error_of_fp32(
    needs_cute, variant, shape, dtype, alpha_beta
):
    skip_unless_path_runs(variant[0])
    alpha, beta = alpha_beta
    A, C = operands(*shape, dtype)
    C = C if beta else None
    reference = fp32_product(A, A.mT, C, alpha, beta)
    cublas_out = syrk(A, C=C, alpha=alpha, beta=beta, kernel="cublas")
    poison_allocator(cublas_out.numel(), dtype)
    out = run_cute(A, C, alpha, beta, variant)
    assert_complete_symmetric_and_accurate(out, cublas_out, reference, dtype)


# (batch, M): aligned; M off 8 (the direct epilogue, K padded to 8); a batch; a 4-D batch;
# 128-wide tiles several per persistent CTA; Hopper's cooperative 256x128 tiling.
PRODUCT_SHAPES = ((None, 512), (None, 200), (3, 256), ((2, 2), 72), (None, 2056), (None, 8192))


@pytest.mark.parametrize("shape", PRODUCT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha_beta", [(1.0, 0.0), (0.75, -1.25)], ids=["plain", "with_c"])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_cute_symmetric_product_is_within_twice_cublas_error_of_fp32(
    needs_cute, variant, shape, dtype, alpha_beta
):
    skip_unless_path_runs(variant[0])
    alpha, beta = alpha_beta
    S, B, C = commuting_pair(*shape, dtype, seed=3)
    C = C if beta else None
    reference = fp32_product(S, B, C, alpha, beta)
    cublas_out = symmetric_product(S, B, C=C, alpha=alpha, beta=beta, kernel="cublas")
    poison_allocator(cublas_out.numel(), dtype)
    out = run_cute_product(S, B, C, alpha, beta, variant)
    assert_complete_symmetric_and_accurate(out, cublas_out, reference, dtype)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_operands_in_other_layouts_and_dtypes_give_the_same_bits(needs_cute, variant):
    # the launch reads contiguous, aligned operands in place and copies the others
    skip_unless_path_runs(variant[0])
    S, B, C = commuting_pair(2, 264, torch.float16, seed=8)
    expected = run_cute_product(S, B, C, 0.5, 1.5, variant)
    offset = torch.empty(2 * 264 * 264 + 1, dtype=torch.float16, device="cuda")[1:]
    misaligned = offset.view(2, 264, 264).copy_(S)  # 2 bytes past a 16-byte boundary
    assert torch.equal(run_cute_product(misaligned, B, C, 0.5, 1.5, variant), expected)
    assert torch.equal(run_cute_product(S, B.mT, C.mT, 0.5, 1.5, variant), expected)
    assert torch.equal(run_cute_product(S, B, C.float(), 0.5, 1.5, variant), expected)
    assert torch.equal(run_cute_product(S, B, C[0], 0.5, 1.5, variant)[0], expected[0])
    A, C = operands(2, 264, 100, torch.float16, seed=9)
    expected = run_cute(A, C, 0.5, 1.5, variant)
    assert torch.equal(run_cute(A.mT.contiguous().mT, C.mT, 0.5, 1.5, variant), expected)


def test_cute_symmetric_product_reads_b_not_a_twice(needs_cute):
    # S·I = S: a kernel that multiplied S by itself would return S² instead
    S, _, _ = commuting_pair(2, 384, torch.float16, seed=4)
    identity = torch.eye(384, device="cuda", dtype=torch.float16).expand(2, 384, 384)
    assert torch.equal(cute_backend.symmetric_product(S, identity), S)
    assert torch.equal(cute_backend.symmetric_product(identity.contiguous(), S), S)


def test_auto_tunes_cute_for_symmetric_products(needs_cute, tmp_path):
    tuner = autotune.SyrkAutotuner(tmp_path)
    S, B, C = commuting_pair(None, 4096, torch.float16, seed=6)
    problem = autotune.SyrkProblem.of(S, C, "symmetric_product", B)
    assert "cute" in tuner.contenders("quack", "symmetric_product")
    verdict = tuner.tune("cute", problem, S.device)
    assert verdict.backend in ("cute", "cublas")
    assert verdict.candidate_error is not None, verdict.reason
    assert verdict.candidate_error <= 2 * verdict.cublas_error + 1e-4


@pytest.mark.parametrize("config", sorted(cute_backend.TILE_CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_tile_configuration_is_within_twice_cublas_error(needs_cute, config, dtype):
    tiles = cute_backend.TILE_CONFIGS[config]
    skip_unless_path_runs(tiles.path)
    # M off every tile and large enough that persistent CTAs take several tiles; K off 8; a
    # staged epilogue needs M a multiple of 8 (else its direct twin runs)
    M = 4104 if getattr(tiles, "epilogue", "direct") != "direct" else 4100
    assert cute_backend.runnable_config(config, M) == config
    A, C = operands(None, M, 130, dtype, seed=5)
    reference = fp32_product(A, A.mT, C, 0.5, 2.0)
    cublas_out = syrk(A, C=C, alpha=0.5, beta=2.0, kernel="cublas")
    poison_allocator(cublas_out.numel(), dtype)
    out = cute_backend.syrk(A, C, 0.5, 2.0, config=config)
    assert bool(out.isfinite().all())
    assert torch.equal(out, out.mT)
    assert_within_twice_cublas(out, cublas_out, reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_cute_accepts_transposed_views(needs_cute, variant, dtype):
    skip_unless_path_runs(variant[0])
    X, _ = operands(None, 768, 200, dtype, seed=1)  # tall: Newton-Schulz uses Xᵀ·X = syrk(X.mT)
    A = X.mT  # (200, 768), M-contiguous
    reference = fp32_product(A, A.mT, None, 1.0, 0.0)
    out = run_cute(A, None, 1.0, 0.0, variant)
    assert torch.equal(out, out.mT)
    assert_within_twice_cublas(out, syrk(A, kernel="cublas"), reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_nan_and_inf_in_a_propagate_like_cublas(needs_cute, variant, dtype):
    skip_unless_path_runs(variant[0])
    A, _ = operands(None, 160, 96, dtype, seed=2)
    A[3, 10] = float("nan")
    A[70, 5] = float("inf")
    out, expected = run_cute(A, None, 1.0, 0.0, variant), syrk(A, kernel="cublas")
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.isposinf(), expected.isposinf())
    assert torch.equal(out.isneginf(), expected.isneginf())
    assert bool(out[3].isnan().all()) and bool(out[70, 70].isposinf())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_nan_in_c_propagates_only_when_beta_is_nonzero(needs_cute, variant, dtype):
    skip_unless_path_runs(variant[0])
    A, C = operands(None, 96, 64, dtype, seed=3)
    C[7, 40] = C[40, 7] = float("nan")
    assert not bool(run_cute(A, C, 1.0, 0.0, variant).isnan().any())
    out = run_cute(A, C, 1.0, 0.5, variant)
    expected = syrk(A, C=C, beta=0.5, kernel="cublas")
    assert torch.equal(out.isnan(), expected.isnan())
    assert bool(out[7, 40].isnan()) and bool(out[40, 7].isnan())


def test_kernel_cute_sm80_is_the_same_kernel(needs_cute):
    A, _ = operands(None, 192, 256, torch.float16, seed=4)
    assert torch.equal(syrk(A, kernel="cute_sm80"), syrk(A, kernel="cute"))
    assert torch.equal(syrk(A, kernel="cute"), get_backend("cute").syrk(A, None, 1.0, 0.0))


def test_a_warm_process_does_not_recompile_for_new_shapes_of_a_known_class(needs_cute):
    A, _ = operands(None, 96, 128, torch.float16, seed=6)
    syrk(A, kernel="cute")
    compiled = dict(cute_backend._compiled)
    for M, K in ((100, 64), (64, 1000), (130, 72)):
        B, _ = operands(None, M, K, torch.float16, seed=M)
        assert cute_backend.shape_class(M, 1, B.device) == "small"
        syrk(B, kernel="cute")
    assert cute_backend._compiled == compiled


def test_hopper_runs_the_sm90_kernel_by_default_and_says_so(needs_cute):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("checks the Hopper default")
    assert "SM90 wgmma + TMA" in backend_availability("cute")[1]
    device = torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    assert cute_backend.choose_config(640, 1, device) == "sm90_64x64"  # fewer tiles than SMs
    assert cute_backend.choose_config(4096, 1, device) == "sm90_128x128_smem_flat"
    if sm_count == 132:  # 1056 tiles of 256x128 are 8 even rounds on an H100/H200
        assert cute_backend.choose_config(8192, 1, device) == "sm90_256x128_smem_flat"
    assert cute_backend.choose_config(4096, 1, device, "sm80") == "128x128_4warps"


def test_the_sm90_and_sm80_kernels_agree_to_rounding(needs_cute):
    skip_unless_path_runs("sm90")
    A, C = operands(None, 1500, 700, torch.float16, seed=9)
    sm90 = run_cute(A, C, 0.5, 1.5, ("sm90", "direct"))
    sm80 = run_cute(A, C, 0.5, 1.5, ("sm80", "direct"))
    reference = fp32_product(A, A.mT, C, 0.5, 1.5)
    assert_within_twice_cublas(sm90, sm80, reference, torch.float16)


@pytest.mark.parametrize("config", STAGED_CONFIGS)
def test_the_staged_epilogue_writes_the_same_bits_as_the_direct_one(needs_cute, config):
    skip_unless_path_runs("sm90")
    twin = cute_backend.with_epilogue(config, cute_backend.DIRECT)
    # a batch; M a multiple of 8 but off the tile (TMA clips the edge tiles); with C
    A, C = operands(2, 1000, 200, torch.float16, seed=11)
    poison_allocator(C.numel(), torch.float16)
    staged = cute_backend.syrk(A, C, 0.5, 1.5, config=config)
    direct = cute_backend.syrk(A, C, 0.5, 1.5, config=twin)
    assert torch.equal(staged, direct)
    plain = cute_backend.syrk(A, None, 2.0, 0.0, config=config)
    assert torch.equal(plain, cute_backend.syrk(A, None, 2.0, 0.0, config=twin))


def test_autotune_cross_check_accepts_cute(needs_cute, tmp_path):
    tuner = autotune.SyrkAutotuner(tmp_path)
    A, C = operands(None, 512, 1024, torch.float16, seed=7)
    for c in (None, C):
        problem = autotune.SyrkProblem.of(A, c)
        verdict = tuner.tune("cute", problem, A.device)
        assert verdict.backend in ("cute", "cublas")
        assert verdict.candidate_error is not None, verdict.reason
        assert verdict.candidate_error <= 2 * verdict.cublas_error + 1e-4


def test_a_forced_path_that_disagrees_with_the_config_is_refused(needs_cute):
    A, _ = operands(None, 64, 64, torch.float16)
    with pytest.raises(ValueError, match=r"config 'sm90_128x128' belongs to path 'sm90'"):
        cute_backend.syrk(A, config="sm90_128x128", path="sm80")


def test_cute_refuses_fp32_with_the_fix(needs_cute):
    with pytest.raises(ValueError, match=r"takes float16 or bfloat16, got A.dtype=torch.float32"):
        cute_backend.syrk(torch.ones(8, 8, device="cuda"))
