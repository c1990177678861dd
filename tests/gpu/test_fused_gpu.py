"""The Triton step kernels against the torch fallbacks (run on CPU copies of the same data).

Bounds: fp32 buffers and masters within 1e-6 of the fallback (the kernels may fuse a
multiply-add); a Newton-Schulz input within the rounding of its dtype (the fused first pass rounds
each value twice, at most one unit in the last place apart from the fallback's single rounding).
"""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels import NewtonSchulz, newton_schulz, reference
from dmuon_kernels.fused import (
    muon_apply_update_,
    muon_apply_updates_,
    muon_momentum_,
    muon_normalize,
    muon_normalized_inputs_,
    normalize_frobenius,
)
from tests.kernels.ns_matrices import (
    LOW_PRECISION_RATIO,
    SPECTRUM_CASES,
    matrix_with_spectrum,
    plain_loop_error,
)
from tests.numerics import momentum_inputs, relative_error

MOMENTUM = 0.95
SHAPES = ((1024, 4096), (333, 517), (4096, 1024))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("first_step", [True, False], ids=["first", "later"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_momentum_matches_the_fallback(
    needs_triton, shape, nesterov, first_step, grad_dtype
):
    grad, buf = momentum_inputs(shape, grad_dtype)
    buf_gpu = buf.cuda()
    update, sq_norm = muon_momentum_(grad.cuda(), buf_gpu, MOMENTUM, nesterov, first_step)
    ref_update, ref_sq = muon_momentum_(grad, buf, MOMENTUM, nesterov, first_step)
    assert relative_error(buf_gpu, buf) < 1e-6
    assert relative_error(update, ref_update) < 1e-6
    assert sq_norm.dtype == torch.float64
    assert sq_norm.item() == pytest.approx(ref_sq.item(), rel=1e-6)


def test_triton_squared_norm_is_deterministic(needs_triton):
    grad, buf = (t.cuda() for t in momentum_inputs((2048, 2048), seed=1))
    sums = {muon_momentum_(grad, buf.clone(), MOMENTUM, True, False)[1].item() for _ in range(5)}
    assert len(sums) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("transposed_out", [False, True], ids=["contiguous", "transposed"])
def test_triton_normalize_matches_the_fallback(needs_triton, dtype, transposed_out):
    update = torch.randn(1000, 300, generator=torch.Generator().manual_seed(2))
    sq_norm = update.double().square().sum()
    out = torch.empty(300, 1000, dtype=dtype, device="cuda").mT if transposed_out else None
    result = muon_normalize(update.cuda(), sq_norm.cuda(), dtype, out=out)
    expected = muon_normalize(update, sq_norm, dtype)
    assert result.dtype == dtype
    # both round one fp32 quotient to `dtype`: at most one unit apart
    assert torch.allclose(
        result.float().cpu(), expected.float(), rtol=torch.finfo(dtype).eps, atol=0
    )
    recomputed = muon_normalize(update.cuda(), None, dtype)  # the norm taken on the GPU
    assert torch.allclose(
        recomputed.float().cpu(), expected.float(), rtol=torch.finfo(dtype).eps, atol=0
    )


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_triton_normalized_inputs_of_a_batch_match_the_fallback(
    needs_triton, shape, nesterov, dtype
):
    rows, cols = shape
    pairs = [momentum_inputs(shape, seed=seed) for seed in range(3)]
    grads = [g * scale for (g, _), scale in zip(pairs, (2.0**70, 1.0, 2.0**-70))]
    momenta = [b * scale for (_, b), scale in zip(pairs, (2.0**70, 1.0, 2.0**-70))]
    first_steps = [False, True, False]
    # as the optimizer lays it out: rows <= cols, tall matrices transposed
    out_shape = (3, min(rows, cols), max(rows, cols))
    momenta_gpu = [b.cuda() for b in momenta]
    out = torch.empty(out_shape, dtype=dtype, device="cuda")
    muon_normalized_inputs_(
        [g.cuda() for g in grads], momenta_gpu, first_steps, MOMENTUM, nesterov, out
    )
    expected = torch.empty(out_shape, dtype=dtype)
    muon_normalized_inputs_(grads, momenta, first_steps, MOMENTUM, nesterov, expected)
    assert out.isfinite().all()
    for gpu, cpu in zip(momenta_gpu, momenta):
        assert relative_error(gpu, cpu) < 1e-6
    bound = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    for index in range(3):
        if not expected[index].any():
            # The 2^-70 gradient: its norm is far below eps = 1e-7, so u / (||u|| + eps) is of
            # order 1e-14 and underflows fp16 to zero, on both paths.
            assert not out[index].any()
            continue
        assert relative_error(out[index], expected[index]) < bound


@pytest.mark.parametrize("ortho_layout", ["contiguous", "transposed"])
def test_triton_apply_update_matches_the_fallback(needs_triton, ortho_layout):
    generator = torch.Generator().manual_seed(4)
    master = torch.randn(768, 2048, generator=generator)
    if ortho_layout == "transposed":
        ortho = torch.randn(2048, 768, generator=generator).half().mT
    else:
        ortho = torch.randn(768, 2048, generator=generator).half()
    master_gpu = master.cuda()
    muon_apply_update_(master_gpu, ortho.cuda(), 0.02, 0.1, 0.2 * 2048**0.5)
    muon_apply_update_(master, ortho, 0.02, 0.1, 0.2 * 2048**0.5)
    assert relative_error(master_gpu, master) < 1e-6


def test_triton_apply_updates_of_a_batch_match_the_fallback(needs_triton):
    generator = torch.Generator().manual_seed(5)
    masters = [torch.randn(2048, 768, generator=generator) for _ in range(3)]
    ns_output = torch.randn(3, 768, 2048, generator=generator).half()  # tall: transposed
    masters_gpu = [m.cuda() for m in masters]
    muon_apply_updates_(masters_gpu, list(ns_output.cuda().mT), 0.02, 0.1, 0.2 * 2048**0.5)
    muon_apply_updates_(masters, list(ns_output.mT), 0.02, 0.1, 0.2 * 2048**0.5)
    for gpu, cpu in zip(masters_gpu, masters):
        assert relative_error(gpu, cpu) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["single", "batched", "transposed"])
def test_triton_normalize_frobenius_matches_the_fallback(needs_triton, dtype, layout):
    generator = torch.Generator().manual_seed(5)
    shape = {"single": (300, 1000), "batched": (4, 300, 1000), "transposed": (1000, 300)}[layout]
    X = torch.randn(shape, generator=generator)
    if layout == "transposed":
        X = X.mT  # Newton-Schulz's view of a tall matrix
    out = normalize_frobenius(X.cuda(), eps=1e-7, dtype=dtype)
    expected = normalize_frobenius(X, eps=1e-7, dtype=dtype)
    assert out.is_contiguous()
    assert torch.allclose(out.float().cpu(), expected.float(), rtol=torch.finfo(dtype).eps, atol=0)


HUGE_SCALES = (2.0**64, 2.0**124)  # the squared norm, then the norm itself, over fp32's range


@pytest.mark.parametrize("backend", ["gram", "direct"])
def test_a_huge_input_orthogonalises_on_the_gpu_exactly_as_its_unscaled_self(needs_triton, backend):
    # eps=0: the quotient is scale-free and the power-of-two scaling exact, so the normalised
    # input, and so every later bit, is the same: whole-call graphs, batches, strided inputs.
    rows, cols, spectrum = SPECTRUM_CASES["wide"]
    G = matrix_with_spectrum(rows, cols, spectrum).cuda()
    layouts = (
        lambda M: M,
        lambda M: M.T,
        lambda M: torch.stack([M, M.flip(0)]),
        lambda M: torch.stack([M, M.flip(0)])[:, :, ::2],  # strided: the iteration-only path
    )
    for layout in layouts:
        expected = newton_schulz(layout(G), backend=backend, eps=0.0)
        for scale in HUGE_SCALES:
            for _ in range(3):  # eager, capture, replay
                out = newton_schulz(layout(G * scale), backend=backend, eps=0.0)
                assert torch.equal(out, expected)
    exact = reference.newton_schulz_by_svd(G.cpu(), NewtonSchulz().coefficients)
    yardstick = plain_loop_error(G.cpu(), NewtonSchulz().coefficients, torch.float16)
    out = newton_schulz(G * HUGE_SCALES[0], backend=backend)
    assert relative_error(out.cpu(), exact) <= LOW_PRECISION_RATIO * yardstick


def test_dmuon_fused_triton_0_runs_the_torch_path_on_cuda_with_the_kernels_numbers(
    needs_triton, monkeypatch
):
    pairs = [momentum_inputs((512, 1536), seed=seed) for seed in range(2)]
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("DMUON_FUSED_TRITON", switch)
        momenta = [b.cuda() for _, b in pairs]
        out = torch.empty(2, 512, 1536, dtype=torch.float16, device="cuda")
        muon_normalized_inputs_(
            [g.cuda() for g, _ in pairs], momenta, [False, False], MOMENTUM, True, out
        )
        outputs.append((momenta, out))
    (kernel_momenta, kernel_out), (torch_momenta, torch_out) = outputs
    for kernel, plain in zip(kernel_momenta, torch_momenta):
        assert relative_error(kernel, plain) < 1e-6
    for index in range(2):
        assert relative_error(kernel_out[index], torch_out[index]) < torch.finfo(torch.float16).eps
