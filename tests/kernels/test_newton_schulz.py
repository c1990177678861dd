"""Newton-Schulz against float64 oracles: the SVD polar factor and the scalar recurrence.

Tolerances are explained in ``ns_matrices``: fp32 iterations are held to ``prod(a)·eps``; fp16 and
bf16 iterations to twice the error of a plain loop in the same dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz
from torch.utils._python_dispatch import TorchDispatchMode

from dmuon_kernels import (
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    YOU_COEFFICIENTS,
    NewtonSchulz,
    newton_schulz,
    reference,
)
from dmuon_kernels.coefficients import (
    POLAR_EXPRESS_4_COEFFICIENTS,
    POLAR_EXPRESS_4_LOWER_BOUND,
    POLAR_EXPRESS_4_RAW_COEFFICIENTS,
    POLAR_EXPRESS_RAW_COEFFICIENTS,
    polar_express_rows,
)
from dmuon_kernels.newton_schulz import (
    direct_iteration,
    gram_iteration,
    normalized_input,
    uses_gram_form,
)
from tests.kernels.ns_matrices import (
    LOW_PRECISION_RATIO,
    SPECTRUM_CASES,
    fp32_tolerance,
    log_spectrum,
    matrix_with_spectrum,
    plain_loop_error,
)
from tests.numerics import relative_error

BACKENDS = ("gram", "direct")
LOW_PRECISION = (torch.float16, torch.bfloat16)
TABLES = {
    "polar_express": POLAR_EXPRESS_COEFFICIENTS,
    "keller": KELLER_COEFFICIENTS,
    "you": YOU_COEFFICIENTS,
}


def case_matrix(name: str, seed: int = 0) -> torch.Tensor:
    rows, cols, spectrum = SPECTRUM_CASES[name]
    return matrix_with_spectrum(rows, cols, spectrum, seed=seed)


# --- coefficient tables -------------------------------------------------------------------------


def test_polar_express_table_is_the_paper_rows_with_safety_factor_1_05():
    raw = [
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    ]
    expected = [(a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in raw]
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 5
    for got, want in zip(POLAR_EXPRESS_COEFFICIENTS, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-15)


def test_keller_table_is_one_row_five_times_and_you_table_has_five_rows():
    assert KELLER_COEFFICIENTS == ((3.4445, -4.7750, 2.0315),) * 5
    assert YOU_COEFFICIENTS[0] == (4.0848, -6.8946, 2.9270)
    assert YOU_COEFFICIENTS[-1] == (2.8366, -3.0525, 1.2012)
    assert len(YOU_COEFFICIENTS) == 5


def test_polar_express_recurrence_maps_every_value_in_its_band_into_0_729_to_1_124():
    sigma = torch.logspace(-3, 0, 100_001, dtype=torch.float64)
    mapped = reference.scalar_recurrence(sigma, POLAR_EXPRESS_COEFFICIENTS)
    assert mapped.min().item() >= 0.729
    assert mapped.max().item() <= 1.124
    # the band is tight: both ends are nearly reached
    assert mapped.min().item() < 0.7291 and mapped.max().item() > 1.1235


def test_the_polar_express_construction_reproduces_the_published_rows():
    for got, want in zip(polar_express_rows(5), POLAR_EXPRESS_RAW_COEFFICIENTS, strict=True):
        assert got == pytest.approx(want, rel=1e-13)


def test_the_four_step_table_is_the_construction_from_its_lower_bound_with_the_safety_factor():
    rows = polar_express_rows(4, POLAR_EXPRESS_4_LOWER_BOUND)
    for got, want in zip(rows, POLAR_EXPRESS_4_RAW_COEFFICIENTS, strict=True):
        assert got == pytest.approx(want, rel=1e-13)
    # one step from its lower bound lands where the five-step table's second step lands
    assert POLAR_EXPRESS_4_RAW_COEFFICIENTS[1:] == POLAR_EXPRESS_RAW_COEFFICIENTS[2:]
    expected = [(a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in rows]
    for got, want in zip(POLAR_EXPRESS_4_COEFFICIENTS, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-13)


def test_the_four_step_table_keeps_the_default_band_on_its_narrower_interval():
    sigma = torch.logspace(math.log10(POLAR_EXPRESS_4_LOWER_BOUND), 0, 100_001, dtype=torch.float64)
    mapped = reference.scalar_recurrence(sigma, POLAR_EXPRESS_4_COEFFICIENTS)
    assert mapped.min().item() >= 0.729 and mapped.max().item() <= 1.124
    below = reference.scalar_recurrence(
        torch.tensor(1e-3, dtype=torch.float64), POLAR_EXPRESS_4_COEFFICIENTS
    )
    assert below.item() < 0.5  # the price of a step: 1e-3 is out of its band


# --- quality against float64 oracles -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(SPECTRUM_CASES))
def test_fp32_iteration_equals_the_recurrence_applied_to_the_svd(case, backend):
    G = case_matrix(case)
    for table in TABLES.values():
        exact = reference.newton_schulz_by_svd(G, table)
        out = newton_schulz(G, backend=backend, coefficients=table, dtype=torch.float32)
        assert relative_error(out, exact) <= fp32_tolerance(table)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["wide", "tall", "very_wide", "rank_deficient"])
def test_fp32_singular_values_are_the_scalar_recurrence_of_sigma_over_frobenius(case, backend):
    G = case_matrix(case)
    sigma = torch.linalg.svdvals(G.double())
    expected = reference.scalar_recurrence(sigma / G.double().norm(), POLAR_EXPRESS_COEFFICIENTS)
    out = newton_schulz(G, backend=backend, dtype=torch.float32)
    got = torch.linalg.svdvals(out.double())
    expected_sorted = expected.sort(descending=True).values
    assert (got - expected_sorted).abs().max().item() <= fp32_tolerance(POLAR_EXPRESS_COEFFICIENTS)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(SPECTRUM_CASES))
def test_low_precision_iteration_is_within_twice_a_plain_loops_rounding(case, backend, dtype):
    G = case_matrix(case)
    exact = reference.newton_schulz_by_svd(G, POLAR_EXPRESS_COEFFICIENTS)
    out = newton_schulz(G, backend=backend, dtype=dtype)
    yardstick = plain_loop_error(G, POLAR_EXPRESS_COEFFICIENTS, dtype)
    assert relative_error(out, exact) <= LOW_PRECISION_RATIO * yardstick


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_polar_express_lands_every_singular_value_in_its_band(backend, dtype):
    # sigma / ||G||_F spans [1.05e-3, 0.42]: inside the band the recurrence guarantees.
    G = matrix_with_spectrum(64, 192, log_spectrum(64, 2.5e-3), seed=3)
    ratios = torch.linalg.svdvals(G.double()) / G.double().norm()
    assert ratios.min().item() >= 1e-3
    out = newton_schulz(G, backend=backend, dtype=dtype)
    values = torch.linalg.svdvals(out.double())
    # Weyl: rounding moves singular values by at most the spectral norm of the error.
    exact = reference.newton_schulz_by_svd(G, POLAR_EXPRESS_COEFFICIENTS)
    if dtype == torch.float32:
        slack = fp32_tolerance(POLAR_EXPRESS_COEFFICIENTS)
    else:
        plain = reference.direct_newton_schulz(G, POLAR_EXPRESS_COEFFICIENTS, dtype=dtype)
        slack = LOW_PRECISION_RATIO * torch.linalg.matrix_norm(plain - exact, ord=2).item()
    assert values.min().item() >= 0.729 - slack
    assert values.max().item() <= 1.124 + slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_are_finite_for_extreme_scales_and_spectra(backend, dtype):
    inputs = [
        case_matrix("rank_deficient") * 1e15,
        case_matrix("wide") * 1e-20,
        matrix_with_spectrum(32, 96, log_spectrum(32, 1e-12), seed=1),
        torch.ones(16, 80),  # rank one with a huge gap
        matrix_with_spectrum(48, 160, log_spectrum(48, 1e-3), seed=2).half(),
    ]
    for G in inputs:
        out = newton_schulz(G, backend=backend, dtype=dtype)
        assert torch.isfinite(out).all()


# 2^64: the squared norm overflows fp32, the norm does not; 2^124: the norm itself is over fp32's
# largest value (3.4e38) while every entry is finite.
HUGE_SCALES = {"squared_norm_overflows": 2.0**64, "norm_overflows": 2.0**124}


@pytest.mark.parametrize("scale", HUGE_SCALES.values(), ids=HUGE_SCALES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_finite_input_whose_squared_norm_overflows_fp32_is_still_orthogonalised(backend, scale):
    G = case_matrix("wide")
    huge = G * scale
    assert huge.isfinite().all() and huge.square().sum().isinf()
    exact = reference.newton_schulz_by_svd(G, POLAR_EXPRESS_COEFFICIENTS)  # scale-free
    batch = torch.stack([huge, G, huge.flip(0)])
    ns = NewtonSchulz(backend, dtype=torch.float32)
    for out in (
        ns(huge),
        ns(huge.T).T,
        ns(batch)[0],
        ns(batch)[2].flip(0),
        ns(batch[:, :, ::2])[0],
    ):
        expected = (
            exact
            if out.shape == exact.shape
            else reference.newton_schulz_by_svd(G[:, ::2], POLAR_EXPRESS_COEFFICIENTS)
        )
        assert relative_error(out, expected) <= fp32_tolerance(POLAR_EXPRESS_COEFFICIENTS)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scaling_the_input_by_a_power_of_two_changes_no_bit_of_the_output(backend, dtype):
    # Without eps the quotient G / ||G|| is scale-free, and the normalisation scales by powers of
    # two exactly: a huge G gives the very same iteration input, so the very same output.
    G = case_matrix("wide")
    expected = newton_schulz(G, backend=backend, dtype=dtype, eps=0.0)
    for scale in (2.0**-40, *HUGE_SCALES.values()):
        assert torch.equal(
            newton_schulz(G * scale, backend=backend, dtype=dtype, eps=0.0), expected
        )


def test_the_norm_is_taken_without_rounding_the_quotient_twice():
    # The power-of-two scaling of [Note: overflow-safe normalisation] is exact: the fp32 input
    # is G / fp32(||G|| + eps) bit for bit, the norm accumulated in float64.
    G = case_matrix("tall")
    norm = G.double().norm()
    expected = (G.T / (norm + 1e-7).float()).contiguous()
    X = normalized_input(G, eps=1e-7, dtype=torch.float32)
    assert torch.equal(X, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_matrix_gives_zeros_and_leaves_its_batch_neighbours_alone(backend):
    assert torch.equal(newton_schulz(torch.zeros(8, 40), backend=backend), torch.zeros(8, 40))
    batch = torch.stack([case_matrix("wide"), torch.zeros(48, 160), case_matrix("wide", seed=1)])
    out = newton_schulz(batch, backend=backend)
    assert torch.equal(out[1], torch.zeros(48, 160))
    assert torch.equal(out[0], newton_schulz(batch[0], backend=backend))


# --- gram vs direct -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["wide", "tall", "very_wide", "rank_deficient"])
def test_gram_and_direct_agree_on_long_matrices(case, dtype):
    # Documented tolerance: both sit within the dtype's bound of the exact result, so they sit
    # within twice that bound of each other.
    G = case_matrix(case)
    rows, cols = G.shape
    assert uses_gram_form(rows, cols)
    gram = newton_schulz(G, backend="gram", dtype=dtype)
    direct = newton_schulz(G, backend="direct", dtype=dtype)
    if dtype == torch.float32:
        bound = 2 * fp32_tolerance(POLAR_EXPRESS_COEFFICIENTS)
    else:
        bound = 2 * LOW_PRECISION_RATIO * plain_loop_error(G, POLAR_EXPRESS_COEFFICIENTS, dtype)
    assert relative_error(gram, direct) <= bound


def test_gram_form_computes_the_same_polynomial_on_square_matrices():
    # The public "gram" backend runs the direct form on square matrices; the Gram form itself
    # must still be right there.
    G = case_matrix("square")
    X = G / G.norm()
    exact = reference.newton_schulz_by_svd(G, POLAR_EXPRESS_COEFFICIENTS, eps=0.0)
    out = gram_iteration(X, POLAR_EXPRESS_COEFFICIENTS, (2,))
    assert relative_error(out, exact) <= fp32_tolerance(POLAR_EXPRESS_COEFFICIENTS)


def test_gram_backend_runs_the_direct_form_when_the_matrix_is_less_than_twice_as_long():
    assert not uses_gram_form(64, 64)
    assert not uses_gram_form(64, 127)
    assert uses_gram_form(64, 128)
    assert uses_gram_form(128, 64)
    G = matrix_with_spectrum(64, 100, log_spectrum(64, 1e-2))
    assert torch.equal(newton_schulz(G, backend="gram"), newton_schulz(G, backend="direct"))


@pytest.mark.parametrize("restarts", [(), (1,), (2,), (3,), (1, 2, 3, 4), (4,)], ids=str)
def test_restart_positions_change_only_rounding_not_the_polynomial(restarts):
    # In float64 rounding vanishes, so every restart placement must give the exact polynomial.
    # (In fp16 placement matters a lot: without a restart the Gram form is ~30-140x less
    # accurate than a plain loop; the default [2] keeps it below it.)
    G = case_matrix("very_wide").double()
    X = G / G.norm()
    exact = reference.newton_schulz_by_svd(G, POLAR_EXPRESS_COEFFICIENTS, eps=0.0)
    out = gram_iteration(X, POLAR_EXPRESS_COEFFICIENTS, restarts)
    assert relative_error(out, exact) <= 1e-10


def test_direct_iteration_matches_the_float64_reference_loop():
    G = case_matrix("wide")
    X = G / G.norm()
    out = direct_iteration(X, YOU_COEFFICIENTS)
    expected = reference.direct_newton_schulz(G, YOU_COEFFICIENTS, eps=0.0)
    assert relative_error(out, expected) <= fp32_tolerance(YOU_COEFFICIENTS)


# --- shapes, batches, orientation, dtypes -------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(5, 24, 96), (2, 3, 96, 24), (4, 32, 32)], ids=str)
def test_batched_input_equals_each_matrix_on_its_own(shape, backend):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(G, backend=backend)
    per_matrix = torch.stack(
        [newton_schulz(g, backend=backend) for g in G.reshape(-1, *shape[-2:])]
    )
    assert out.shape == G.shape
    torch.testing.assert_close(out.reshape(per_matrix.shape), per_matrix, rtol=0, atol=0)


class _MatmulCounter(TorchDispatchMode):
    MATMULS = ("mm", "bmm", "addmm", "baddbmm")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_costs_the_same_number_of_matmul_launches_as_one_matrix(backend):
    counts = {}
    for batch in (1, 7):
        with _MatmulCounter() as counter:
            newton_schulz(torch.randn(batch, 16, 64), backend=backend, dtype=torch.float32)
        counts[batch] = counter.count
    assert counts[1] == counts[7] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_input_gives_the_transposed_output(backend):
    G = case_matrix("wide")
    out = newton_schulz(G, backend=backend)
    out_of_transpose = newton_schulz(G.T, backend=backend)
    torch.testing.assert_close(out_of_transpose, out.T, rtol=0, atol=0)


@pytest.mark.parametrize(
    "input_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str
)
def test_output_has_the_input_shape_and_dtype(input_dtype):
    G = torch.randn(3, 40, 12, dtype=input_dtype)
    out = newton_schulz(G)
    assert out.shape == G.shape and out.dtype == input_dtype


def test_single_row_becomes_the_recurrence_of_one_times_the_unit_vector():
    g = torch.randn(1, 300, generator=torch.Generator().manual_seed(4))
    expected = reference.scalar_recurrence(1.0, POLAR_EXPRESS_COEFFICIENTS) * g.double() / g.norm()
    for backend in BACKENDS:
        out = newton_schulz(g, backend=backend, dtype=torch.float32)
        assert relative_error(out, expected) <= fp32_tolerance(POLAR_EXPRESS_COEFFICIENTS)


def test_newton_schulz_object_computes_what_the_function_computes():
    G = case_matrix("tall")
    ns = NewtonSchulz("gram", coefficients=YOU_COEFFICIENTS, restart_iterations=[3])
    expected = newton_schulz(G, coefficients=YOU_COEFFICIENTS, restart_iterations=[3])
    assert torch.equal(ns(G), expected)


# --- like-for-like with torch.optim.Muon --------------------------------------------------------


@pytest.mark.parametrize("case", ["square", "wide", "tall", "rank_deficient"])
def test_direct_keller_bf16_matches_torch_optim_muon_within_its_own_bf16_rounding(case):
    G = case_matrix(case) * 7.0
    exact = reference.newton_schulz_by_svd(G, KELLER_COEFFICIENTS)
    theirs = _zeropower_via_newtonschulz(G, KELLER_COEFFICIENTS[0], 5, 1e-7)
    ours = NewtonSchulz("direct", coefficients=KELLER_COEFFICIENTS, dtype=torch.bfloat16)(G)
    # torch.optim.Muon normalises in bf16 (clamp(min=eps)), we normalise in fp32 (+eps): the
    # two differ by bf16 rounding, bounded here by twice torch's own error against exact math.
    assert relative_error(ours, theirs) <= 2 * relative_error(theirs, exact)


@pytest.mark.parametrize("case", ["square", "wide", "rank_deficient"])
def test_fp16_and_bf16_iterations_differ_by_no_more_than_bf16_rounding(case):
    G = case_matrix(case)
    fp16 = newton_schulz(G, backend="direct", coefficients=KELLER_COEFFICIENTS)
    bf16 = newton_schulz(
        G, backend="direct", coefficients=KELLER_COEFFICIENTS, dtype=torch.bfloat16
    )
    # bf16 rounding = the error of a plain bf16 loop against exact math (fp16 is 8x finer).
    assert relative_error(fp16, bf16) <= plain_loop_error(G, KELLER_COEFFICIENTS, torch.bfloat16)
