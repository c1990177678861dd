"""The reference optimizer computes SPEC.md's Muon and AdamW, checked against torch.optim.

How the reference relates to ``torch.optim.Muon(..., adjust_lr_fn="match_rms_adamw")``
(torch/optim/_muon.py, torch 2.13):

- torch's buffer is an EMA: ``B = lerp(B, g, 1 - mu)`` from ``B = 0``, so ``B_t = (1 - mu) buf_t``
  with the reference's ``buf_1 = g``, ``buf_t = mu buf + g``; its Nesterov input
  ``lerp(g, B, mu) = (1 - mu)(g + mu buf_t)`` is the reference's ``u`` times ``(1 - mu)``.
  Newton-Schulz divides by the Frobenius norm first, so both feed it the same direction; only
  rounding differs (the factor 1 - mu goes through torch's bf16 cast).
- "match_rms_adamw" multiplies lr by ``0.2 * sqrt(max(A, B))`` for a 2-D (A, B) parameter: exactly
  the reference's ``0.2 * sqrt(max(m, n))``. Weight decay uses the unscaled lr in both:
  ``W * (1 - lr * wd)``.
- When ``1 - mu`` is a power of two (mu = 0, 0.75, 0.875) scaling by it commutes with the bf16
  cast, so both orthogonalize the same bf16 matrix up to fp32 roundings of the momentum
  arithmetic, and parameters agree to fp32 rounding. With the default mu = 0.95, bf16 rounds
  ``u`` and ``0.05 u`` differently, and parameters agree to bf16 rounding only.
- torch's orthogonalizer returns bf16; the reference applies every update in the parameter's
  dtype (fp32), as torch's ``param.add_`` does.
"""

import functools
import math

import pytest
import torch
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _zeropower_via_newtonschulz,
)

from tests.reference_optim import ReferenceMuonAdamW

STEPS = 10
FP32_EPS = torch.finfo(torch.float32).eps
BF16_EPS = torch.finfo(torch.bfloat16).eps

torch_newton_schulz = functools.partial(
    _zeropower_via_newtonschulz,
    ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C),
    ns_steps=DEFAULT_NS_STEPS,
    eps=EPS,
)


def make_params(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def twin_params(shapes: dict[str, tuple[int, ...]]):
    """Two independent copies of the same initial parameters (reference, torch.optim)."""
    params = make_params(shapes)
    ours = {name: p.clone().requires_grad_() for name, p in params.items()}
    theirs = {name: p.clone().requires_grad_() for name, p in params.items()}
    return params, ours, theirs


def set_gradients(step: int, ours: dict, theirs: dict, skip: frozenset[str] = frozenset()):
    generator = torch.Generator().manual_seed(1000 + step)
    for name in ours:
        grad = torch.randn(ours[name].shape, generator=generator)
        ours[name].grad = None if name in skip else grad.clone()
        theirs[name].grad = None if name in skip else grad.clone()


def relative_difference(actual: torch.Tensor, expected: torch.Tensor, start: torch.Tensor) -> float:
    """Difference of two trajectories relative to how far the parameter moved."""
    return ((actual - expected).norm() / (expected - start).norm()).item()


MATRICES = {"wide": (16, 40), "tall": (48, 12), "square": (24, 24)}


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_part_matches_torch_adamw_to_fp32_rounding(weight_decay):
    shapes = {"bias": (32,), "embedding": (20, 8), "norm": (8,)}
    start, ours, theirs = twin_params(shapes)
    reference = ReferenceMuonAdamW(
        ours.items(),
        lambda name, p: False,
        adamw_lr=1e-2,
        adamw_betas=(0.8, 0.95),
        adamw_eps=1e-6,
        adamw_weight_decay=weight_decay,
        orthogonalize=torch_newton_schulz,
        decay_everything=True,  # torch's AdamW decays every parameter
    )
    torch_adamw = torch.optim.AdamW(
        theirs.values(), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay
    )
    for step in range(STEPS):
        # "norm" has no gradient on step 3: both skip it, and its step count lags by one.
        set_gradients(step, ours, theirs, skip=frozenset({"norm"}) if step == 3 else frozenset())
        reference.step()
        torch_adamw.step()
    assert reference.state["norm"]["step"] == STEPS - 1
    for name in shapes:
        # Each step's update differs by a few fp32 roundings of itself; 10 ulps per step of room.
        error = relative_difference(ours[name].detach(), theirs[name].detach(), start[name])
        assert error < 10 * STEPS * FP32_EPS, f"{name}: {error:.2e}"


def muon_against_torch_muon(momentum: float, nesterov: bool):
    """Both Muons from the same start on the same gradients for STEPS steps, our reference with
    torch's orthogonalisation; returns (start, ours, theirs)."""
    start, ours, theirs = twin_params(MATRICES)
    reference = ReferenceMuonAdamW(
        ours.items(),
        lambda name, p: True,
        lr=0.02,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=0.1,
        orthogonalize=torch_newton_schulz,
    )
    torch_muon = torch.optim.Muon(
        theirs.values(),
        lr=0.02,
        weight_decay=0.1,
        momentum=momentum,
        nesterov=nesterov,
        adjust_lr_fn="match_rms_adamw",
    )
    for step in range(STEPS):
        set_gradients(step, ours, theirs)
        reference.step()
        torch_muon.step()
    return start, ours, theirs


@pytest.mark.parametrize(
    ("momentum", "nesterov"), [(0.0, True), (0.75, True), (0.875, True), (0.75, False)]
)
def test_muon_part_matches_torch_muon_to_fp32_rounding_when_one_minus_momentum_is_a_power_of_two(
    momentum, nesterov
):
    start, ours, theirs = muon_against_torch_muon(momentum, nesterov)
    for name in MATRICES:
        error = relative_difference(ours[name].detach(), theirs[name].detach(), start[name])
        assert error < 10 * STEPS * FP32_EPS, f"{name}: {error:.2e}"


def test_muon_part_matches_torch_muon_with_nesterov_momentum_to_bf16_rounding():
    start, ours, theirs = muon_against_torch_muon(0.95, nesterov=True)
    for name in MATRICES:
        # Each step's orthogonal factor is computed in bf16 from inputs that differ by a bf16
        # rounding; the iteration amplifies that by a small factor, so allow 4 bf16 ulps.
        error = relative_difference(ours[name].detach(), theirs[name].detach(), start[name])
        assert error < 4 * BF16_EPS, f"{name}: {error:.2e}"


def test_muon_momentum_and_nesterov_follow_the_spec_step_by_step():
    """With an orthogonalize that returns its input, the update is lr * scale * u exactly."""
    shape = (3, 5)
    mu, lr = 0.9, 0.1
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(shape, generator=generator) for _ in range(3)]
    for nesterov in (True, False):
        weight = torch.zeros(shape, requires_grad=True)
        reference = ReferenceMuonAdamW(
            [("w", weight)],
            lambda name, p: True,
            lr=lr,
            momentum=mu,
            nesterov=nesterov,
            orthogonalize=lambda u: u,
        )
        expected_weight = torch.zeros(shape)
        buf = None
        for grad in gradients:
            buf = grad if buf is None else mu * buf + grad
            u = grad + mu * buf if nesterov else buf
            expected_weight = expected_weight - lr * 0.2 * math.sqrt(5) * u
            weight.grad = grad.clone()
            reference.step()
            torch.testing.assert_close(reference.state["w"]["momentum_buffer"], buf)
            torch.testing.assert_close(weight.detach(), expected_weight)


