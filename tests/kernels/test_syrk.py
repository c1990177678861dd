"""The SYRK dispatcher and its torch backend: results, fallbacks, names and messages.

Accuracy bound: each output element is a K-term dot product, so against float64 it may be off by
the classic ``gamma_K = K·u / (1 - K·u)`` times ``|alpha|·|A|·|A|ᵀ + |beta|·|C|`` (elementwise),
plus one rounding of the result to the output dtype (u = eps / 2).
"""

from __future__ import annotations

import pytest
import torch

import dmuon_kernels
from dmuon_kernels.syrk import (
    BACKEND_MODULES,
    auto_candidate,
    backend_availability,
    canonical_kernel_name,
    kernel_choices,
    register_backend,
    resolve_kernel,
    syrk,
    unregister_backend,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ((37, 53), (3, 24, 40), (2, 3, 16, 72), (1, 9))


def _operands(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    A = torch.randn(shape, generator=generator).to(dtype)
    S = torch.randn((*shape[:-1], shape[-2]), generator=generator)
    C = (S + S.mT).to(dtype)  # SYRK's C is symmetric
    return A, C


def _error_bound(A, C, alpha, beta):
    """Elementwise gamma_K bound (see the module docstring), in float64."""
    u = torch.finfo(A.dtype).eps / 2
    K = A.shape[-1]
    gamma = K * u / (1 - K * u)
    A64 = A.double()
    magnitude = abs(alpha) * (A64.abs() @ A64.abs().mT)
    exact = alpha * (A64 @ A64.mT)
    if C is not None:
        magnitude = magnitude + abs(beta) * C.double().abs()
        exact = exact + beta * C.double()
    return exact, gamma * magnitude + u * exact.abs()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_syrk_equals_a_times_a_transpose_within_the_dot_product_bound(dtype, shape):
    A, _ = _operands(shape, dtype)
    out = syrk(A)
    exact, bound = _error_bound(A, None, 1.0, 0.0)
    assert out.dtype == dtype and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_syrk_with_alpha_beta_and_c_equals_the_blas_definition(dtype, shape):
    A, C = _operands(shape, dtype, seed=1)
    for alpha, beta in [(1.0, 1.0), (0.37, -2.5), (-1.5, 0.0)]:
        out = syrk(A, C=C, alpha=alpha, beta=beta)
        exact, bound = _error_bound(A, C, alpha, beta)
        assert ((out.double() - exact).abs() <= bound).all(), (alpha, beta)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_syrk_output_is_symmetric_up_to_rounding(dtype):
    A, C = _operands((3, 40, 64), dtype, seed=2)
    for out in (syrk(A), syrk(A, C=C, alpha=0.5, beta=0.25)):
        _, bound = _error_bound(A, C, 0.5, 0.25)
        assert ((out - out.mT).double().abs() <= 2 * bound).all()
    # without C both triangles come from the same products
    out = syrk(A)
    assert torch.equal(out, out.mT)


@pytest.mark.parametrize("layout", ["contiguous", "transposed-view"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_syrk_is_exactly_symmetric_with_and_without_c(dtype, layout):
    # The CPU BLAS sums out[i, j] and out[j, i] in different orders (off by ~1e-7 in fp32 for a
    # 6 x 10 A); the torch path mirrors one triangle and stays within the dot-product bound.
    for shape in ((6, 10), (37, 53), (3, 40, 64), (2, 3, 16, 72)):
        A, C = _operands(shape, dtype, seed=4)
        if layout == "transposed-view":
            A = A.mT.contiguous().mT
        for alpha, beta, c in [(1.0, 0.0, None), (2.0, 0.0, None), (0.5, -2.0, C)]:
            out = syrk(A, C=c, alpha=alpha, beta=beta)
            assert torch.equal(out, out.mT), (shape, alpha, beta)
            exact, bound = _error_bound(A, c, alpha, beta)
            assert ((out.double() - exact).abs() <= bound).all(), (shape, alpha, beta)


def test_cpu_syrk_reads_c_through_its_lower_triangle_like_the_symmetric_kernels():
    A, C = _operands((9, 14), torch.float32, seed=5)
    lower_only = C.tril() + C.tril(-1).mT
    skewed = lower_only + torch.ones_like(C).triu(1)  # same lower triangle, different upper one
    assert torch.equal(syrk(A, C=skewed, beta=1.0), syrk(A, C=lower_only, beta=1.0))


def test_beta_zero_ignores_c_even_when_it_holds_nan():
    A, C = _operands((8, 16), torch.float32)
    out = syrk(A, C=torch.full_like(C, float("nan")), beta=0.0)
    assert torch.isfinite(out).all()


def test_batched_syrk_equals_each_matrix_on_its_own():
    A, C = _operands((4, 20, 33), torch.float32, seed=3)
    out = syrk(A, C=C, alpha=0.5, beta=2.0)
    for index in range(4):
        expected = syrk(A[index], C=C[index], alpha=0.5, beta=2.0)
        torch.testing.assert_close(out[index], expected)


def test_package_level_syrk_is_the_dispatcher_function():
    A, _ = _operands((6, 10), torch.float32)
    assert torch.equal(dmuon_kernels.syrk(A, kernel="cublas"), syrk(A))


# --- names and resolution -----------------------------------------------------------------------


def test_unknown_kernel_name_lists_every_valid_choice():
    A, _ = _operands((4, 8), torch.float32)
    with pytest.raises(
        ValueError,
        match=r"kernel must be one of 'auto', 'cublas', 'quack', 'cute', 'cute_sm80'; "
        r"got 'cutlass'",
    ):
        syrk(A, kernel="cutlass")


def test_cute_sm80_is_an_alias_of_cute():
    assert canonical_kernel_name("cute_sm80") == "cute"
    assert "cute_sm80" in kernel_choices()


def test_auto_runs_the_torch_path_on_cpu():
    A, _ = _operands((4, 8), torch.float16)
    assert auto_candidate(torch.device("cpu")) == ("cublas", "CPU, torch fallback")
    assert resolve_kernel("auto", A) == "cublas"


@pytest.mark.parametrize("kernel", ["quack", "cute", "cute_sm80"])
def test_an_unavailable_kernel_raises_its_reason_and_install_hint(kernel):
    name = canonical_kernel_name(kernel)
    available, reason = backend_availability(name)
    if available:
        pytest.skip(f"{name} is available on this machine")
    A, _ = _operands((4, 8), torch.float16)
    with pytest.raises(RuntimeError) as raised:
        syrk(A, kernel=kernel)
    message = str(raised.value)
    assert f"kernel={name!r} cannot run here" in message
    assert reason in message
    assert f"pip install dmuon-kernels[{name}]" in message
    assert 'use kernel="auto"' in message


class _NegatedBackend:
    """A test backend with a recognisable wrong answer, to see which path ran."""

    def __init__(self, available=True):
        self.available = available

    def is_available(self):
        return self.available, "test backend"

    def syrk(self, A, C, alpha, beta):
        return -torch.ones(*A.shape[:-1], A.shape[-2], dtype=A.dtype)


@pytest.fixture
def negated_backend():
    register_backend("negated", _NegatedBackend())
    yield "negated"
    unregister_backend("negated")


def test_a_registered_backend_becomes_a_valid_kernel_name(negated_backend):
    assert negated_backend in kernel_choices()
    assert canonical_kernel_name(negated_backend) == negated_backend
    unregister_backend(negated_backend)
    assert negated_backend not in kernel_choices()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_inputs_run_the_torch_path_whatever_kernel_is_requested(negated_backend, dtype):
    A, _ = _operands((5, 9), dtype)
    assert resolve_kernel(negated_backend, A) == "cublas"
    assert torch.equal(syrk(A, kernel=negated_backend), syrk(A, kernel="cublas"))


def test_a_registered_but_unavailable_backend_raises_with_its_reason():
    register_backend("offline", _NegatedBackend(available=False))
    try:
        with pytest.raises(RuntimeError, match=r"kernel='offline' cannot run here: test backend"):
            syrk(torch.ones(2, 2), kernel="offline")
    finally:
        unregister_backend("offline")


def test_reserved_names_cannot_be_registered():
    for name in ("auto", "cute_sm80", ""):
        with pytest.raises(ValueError, match="reserved name"):
            register_backend(name, _NegatedBackend())


def test_a_backend_whose_module_is_missing_reports_itself_unavailable(monkeypatch):
    monkeypatch.setitem(BACKEND_MODULES, "ghost", "dmuon_kernels.syrk.ghost_backend")
    try:
        available, reason = backend_availability("ghost")
        assert not available
        assert reason == "the 'ghost' backend is not part of this installation"
    finally:
        unregister_backend("ghost")


# --- operand validation -------------------------------------------------------------------------


def test_beta_without_c_is_rejected():
    with pytest.raises(ValueError, match=r"syrk got beta=0.5 but no C"):
        syrk(torch.ones(3, 4), beta=0.5)


def test_c_of_the_wrong_shape_is_rejected_with_the_expected_shape():
    with pytest.raises(
        ValueError,
        match=r"C must have shape \(3, 3\) for A of shape \(3, 4\); "
        r"got \(4, 4\)",
    ):
        syrk(torch.ones(3, 4), C=torch.ones(4, 4), beta=1.0)


def test_c_of_another_dtype_is_rejected():
    with pytest.raises(ValueError, match=r"C must match A's dtype and device \(torch.float32"):
        syrk(torch.ones(3, 4), C=torch.ones(3, 3, dtype=torch.float16), beta=1.0)


@pytest.mark.parametrize(
    "A", [torch.ones(4), torch.ones(3, 4, dtype=torch.int64), [[1.0]]], ids=["1d", "int", "list"]
)
def test_a_that_is_not_a_floating_matrix_is_rejected(A):
    with pytest.raises(ValueError, match=r"syrk expects a floating-point tensor A of shape"):
        syrk(A)


def test_non_numeric_alpha_is_rejected():
    with pytest.raises(ValueError, match=r"syrk alpha must be a real number; got '2'"):
        syrk(torch.ones(3, 4), alpha="2")
