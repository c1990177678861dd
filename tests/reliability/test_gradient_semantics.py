"""The owners' master gradients follow torch's rules, in one process against the reference.

Each backward adds into the gradient, ``step()`` leaves it, ``zero_grad()`` (the model's or the
optimizer's) clears it. The cases users meet: a skipped step (the NaN-skip idiom, GradScaler, HF
Trainer), never zeroing (gradients accumulate across steps), and ``set_to_none=False``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import dmuon
from dmuon.api import get_dedicated_state
from dmuon_kernels import newton_schulz
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.reference_optim import ReferenceMuonAdamW

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def build_pair():
    torch.manual_seed(0)
    model = TinyDecoder()
    torch.manual_seed(0)
    reference = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model, ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"))
    reference_optimizer = ReferenceMuonAdamW(
        reference.named_parameters(),
        proj_predicate,
        orthogonalize=functools.partial(newton_schulz, dtype=torch.float32),
    )
    return model, optimizer, reference, reference_optimizer


def run(schedule: list[str], zero=lambda model, optimizer: model.zero_grad()):
    """Apply each action of ``schedule`` to dmuon and to the reference; returns both models.

    ``"step"``: backward, step, zero. ``"skip"``: backward, no step, zero. ``"nan-skip"``: a
    backward whose loss is NaN, no step, zero. ``"keep"``: backward and step, no zero.
    """
    model, optimizer, reference, reference_optimizer = build_pair()
    for action, batch in zip(schedule, batches(len(schedule), 1)):
        for net in (model, reference):
            loss = loss_fn(net, batch)
            if action == "nan-skip":
                loss = loss * math.nan
            loss.backward()
        if action in ("step", "keep"):
            optimizer.step()
            reference_optimizer.step()
        if action != "keep":
            zero(model, optimizer)
            reference_optimizer.zero_grad()
    return model, reference


def assert_same_weights(model, reference) -> None:
    masters = {p.fqn: p.master for p in get_dedicated_state(model).iter_owned_masters()}
    others = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        actual = masters.get(name, others[name])
        assert torch.isfinite(actual).all(), name
        torch.testing.assert_close(actual, expected, **TOLERANCE, msg=name)


def test_a_skipped_step_followed_by_model_zero_grad_leaks_nothing_into_the_next_step():
    assert_same_weights(*run(["step", "skip", "step", "step"]))


def test_a_nan_step_that_is_skipped_leaves_every_weight_finite_and_like_the_reference():
    assert_same_weights(*run(["step", "nan-skip", "step", "step"]))


def test_optimizer_zero_grad_clears_the_masters_like_model_zero_grad():
    zero = lambda model, optimizer: optimizer.zero_grad()  # noqa: E731
    assert_same_weights(*run(["step", "skip", "step"], zero=zero))


def test_never_zeroing_accumulates_across_steps_as_torch_does():
    assert_same_weights(*run(["keep", "keep", "keep"]))


def test_zero_grad_without_set_to_none_zeroes_the_masters_in_place():
    model, optimizer, _, _ = build_pair()
    loss_fn(model, batches(1, 1)[0]).backward()
    masters = [p.master for p in get_dedicated_state(model).iter_owned_masters()]
    grads = [master.grad for master in masters]
    model.zero_grad(set_to_none=False)
    for master, grad in zip(masters, grads):
        assert master.grad is grad and not grad.any()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_still_clears_the_other_parameters(set_to_none):
    model, _, _, _ = build_pair()
    loss_fn(model, batches(1, 1)[0]).backward()
    model.zero_grad(set_to_none=set_to_none)
    for name, param in model.named_parameters():
        assert param.grad is None or not param.grad.any(), name