def test_muon_flattens_trailing_dimensions_and_scales_by_the_flattened_shape():
    weight = torch.ones(4, 3, 2, requires_grad=True)  # a (4, 6) matrix
    seen_shapes = []

    def orthogonalize(u: torch.Tensor) -> torch.Tensor:
        seen_shapes.append(tuple(u.shape))
        return torch.ones_like(u)

    reference = ReferenceMuonAdamW(
        [("conv", weight)],
        lambda name, p: True,
        lr=0.1,
        weight_decay=0.5,
        orthogonalize=orthogonalize,
    )
    weight.grad = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(0))
    reference.step()
    assert seen_shapes == [(4, 6)]
    expected = 1 * (1 - 0.1 * 0.5) - 0.1 * 0.2 * math.sqrt(6) * 1
    torch.testing.assert_close(weight.detach(), torch.full((4, 3, 2), expected))


def test_parameters_without_gradient_keep_their_weight_and_state():
    params = make_params({"matrix": (6, 4), "bias": (4,)})
    reference = ReferenceMuonAdamW(
        params.items(), lambda name, p: p.ndim == 2, orthogonalize=torch_newton_schulz
    )
    before = {name: p.clone() for name, p in params.items()}
    reference.step()  # no gradients at all
    assert reference.state == {}
    for name in params:
        assert torch.equal(params[name], before[name])
    params["matrix"].grad = torch.randn(6, 4)
    params["bias"].grad = torch.randn(4)
    reference.step()
    state_after_one_step = {name: dict(s) for name, s in reference.state.items()}
    weights_after_one_step = {name: p.clone() for name, p in params.items()}
    reference.zero_grad()
    assert all(p.grad is None for p in params.values())
    reference.step()
    for name in params:
        assert torch.equal(params[name], weights_after_one_step[name])
        assert reference.state[name].keys() == state_after_one_step[name].keys()
        for key, value in reference.state[name].items():
            assert value is state_after_one_step[name][key]


def test_the_predicate_routes_matrices_to_muon_and_the_rest_to_adamw():
    params = make_params({"proj": (8, 8), "embed": (10, 8), "bias": (8,)})
    reference = ReferenceMuonAdamW(
        params.items(), lambda name, p: name == "proj", orthogonalize=torch_newton_schulz
    )
    assert reference.muon_names == ["proj"]
    assert reference.adamw_names == ["embed", "bias"]


def test_a_vector_selected_for_muon_is_refused_with_the_fix():
    with pytest.raises(
        ValueError,
        match=r"'bias' of shape \(8,\), but Muon needs a parameter with at least 2 dimensions; make is_muon return False",
    ):
        ReferenceMuonAdamW(
            make_params({"bias": (8,)}).items(),
            lambda name, p: True,
            orthogonalize=torch_newton_schulz,
        )
