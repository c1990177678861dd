"""The Triton step kernels' numbers, checked on the CPU through Triton's interpreter.

``fused_interpreted`` runs every kernel of ``dmuon_kernels._fused_triton`` on CPU tensors (in a
fresh interpreter with ``TRITON_INTERPRET=1``) and the torch fallback on copies of the same
inputs; here the differences are held to what rounding allows. tests/gpu repeats the comparison
with the compiled kernels on CUDA.

Bounds: fp32 buffers and masters within 1e-6 (the kernels may fuse a multiply-add); the
Newton-Schulz input at most one unit in the last place in fp16 (the fused first pass rounds each
value twice, see ``dmuon_kernels.fused``) and two in bf16 (the interpreter also truncates to bf16
where the GPU rounds to nearest); in fp32 bit for bit without Nesterov, and within a few fp32
roundings with it (u = g + μ·buf rounds differently when fused).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.triton_interpreter import run_interpreted

FP32_BOUND = 4 * torch.finfo(torch.float32).eps
ULPS = {"torch.float16": 1.0, "torch.bfloat16": 2.0}

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_interpreted("tests.kernels.fused_interpreted", timeout=900)


def cases(results: list[dict], name: str) -> list[dict]:
    found = [r for r in results if r["case"] == name]
    assert found, f"no {name} case ran"
    return found


def test_fused_inputs_match_the_fallback_within_one_rounding_and_stay_finite_at_any_scale(results):
    for case in cases(results, "normalized_inputs"):
        assert case["buffer_error"] <= 1e-6, case
        assert case["finite"], case
        if case["dtype"] == "torch.float32":
            assert case["out_error"] <= FP32_BOUND, case
            assert case["nesterov"] or case["out_ulps"] == 0, case
        else:
            assert case["out_ulps"] <= ULPS[case["dtype"]], case


def test_momentum_into_new_buffers_leaves_the_old_ones_and_equals_the_in_place_run(results):
    found = cases(results, "new_momenta")
    assert {case["kernels"] for case in found} == {True, False}
    for case in found:
        assert case["read_unchanged"] and case["new_equal"] and case["out_equal"], case


def test_single_matrix_momentum_and_normalize_match_the_fallback(results):
    for case in cases(results, "momentum_then_normalize"):
        assert case["update_is_buffer"], case
        assert case["sq_norm_dtype"] == "torch.float64", case
        for key in ("buffer_error", "update_error", "sq_norm_error"):
            assert case[key] <= 1e-6, case
        assert case["normalized_ulps"] <= 1, case
        assert case["recomputed_error"] <= FP32_BOUND, case


def test_newton_schulz_input_stage_matches_the_fallback_and_keeps_zero_matrices_zero(results):
    for case in cases(results, "normalize_frobenius"):
        assert case["ulps"] <= 1, case
        assert case["zero_matrix_is_zero"], case


def test_decay_and_update_match_the_fallback_for_any_layout_and_alignment(results):
    for case in cases(results, "apply_updates"):
        assert case["master_error"] <= 1e-6, case
