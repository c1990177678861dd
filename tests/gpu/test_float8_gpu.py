"""torchao's float8 training on dedicated projections, on CUDA at world size 1 (no
torch.distributed): real float8 GEMMs (``torch._scaled_mm``, SM89+), where the CPU tests
(``tests/distributed/test_float8.py``) run torchao's CPU float8 matmuls on gloo.

The model is bfloat16, as float8 training runs (the rowwise GEMM only writes bfloat16). dmuon's
forward and backward must be the plain float8 model's, bit for bit: the broadcast weight is the
bfloat16 value the plain model holds, so every float8 cast sees the same tensor; and a few steps
later the weights must stay close to the reference Muon + AdamW that keeps fp32 masters and
computes with bfloat16 copies of them, as dmuon does. Skipped without torchao or an SM89 GPU.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz, newton_schulz
from tests.distributed.scenarios_float8 import CLASSES, DIM, float8_model, loss_of, projections
from tests.numerics import relative_error
from tests.reference_optim import ReferenceMuonAdamW

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed")

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
LR, WEIGHT_DECAY, STEPS, ROWS = 0.02, 0.01, 5, 64
# The first step: forward and backward bit-equal, the same Newton-Schulz on the same momentum, so
# what differs is the fp32 order of the elementwise update and of AdamW's foreach.
FIRST_STEP_TOLERANCE = 1e-5
# Later steps: a weight that differs by one fp32 rounding can round to another bf16 value, and its
# float8 cast then to another float8 value (2**-4 relative): gradients differ by float8 roundings
# here and there, and the runs drift apart by far more than any rounding of the optimizer. How far
# is measured, not guessed: the same reference with the other Newton-Schulz (gram against direct,
# equal up to fp32 rounding) drifts from it by the float8 amplification of a rounding. dmuon may
# drift no further than a small multiple of that.
DRIFT_FACTOR = 3.0
LOSS_TOLERANCE = 2e-2
DRIFT_FLOOR = 1e-5


@pytest.fixture(autouse=True)
def needs_float8_gemm():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need SM89 or later")


def rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(ROWS, DIM, generator=generator)
    labels = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    return inputs.to("cuda", torch.bfloat16), labels.cuda()


def dmuon_float8(recipe: str):
    model = float8_model(recipe).to("cuda", torch.bfloat16)
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


def ns_cublas() -> NewtonSchulz:
    return NewtonSchulz(dtype=torch.float32, kernel="cublas")


def reference_float8(recipe: str, orthogonalize):
    """fp32 masters (the plain model in float32) and the reference optimizer."""
    reference = float8_model(recipe).to("cuda", torch.bfloat16).float()
    optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        projections,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        orthogonalize=orthogonalize,
    )
    return reference, optimizer


def reference_step(reference, optimizer, step: int) -> float:
    """Forward and backward on a bfloat16 copy of the fp32 masters, gradients back onto them."""
    computing = copy.deepcopy(reference).to(torch.bfloat16)
    loss = loss_of(computing, rows(step))
    loss.backward()
    for master, low in zip(reference.parameters(), computing.parameters(), strict=True):
        master.grad = low.grad.float()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def max_error(model, reference) -> float:
    expected = dict(reference.named_parameters())
    return max(
        relative_error(p.master, expected[p.fqn])
        for p in get_dedicated_state(model).iter_owned_masters()
    )


def max_reference_error(reference, other) -> float:
    named = dict(other.named_parameters())
    return max(
        relative_error(param, named[name])
        for name, param in reference.named_parameters()
        if projections(name, param)
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_dedicated_float8_projections_train_like_the_reference_with_fp32_masters(recipe):
    model, optimizer = dmuon_float8(recipe)
    reference, reference_optimizer = reference_float8(recipe, ns_cublas())
    control, control_optimizer = reference_float8(
        recipe, functools.partial(newton_schulz, backend="gram", dtype=torch.float32)
    )
    losses, reference_losses = [], []
    for step in range(STEPS):
        loss = loss_of(model, rows(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        reference_losses.append(reference_step(reference, reference_optimizer, step))
        reference_step(control, control_optimizer, step)
        if step == 0:
            first = max_error(model, reference)
            assert first < FIRST_STEP_TOLERANCE, f"after the first step: {first:.3e}"
    assert losses[0] == reference_losses[0]
    assert losses == pytest.approx(reference_losses, rel=LOSS_TOLERANCE)
    drift, control_drift = max_error(model, reference), max_reference_error(reference, control)
    assert drift <= DRIFT_FACTOR * control_drift + DRIFT_FLOOR, (
        f"dmuon drifted {drift:.3e} from the reference after {STEPS} steps; the reference with "
        f"the other Newton-Schulz drifted {control_drift:.3e}"
    )
