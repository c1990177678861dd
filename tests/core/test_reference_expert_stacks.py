"""The reference optimizer on an (E, m, n) expert stack is ``torch.optim.Muon`` on each expert.

``ReferenceMuonAdamW(expert_stacks=[name])`` updates each slice ``W[e]`` as its own matrix. Here
torch.optim.Muon updates E separate (m, n) parameters holding the same slices with the same
gradients; with ``1 - momentum`` a power of two, torch's EMA momentum and its bf16
orthogonalisation see the reference's direction exactly (see ``test_reference_optim``), so the
two agree to fp32 rounding. The flattened alternative (one (E*m, n) or (E, m*n) matrix) does not.
"""

import functools

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

STEPS = 8
MOMENTUM = 0.75  # 1 - momentum is a power of two: see the module docstring
FP32_EPS = torch.finfo(torch.float32).eps
SHAPE = (4, 12, 20)  # (E, m, n)

torch_newton_schulz = functools.partial(
    _zeropower_via_newtonschulz,
    ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C),
    ns_steps=DEFAULT_NS_STEPS,
    eps=EPS,
)


def trained(expert_stacks: list[str]):
    """The reference on one stack and torch.optim.Muon on its experts, from the same start on
    the same gradients; returns (start, reference stack, torch's experts stacked, the
    reference's state keys)."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(SHAPE, generator=generator)
    stack = start.clone().requires_grad_()
    experts = [start[e].clone().requires_grad_() for e in range(SHAPE[0])]
    reference = ReferenceMuonAdamW(
        [("moe.w", stack)],
        lambda name, p: True,
        lr=0.02,
        momentum=MOMENTUM,
        weight_decay=0.1,
        orthogonalize=torch_newton_schulz,
        expert_stacks=expert_stacks,
    )
    torch_muon = torch.optim.Muon(
        experts, lr=0.02, weight_decay=0.1, momentum=MOMENTUM, adjust_lr_fn="match_rms_adamw"
    )
    for _ in range(STEPS):
        grad = torch.randn(SHAPE, generator=generator)
        stack.grad = grad.clone()
        for e, expert in enumerate(experts):
            expert.grad = grad[e].clone()
        reference.step()
        torch_muon.step()
    stacked = torch.stack([expert.detach() for expert in experts])
    return start, stack.detach(), stacked, sorted(reference.state)


def relative_difference(actual, expected, start) -> float:
    return ((actual - expected).norm() / (expected - start).norm()).item()


def test_an_expert_stack_is_updated_like_torch_muon_on_each_expert_to_fp32_rounding():
    start, ours, theirs, state_keys = trained(expert_stacks=["moe.w"])
    assert relative_difference(ours, theirs, start) < 10 * STEPS * FP32_EPS
    assert state_keys == [f"moe.w[{e}]" for e in range(SHAPE[0])]  # one momentum per expert


def test_the_same_stack_flattened_into_one_matrix_is_not_per_expert_muon():
    start, ours, theirs, _ = trained(expert_stacks=[])
    assert relative_difference(ours, theirs, start) > 0.1
