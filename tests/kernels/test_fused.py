"""The fused Muon step pieces (torch fallbacks here; the Triton kernels against them in
test_fused_triton_interpreted and tests/gpu).

Each function is checked against the SPEC formulas written out in float64.
"""

from __future__ import annotations

import types

import pytest
import torch

from dmuon_kernels import fused
from dmuon_kernels.fused import (
    muon_apply_update_,
    muon_apply_updates_,
    muon_momentum_,
    muon_normalize,
    muon_normalized_inputs_,
    normalize_frobenius,
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
    assert sq_norm.shape == () and sq_norm.dtype == torch.float64
    assert sq_norm.item() == pytest.approx(expected_update.square().sum().item(), rel=1e-6)
    if not nesterov:
        assert update is buf


def test_momentum_reads_a_bf16_gradient_into_an_fp32_buffer():
    grad, buf = momentum_inputs((16, 48), torch.bfloat16)
    expected_buf, expected_update = spec_momentum(grad, buf, True, False)
    update, _ = muon_momentum_(grad, buf, MOMENTUM, nesterov=True)
    assert buf.dtype == update.dtype == torch.float32
    assert relative_error(buf, expected_buf) < FP32_RTOL
    assert relative_error(update, expected_update) < FP32_RTOL


def test_the_squared_norm_of_a_huge_update_is_finite():
    grad, buf = momentum_inputs((16, 48))
    _, sq_norm = muon_momentum_(grad * 2.0**70, buf * 2.0**70, MOMENTUM)
    assert sq_norm.isfinite() and sq_norm.item() > torch.finfo(torch.float32).max


@pytest.mark.parametrize("given", [True, False], ids=["given_norm", "computed_norm"])
def test_normalize_divides_by_the_frobenius_norm_plus_eps_and_casts(given):
    update = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    sq_norm = update.double().square().sum() if given else None
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        out = muon_normalize(update, sq_norm, dtype, eps=1e-7)
        expected = update.double() / (update.double().norm() + 1e-7)
        assert out.dtype == dtype
        assert relative_error(out, expected) < torch.finfo(dtype).eps


def test_normalize_writes_into_a_transposed_output_for_rows_le_cols():
    update = torch.randn(96, 40, generator=torch.Generator().manual_seed(2))  # tall
    sq_norm = update.double().square().sum()
    storage = torch.empty(40, 96, dtype=torch.float16)  # Newton-Schulz wants (40, 96) rows
    out = muon_normalize(update, sq_norm, torch.float16, out=storage.mT)
    assert out.data_ptr() == storage.data_ptr()
    assert torch.equal(storage, muon_normalize(update, sq_norm, torch.float16).mT)


@pytest.mark.parametrize("transposed", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_normalized_inputs_of_a_batch_are_momentum_then_the_normalised_update_of_each(
    nesterov, transposed
):
    shape = (48, 20) if transposed else (20, 48)
    pairs = [momentum_inputs(shape, seed=seed) for seed in range(3)]
    grads = [g for g, _ in pairs]
    momenta = [b for _, b in pairs]
    first_steps = [False, True, False]
    expected = [spec_momentum(g, b, nesterov, first) for (g, b), first in zip(pairs, first_steps)]
    out = torch.empty(3, 20, 48, dtype=torch.float16)  # rows <= cols, as Newton-Schulz takes it
    muon_normalized_inputs_(grads, momenta, first_steps, MOMENTUM, nesterov, out, eps=1e-7)
    for index, (expected_buf, expected_update) in enumerate(expected):
        assert relative_error(momenta[index], expected_buf) < FP32_RTOL
        X = expected_update / (expected_update.norm() + 1e-7)
        got = out[index].mT if transposed else out[index]
        assert relative_error(got, X) < torch.finfo(torch.float16).eps


def test_the_torch_fallback_takes_a_long_list_in_runs_with_the_values_of_one_run(monkeypatch):
    pairs = [momentum_inputs((6, 10), seed=seed) for seed in range(5)]
    first_steps = [False, True, False, False, True]

    def normalized(run_bytes):
        monkeypatch.setattr(fused, "FALLBACK_BATCH_BYTES", run_bytes)
        momenta = [b.clone() for _, b in pairs]
        out = torch.empty(5, 6, 10, dtype=torch.float16)
        muon_normalized_inputs_([g for g, _ in pairs], momenta, first_steps, MOMENTUM, True, out)
        return out, momenta

    runs = []
    fallback = fused._normalized_inputs_torch

    def counted_fallback(grads, *args):
        runs.append(len(grads))
        fallback(grads, *args)

    monkeypatch.setattr(fused, "_normalized_inputs_torch", counted_fallback)
    whole_out, whole_momenta = normalized(fused.FALLBACK_BATCH_BYTES)
    assert runs == [5]
    runs.clear()
    run_out, run_momenta = normalized(2 * 4 * 6 * 10)  # two matrices' fp32 inputs a run
    assert runs == [2, 2, 1]
    assert torch.equal(run_out, whole_out)
    assert all(torch.equal(a, b) for a, b in zip(run_momenta, whole_momenta))


def test_normalized_inputs_of_a_gradient_whose_squared_norm_overflows_are_still_normalised():
    grad, buf = momentum_inputs((20, 48))
    grads, momenta = [grad * 2.0**70, grad], [buf * 2.0**70, buf.clone()]
    out = torch.empty(2, 20, 48)
    muon_normalized_inputs_(grads, momenta, [False, False], MOMENTUM, True, out)
    assert relative_error(out[0], out[1]) < 1e-6  # scale-free, up to eps


def test_normalized_inputs_refuse_mismatched_lists_and_outputs_with_the_sizes():
    grad, buf = momentum_inputs((4, 6))
    with pytest.raises(ValueError, match=r"got 1, 2, 1 and an output of shape \(1, 4, 6\)"):
        muon_normalized_inputs_([grad], [buf, buf], [False], MOMENTUM, True, torch.empty(1, 4, 6))
    with pytest.raises(ValueError, match=r"gradients of shape \(4, 6\); got \(1, 4, 4\)"):
        muon_normalized_inputs_([grad], [buf], [False], MOMENTUM, True, torch.empty(1, 4, 4))
    out = torch.empty(1, 4, 6)
    with pytest.raises(ValueError, match="new_momenta must be one buffer per momentum buffer"):
        muon_normalized_inputs_(
            [grad], [buf], [False], MOMENTUM, True, out, new_momenta=[buf.double()]
        )


def test_normalize_frobenius_equals_the_quotient_rounded_once_and_survives_any_scale():
    X = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(6))
    norm = X.double().square().sum(dim=(-2, -1), keepdim=True).sqrt()
    expected = X / (norm + 1e-7).float()  # fp32(||X|| + eps), one IEEE quotient
    assert torch.equal(normalize_frobenius(X, eps=1e-7, dtype=torch.float32), expected)
    for scale in (2.0**-100, 2.0**64, 2.0**124):
        out = normalize_frobenius(X * scale, eps=0.0, dtype=torch.float16)
        assert torch.equal(out, normalize_frobenius(X, eps=0.0, dtype=torch.float16))


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


def test_apply_updates_of_a_batch_update_every_master():
    generator = torch.Generator().manual_seed(5)
    masters = [torch.randn(16, 40, generator=generator) for _ in range(3)]
    ns_output = torch.randn(3, 16, 40, generator=generator).half()
    expected = [
        m.double() * (1 - 0.02 * 0.1) - 0.02 * 2.0 * o.double() for m, o in zip(masters, ns_output)
    ]
    muon_apply_updates_(masters, list(ns_output), 0.02, 0.1, 2.0)
    for master, want in zip(masters, expected):
        assert relative_error(master, want) < FP32_RTOL


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
        lambda: muon_apply_updates_([torch.zeros(4, 5)], [torch.zeros(5, 4)], 0.1, 0.0, 1.0),
    ],
    ids=["momentum", "apply_update", "normalize", "apply_updates"],
)
def test_mismatched_shapes_are_rejected_with_both_shapes(call):
    with pytest.raises(ValueError, match=r"shapes must match, got \(4, 5\) and \(5, 4\)"):
        call()


def test_dmuon_fused_triton_0_sends_cuda_tensors_to_the_torch_fallback(monkeypatch):
    cuda_like = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(fused, "triton_available", lambda: True)
    monkeypatch.setattr(fused, "_triton_module", "the kernels")
    monkeypatch.delenv("DMUON_FUSED_TRITON", raising=False)
    assert fused._kernels(cuda_like) == "the kernels"
    assert fused._kernels(cuda_like, types.SimpleNamespace(is_cuda=False)) is None
    monkeypatch.setenv("DMUON_FUSED_TRITON", "0")
    assert fused._kernels(cuda_like) is None
    shapes = [(64, 128)]
    assert (
        fused.compile_step_kernels_ahead(
            "cuda:0", shapes, momentum_dtype=torch.float32, nesterov=True, ns_dtype=torch.float16
        )
        == 0
    )  # nothing compiles ahead for kernels that will not run
    monkeypatch.setenv("DMUON_FUSED_TRITON", "disabled")
    with pytest.raises(ValueError, match="DMUON_FUSED_TRITON='disabled' is not an on/off value"):
        fused._kernels(cuda_like)
