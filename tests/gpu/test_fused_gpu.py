"""The Triton step kernels against the torch fallbacks (run on CPU copies of the same data)."""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels.fused import (
    muon_apply_update_,
    muon_momentum_,
    muon_momentum_normalize_,
    muon_normalize,
    normalize_cast,
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
    assert sq_norm.item() == pytest.approx(ref_sq.item(), rel=1e-5)


def test_triton_squared_norm_is_deterministic(needs_triton):
    grad, buf = (t.cuda() for t in momentum_inputs((2048, 2048), seed=1))
    sums = {muon_momentum_(grad, buf.clone(), MOMENTUM, True, False)[1].item() for _ in range(5)}
    assert len(sums) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("transposed_out", [False, True], ids=["contiguous", "transposed"])
def test_triton_normalize_matches_the_fallback(needs_triton, dtype, transposed_out):
    update = torch.randn(1000, 300, generator=torch.Generator().manual_seed(2))
    sq_norm = update.square().sum()
    out = torch.empty(300, 1000, dtype=dtype, device="cuda").mT if transposed_out else None
    result = muon_normalize(update.cuda(), sq_norm.cuda(), dtype, out=out)
    expected = muon_normalize(update, sq_norm, dtype)
    assert result.dtype == dtype
    # both round one fp32 quotient to `dtype`: at most one unit apart
    assert torch.allclose(
        result.float().cpu(), expected.float(), rtol=torch.finfo(dtype).eps, atol=0
    )


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_triton_momentum_normalize_matches_the_fallback(needs_triton, nesterov):
    grad, buf = momentum_inputs((512, 2048), seed=3)
    buf_gpu = buf.cuda()
    X, sq_norm = muon_momentum_normalize_(grad.cuda(), buf_gpu, MOMENTUM, nesterov)
    ref_X, ref_sq = muon_momentum_normalize_(grad, buf, MOMENTUM, nesterov)
    assert relative_error(buf_gpu, buf) < 1e-6
    assert sq_norm.item() == pytest.approx(ref_sq.item(), rel=1e-5)
    assert relative_error(X, ref_X) < torch.finfo(torch.float16).eps


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["single", "batched", "transposed"])
def test_triton_normalize_cast_equals_the_torch_expression_bitwise(needs_triton, dtype, layout):
    generator = torch.Generator(device="cuda").manual_seed(5)
    shape = {"single": (300, 1000), "batched": (4, 300, 1000), "transposed": (1000, 300)}[layout]
    X = torch.randn(shape, device="cuda", generator=generator)
    if layout == "transposed":
        X = X.mT  # Newton-Schulz's view of a tall matrix
    norm = torch.linalg.matrix_norm(X, keepdim=True)
    out = normalize_cast(X, norm, 1e-7, dtype)
    assert out.is_contiguous()
    assert torch.equal(out, (X / (norm + 1e-7)).to(dtype))
