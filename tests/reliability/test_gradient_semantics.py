"""The owners' master gradients follow torch's rules, in one process against the reference.

Each backward adds into the gradient, ``step()`` leaves it, ``zero_grad()`` (the model's or the
optimizer's) clears it. The cases users meet: a skipped step (the NaN-skip idiom, GradScaler, HF
Trainer), never zeroing (gradients accumulate across steps), and ``set_to_none=False``.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import dmuon
import dmuon.checkpoint
from dmuon.hooks import get_dedicated_state
from dmuon_kernels import newton_schulz
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate
from tests.reference_optim import ReferenceMuonAdamW
from tests.reliability.scenarios_reliability import fsdp2_mixed_precision_without_a_param_policy

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


def test_model_zero_grad_clears_the_masters_and_micro_batches_accumulate_into_them():
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    with pytest.warns(UserWarning, match="no hook boundary found"):
        dmuon.dedicate_params(model, None, lambda name, p: p.ndim == 2)
    optimizer = dmuon.Muon(model)
    master = optimizer.param_groups[0]["params"][0]
    x = torch.randn(2, 4)
    model(x).sum().backward()
    first = master.grad.clone()
    optimizer.step()
    model.zero_grad()  # the usual idiom (HF Trainer's); it cannot reach the masters itself
    model(x).sum().backward()  # the same gradient again (it does not depend on the weight)
    torch.testing.assert_close(master.grad, first)
    model(x).sum().backward()  # a second micro-batch before the step accumulates
    torch.testing.assert_close(master.grad, 2 * first)


def test_optimizer_zero_grad_clears_the_masters_like_model_zero_grad():
    zero = lambda model, optimizer: optimizer.zero_grad()  # noqa: E731
    assert_same_weights(*run(["step", "skip", "step"], zero=zero))


def test_never_zeroing_accumulates_across_steps_as_torch_does():
    assert_same_weights(*run(["keep", "keep", "keep"]))


def test_zero_grad_without_set_to_none_zeroes_the_masters_in_place():
    model, _, _, _ = build_pair()
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


# ---- nonfinite="raise" | "skip" -----------------------------------------------------------------


def nan_step(nonfinite: str | None, model: nn.Module | None = None):
    """A finite step, then a backward whose gradients are all NaN; ``nonfinite=None`` builds the
    optimizer with the default policy."""
    if model is None:
        torch.manual_seed(0)
        model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    policy = {} if nonfinite is None else {"nonfinite": nonfinite}
    optimizer = dmuon.Muon(
        model, ns_backend=NewtonSchulz(dtype=torch.float32, kernel="cublas"), **policy
    )
    first, second = batches(2, 1)
    loss_fn(model, first).backward()
    optimizer.step()
    optimizer.zero_grad()
    before = {k: v.clone() for k, v in dmuon.checkpoint.get_model_state_dict(model).items()}
    state_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    (loss_fn(model, second) * math.nan).backward()
    return model, optimizer, before, state_before


@pytest.mark.parametrize("nonfinite", ["skip", None], ids=["skip", "the default"])
def test_nonfinite_skip_skips_the_step_and_warns_with_the_step_and_the_parameters(nonfinite):
    model, optimizer, before, state_before = nan_step(nonfinite)
    with pytest.warns(
        UserWarning, match=r"step 2: \d+ parameters have NaN or inf gradients \(.*proj"
    ):
        optimizer.step()
    after = dmuon.checkpoint.get_model_state_dict(model)
    for key, value in before.items():
        assert torch.isfinite(after[key]).all(), key
        assert torch.equal(after[key], value), key
    for param, state in optimizer.state.items():
        for name, value in state.items():
            assert torch.equal(value, state_before[id(param)][name])


def test_nonfinite_skip_is_the_default():
    import inspect

    assert inspect.signature(dmuon.Muon).parameters["nonfinite"].default == "skip"


def test_nonfinite_raise_names_the_parameters_and_updates_nothing():
    model, optimizer, before, _ = nan_step("raise")
    with pytest.raises(RuntimeError, match=r"step 2: .*NaN or inf gradients.*Nothing was updated"):
        optimizer.step()
    after = dmuon.checkpoint.get_model_state_dict(model)
    assert all(torch.equal(after[key], value) for key, value in before.items())


def test_nonfinite_ignore_steps_like_torch_on_request():
    model, optimizer, _, _ = nan_step("ignore")
    optimizer.step()
    masters = [p.master for p in get_dedicated_state(model).iter_owned_masters()]
    assert not all(torch.isfinite(m).all() for m in masters)


def test_the_nonfinite_message_names_parameters_canonically_under_wrappers():
    torch.manual_seed(0)
    model = TinyDecoder()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, optimizer, _, _ = nan_step("raise", model)
    with pytest.raises(RuntimeError) as caught:
        optimizer.step()
    message = str(caught.value)
    assert "layers.0.attn_norm.weight" in message  # an FSDP2-side (not dedicated) parameter
    assert "_checkpoint_wrapped_module" not in message


def test_an_unknown_nonfinite_policy_lists_the_choices():
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(
        ValueError, match=r"nonfinite='drop' is not one of \('ignore', 'raise', 'skip'\)"
    ):
        dmuon.Muon(model, nonfinite="drop")


# ---- mixed precision without a policy for the rest of the model -------------------------------


def test_bf16_dedicated_weights_with_fp32_inputs_warn_before_the_dtype_error():
    model = TinyDecoder()
    dmuon.dedicate_params(
        model, None, proj_predicate, param_policy={"defaults": {"param_dtype": torch.bfloat16}}
    )
    with (
        pytest.warns(
            UserWarning,
            match=r"inputs of layers\.0 are torch\.float32 .*mp_policy=MixedPrecisionPolicy",
        ),
        pytest.raises(RuntimeError, match="dtype"),
    ):
        loss_fn(model, batches(1, 1)[0])


def test_fsdp2_mixed_precision_without_a_param_policy_warns_naming_both_dtypes_and_the_fix(pool2):
    # FSDP2 casts the blocks' inputs to bf16; the dedicated weights keep fp32.
    for result in pool2.run(fsdp2_mixed_precision_without_a_param_policy):
        assert "same dtype" in result["error"]
        (warning,) = result["warnings"]
        assert warning.startswith(
            "dmuon: the inputs of layers.0 are torch.bfloat16 (as FSDP2's MixedPrecisionPolicy "
            "casts them) but its dedicated weights compute in torch.float32"
        )
        assert "param_policy={'defaults': {'param_dtype': torch.bfloat16}}" in warning
        assert "mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32)" in warning


def test_matching_compute_dtypes_do_not_warn():
    model = TinyDecoder().to(torch.bfloat16)
    dmuon.dedicate_params(
        model, None, proj_predicate, param_policy={"defaults": {"param_dtype": torch.bfloat16}}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model, batches(1, 1)[0]).backward()
