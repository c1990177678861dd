"""The fused Muon step pieces (torch fallbacks here; Triton against them in tests/gpu).

Each function is checked against the SPEC formulas written out in float64.
"""

from __future__ import annotations

import pytest
import torch

from dmuon_kernels.fused import (
    muon_apply_update_,
    muon_momentum_,
    muon_momentum_normalize_,
    muon_normalize,
)
from tests.numerics import momentum_inputs, relative_error

MOMENTUM = 0.95
FP32_RTOL = 1e-6


def spec_momentum(grad, buf, nesterov, first_step):
    """SPEC steps 1-2 in float64: (new buffer, update)."""
    g, b = grad.double(), buf.double()
    new_buf = g.clone() if first_step else MOMENTUM * b + g
    return new_buf, (g + MOMENTUM * new_buf) if nesterov else new_buf


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("first_step", [True, False], ids=["first", "later"])
def test_momentum_updates_the_buffer_and_returns_the_update_and_its_squared_norm(
    nesterov, first_step
):
    grad, buf = momentum_inputs((33, 70))
    expected_buf, expected_update = spec_momentum(grad, buf, nesterov, first_step)
    update, sq_norm = muon_momentum_(grad, buf, MOMENTUM, nesterov, first_step)
    assert relative_error(buf, expected_buf) < FP32_RTOL
    assert relative_error(update, expected_update) < FP32_RTOL
    assert sq_norm.shape == () and sq_norm.dtype == torch.float32
    assert sq_norm.item() == pytest.approx(expected_update.square().sum().item(), rel=1e-5)
    if not nesterov:
        assert update is buf


def test_momentum_reads_a_bf16_gradient_into_an_fp32_buffer():
    grad, buf = momentum_inputs((16, 48), torch.bfloat16)
    expected_buf, expected_update = spec_momentum(grad, buf, True, False)
    update, _ = muon_momentum_(grad, buf, MOMENTUM, nesterov=True)
    assert buf.dtype == update.dtype == torch.float32
    assert relative_error(buf, expected_buf) < FP32_RTOL
    assert relative_error(update, expected_update) < FP32_RTOL


def test_normalize_divides_by_the_frobenius_norm_plus_eps_and_casts():
    update = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    sq_norm = update.double().square().sum().float()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        out = muon_normalize(update, sq_norm, dtype, eps=1e-7)
        expected = update.double() / (update.double().norm() + 1e-7)
        assert out.dtype == dtype
        assert relative_error(out, expected) < torch.finfo(dtype).eps


def test_normalize_writes_into_a_transposed_output_for_rows_le_cols():
    update = torch.randn(96, 40, generator=torch.Generator().manual_seed(2))  # tall
    sq_norm = update.square().sum()
    storage = torch.empty(40, 96, dtype=torch.float16)  # Newton-Schulz wants (40, 96) rows
    out = muon_normalize(update, sq_norm, torch.float16, out=storage.mT)
    assert out.data_ptr() == storage.data_ptr()
    assert torch.equal(storage, muon_normalize(update, sq_norm, torch.float16).mT)


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_momentum_normalize_equals_momentum_then_normalize(nesterov):
    grad, buf = momentum_inputs((24, 80), seed=3)
    buf_two_calls = buf.clone()
    X, sq_norm = muon_momentum_normalize_(grad, buf, MOMENTUM, nesterov, dtype=torch.float16)
    update, sq_two = muon_momentum_(grad, buf_two_calls, MOMENTUM, nesterov)
    assert torch.equal(buf, buf_two_calls)
    assert torch.equal(sq_norm, sq_two)
    assert torch.equal(X, muon_normalize(update, sq_two, torch.float16))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_apply_update_decays_then_subtracts_the_scaled_update(weight_decay):
    generator = torch.Generator().manual_seed(4)
    master = torch.randn(64, 32, generator=generator)
    ortho = torch.randn(32, 64, generator=generator).half().mT  # a transposed NS output
    lr, scale = 0.02, 0.2 * 64**0.5
    expected = master.double() * (1 - lr * weight_decay) - lr * scale * ortho.double()
    result = muon_apply_update_(master, ortho, lr, weight_decay, scale)
    assert result is master
    assert relative_error(master, expected) < FP32_RTOL


def test_parameters_with_trailing_dims_are_handled_as_matrices():
    grad, buf = momentum_inputs(
        (8, 3, 5), seed=5
    )  # e.g. a conv weight: Muon flattens (3, 5) into 15
    update, sq_norm = muon_momentum_(grad, buf, MOMENTUM, True, True)
    X = muon_normalize(update, sq_norm, torch.float32)
    assert X.shape == (8, 3, 5)
    assert relative_error(X, update.double() / update.double().norm()) < FP32_RTOL


@pytest.mark.parametrize(
    "call",
    [
        lambda: muon_momentum_(torch.zeros(4, 5), torch.zeros(5, 4), 0.9),
        lambda: muon_apply_update_(torch.zeros(4, 5), torch.zeros(5, 4), 0.1),
        lambda: muon_normalize(torch.zeros(4, 5), torch.ones(()), out=torch.zeros(5, 4)),
    ],
    ids=["momentum", "apply_update", "normalize"],
)
def test_mismatched_shapes_are_rejected_with_both_shapes(call):
    with pytest.raises(ValueError, match=r"shapes must match, got \(4, 5\) and \(5, 4\)"):
        call()
