"""torchao's float8 training on dedicated projections, on CUDA at world size 1 (no
torch.distributed): real float8 GEMMs (``torch._scaled_mm``, SM89+), where the CPU tests
(``tests/distributed/test_float8.py``) run torchao's CPU float8 matmuls on gloo.

The model is bfloat16, as float8 training runs (the rowwise GEMM only writes bfloat16). dmuon's
forward and backward must be the plain float8 model's, bit for bit: the broadcast weight is the
bfloat16 value the plain model holds, so every float8 cast sees the same tensor; and each step,
from the same weights, must be the step of the reference Muon that keeps fp32 masters and
computes with bfloat16 copies of them, as dmuon does. Skipped without torchao or an SM89 GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.scenarios_float8 import CLASSES, DIM, float8_model, loss_of, projections
from tests.numerics import relative_error
from tests.reference_optim import ReferenceMuonAdamW

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed")

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
LR, WEIGHT_DECAY, STEPS, ROWS = 0.02, 0.01, 5, 64
# Each step starts both sides from the same weights (see the test): forward and backward are
# bit-equal, the same Newton-Schulz runs on the same momentum, and what differs is the fp32
# order of the elementwise update (about 1e-6 relative here).
STEP_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def needs_float8_gemm():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need SM89 or later")


def rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(ROWS, DIM, generator=generator)
    labels = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    return inputs.to("cuda", torch.bfloat16), labels.cuda()


def projections_only(model: nn.Module) -> nn.Module:
    """Freeze what is not a dedicated projection (norms, head): in a bfloat16 model dmuon's AdamW
    route updates those in bfloat16, as torch's AdamW would, where the reference keeps fp32
    masters; the float8 projections and their Muon route are what these tests compare."""
    for name, param in model.named_parameters():
        if not projections(name, param):
            param.requires_grad_(False)
    return model


def dmuon_float8(recipe: str):
    model = projections_only(float8_model(recipe).to("cuda", torch.bfloat16))
    dmuon.dedicate_params(model, None, projections)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )
    return model, optimizer


@pytest.mark.parametrize("recipe", RECIPES)
def test_dedicated_float8_forward_and_backward_are_the_plain_float8_models_bit_for_bit(recipe):
    model, _ = dmuon_float8(recipe)
    plain = float8_model(recipe).to("cuda", torch.bfloat16)
    loss = loss_of(model, rows(0))
    loss.backward()
    plain_loss = loss_of(plain, rows(0))
    plain_loss.backward()
    assert loss.item() == plain_loss.item()
    expected = dict(plain.named_parameters())
    owned = list(get_dedicated_state(model).iter_owned_masters())
    assert {type(p.module).__name__ for p in owned} == {"Float8Linear"}
    for p in owned:
        assert torch.equal(p.master.grad, expected[p.fqn].grad.float()), p.fqn


def reference_float8(recipe: str):
    """fp32 masters (the plain model in float32) and the reference optimizer."""
    reference = projections_only(float8_model(recipe).to("cuda", torch.bfloat16).float())
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        projections,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=NewtonSchulz(dtype=torch.float32, kernel="cublas"),
    )
    return reference, optimizer


def reference_step(reference, optimizer, step: int) -> float:
    """Forward and backward on a bfloat16 copy of the fp32 masters, gradients back onto them."""
    computing = copy.deepcopy(reference).to(torch.bfloat16)
    loss = loss_of(computing, rows(step))
    loss.backward()
    for master, low in zip(reference.parameters(), computing.parameters(), strict=True):
        master.grad = None if low.grad is None else low.grad.float()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_step_of_dedicated_float8_projections_is_the_references_with_fp32_masters(recipe):
    """Every step from the same weights on both sides: the reference's masters take dmuon's after
    each step. Without that, a one-ulp difference in a master can move a tensorwise scale (the
    amax) and with it every float8 rounding of the next forward: two correct runs then part by
    percents in a few steps, which says nothing about either. Momentum needs no copy: with equal
    weights the gradients are bit-equal, so both momenta see the same sums."""
    model, optimizer = dmuon_float8(recipe)
    reference, reference_optimizer = reference_float8(recipe)
    expected = dict(reference.named_parameters())
    owned = list(get_dedicated_state(model).iter_owned_masters())
    for step in range(STEPS):
        loss = loss_of(model, rows(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_loss = reference_step(reference, reference_optimizer, step)
        assert loss.item() == reference_loss, f"step {step}"
        for p in owned:
            error = relative_error(p.master, expected[p.fqn])
            assert error < STEP_TOLERANCE, f"step {step}, {p.fqn}: {error:.3e}"
        with torch.no_grad():
            for p in owned:
                expected[p.fqn].copy_(p.master)
