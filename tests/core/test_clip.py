"""dmuon.clip_grad_norm_ and dmuon.StepGroup in one process: torch's norm types and options, the
parts of a model clipped and stepped as one, and every misuse refused with the fix. (Across ranks
and pipeline stages: tests/distributed/test_protocol.py and test_pipeline.py.)"""

import math
import warnings

import pytest
import torch

import dmuon
from dmuon.hooks import get_dedicated_state
from dmuon_kernels.newton_schulz import NewtonSchulz
from tests.distributed.models import TinyDecoder, batches, loss_fn, proj_predicate

FP32_NS = NewtonSchulz(dtype=torch.float32, kernel="cublas")


def dedicated_model(nonfinite: str = "ignore", step_group=None, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model, ns_backend=FP32_NS, nonfinite=nonfinite, step_group=step_group)
    return model, optimizer


def gradients_of(model) -> dict[str, torch.Tensor]:
    """Every gradient the model's optimizer updates, by name: the masters' and the others'."""
    state = get_dedicated_state(model)
    grads = {p.fqn: p.master.grad.clone() for p in state.iter_owned_masters()}
    for name, param in model.named_parameters():
        if name not in state.params and param.grad is not None:
            grads[name] = param.grad.clone()
    return grads


def weights_of(model) -> dict[str, torch.Tensor]:
    """Every weight the model's optimizer updates, by name: the masters and the others."""
    state = get_dedicated_state(model)
    weights = {p.fqn: p.master.detach().clone() for p in state.iter_owned_masters()}
    for name, param in model.named_parameters():
        if name not in state.params:
            weights[name] = param.detach().clone()
    return weights


@pytest.mark.parametrize(
    ("norm_type", "foreach"),
    [(2.0, None), (1.0, False), (3.0, True), (0.5, None), (math.inf, True), ("inf", False)],
)
def test_the_norm_and_the_clipped_gradients_are_torchs_for_every_norm_type(norm_type, foreach):
    model, optimizer = dedicated_model()
    loss_fn(model, batches(1, 1)[0]).backward()
    before = gradients_of(model)
    expected = torch.nn.utils.get_total_norm(list(before.values()), norm_type)

    total = dmuon.clip_grad_norm_(model, optimizer, 0.01, norm_type=norm_type, foreach=foreach)

    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    coefficient = min(1.0, 0.01 / (expected.item() + 1e-6))
    for name, grad in gradients_of(model).items():
        torch.testing.assert_close(grad, before[name] * coefficient, rtol=1e-6, atol=0)


def test_max_norm_inf_only_measures():
    model, optimizer = dedicated_model()
    loss_fn(model, batches(1, 1)[0]).backward()
    before = gradients_of(model)
    dmuon.clip_grad_norm_(model, optimizer, math.inf)
    after = gradients_of(model)
    assert all(torch.equal(after[name], before[name]) for name in before)


@pytest.mark.parametrize("norm_type", [0, -1.0, -math.inf, math.nan, "fro"])
def test_a_norm_type_without_a_p_norm_is_refused_with_the_fix(norm_type):
    model, optimizer = dedicated_model()
    with pytest.raises(ValueError, match=r"norm_type=.* is not supported; use a p-norm with p > 0"):
        dmuon.clip_grad_norm_(model, optimizer, 1.0, norm_type=norm_type)


def test_the_parts_of_one_step_group_are_clipped_with_one_norm_and_step_alike():
    step_group = dmuon.StepGroup()
    first, first_optimizer = dedicated_model(step_group=step_group, seed=0)
    second, second_optimizer = dedicated_model(step_group=step_group, seed=1)
    tokens = batches(1, 1)[0]
    loss_fn(first, tokens).backward()
    loss_fn(second, tokens).backward()
    before = {**gradients_of(first), **{f"2:{n}": g for n, g in gradients_of(second).items()}}
    expected = torch.nn.utils.get_total_norm(list(before.values()))

    total = dmuon.clip_grad_norm_([first, second], [first_optimizer, second_optimizer], 0.01)

    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    scaled = gradients_of(second)["layers.0.q_proj.weight"]
    torch.testing.assert_close(scaled, before["2:layers.0.q_proj.weight"] * 0.01 / total)


def test_a_nan_in_one_part_skips_every_part_and_names_only_the_culprit_after_a_clip():
    step_group = dmuon.StepGroup()
    first, first_optimizer = dedicated_model("skip", step_group, seed=0)
    second, second_optimizer = dedicated_model("skip", step_group, seed=1)
    tokens = batches(1, 1)[0]
    loss_fn(first, tokens).backward()
    loss_fn(second, tokens).backward()
    get_dedicated_state(second).params["layers.1.up_proj.weight"].master.grad[0, 0] = math.nan
    before = [weights_of(first), weights_of(second)]

    total = dmuon.clip_grad_norm_([first, second], [first_optimizer, second_optimizer], 0.01)
    assert math.isnan(total.item())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_optimizer.step()  # decides for both parts
        second_optimizer.step()

    messages = [str(w.message) for w in caught if "dmuon.Muon" in str(w.message)]
    # Unscaled by the NaN norm, only the culprit is non-finite: it alone is named, once.
    assert len(messages) == 1
    assert "1 parameters have NaN or inf gradients (layers.1.up_proj.weight)" in messages[0]
    for model, weights in zip((first, second), before):
        after = weights_of(model)
        assert all(torch.equal(after[name], weights[name]) for name in weights)


def test_a_clip_norm_taken_before_more_gradients_arrived_is_not_reused():
    model, optimizer = dedicated_model("raise")
    loss_fn(model, batches(1, 1)[0]).backward()
    dmuon.clip_grad_norm_(model, optimizer, 1.0)  # finite
    (loss_fn(model, batches(1, 1)[0]) * math.nan).backward()  # accumulates NaN afterwards
    with pytest.raises(RuntimeError, match=r"step 1: \d+ parameters have NaN or inf gradients"):
        optimizer.step()


def test_with_nonfinite_ignore_a_nan_norm_clips_every_gradient_to_nan_as_torch_does():
    model, optimizer = dedicated_model("ignore")
    (loss_fn(model, batches(1, 1)[0]) * math.nan).backward()
    dmuon.clip_grad_norm_(model, optimizer, 1.0)
    assert all(torch.isnan(grad).all() for grad in gradients_of(model).values())


# ---- misuse ---------------------------------------------------------------------------------


def test_lists_of_different_lengths_are_refused():
    model, optimizer = dedicated_model()
    with pytest.raises(ValueError, match="got 2 models and 1 optimizers"):
        dmuon.clip_grad_norm_([model, model], [optimizer], 1.0)


def test_an_optimizer_of_another_model_is_refused():
    _, optimizer = dedicated_model()
    other, _ = dedicated_model()
    with pytest.raises(ValueError, match=r"optimizers\[0\] is not the optimizer of models\[0\]"):
        dmuon.clip_grad_norm_(other, optimizer, 1.0)


def test_a_torch_optimizer_is_refused_naming_dmuon_muon():
    model, _ = dedicated_model()
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match=r"takes dmuon\.Muon optimizers, got SGD"):
        dmuon.clip_grad_norm_(model, sgd, 1.0)


def test_parts_of_different_step_groups_are_refused_with_the_fix():
    first, first_optimizer = dedicated_model()
    second, second_optimizer = dedicated_model()
    with pytest.raises(ValueError, match=r"different step groups.*step_group=dmuon.StepGroup"):
        dmuon.clip_grad_norm_([first, second], [first_optimizer, second_optimizer], 1.0)


def test_some_parts_of_a_step_group_alone_are_refused():
    step_group = dmuon.StepGroup()
    first, first_optimizer = dedicated_model(step_group=step_group)
    dedicated_model(step_group=step_group)
    with pytest.raises(ValueError, match=r"got 1 optimizers .* for a step group of 2"):
        dmuon.clip_grad_norm_(first, first_optimizer, 1.0)
    with pytest.raises(ValueError, match=r"got 2 optimizers \(1 distinct\)"):
        dmuon.clip_grad_norm_([first, first], [first_optimizer, first_optimizer], 1.0)


def test_a_step_group_refuses_two_optimizers_of_one_model_and_mixed_policies():
    step_group = dmuon.StepGroup()
    model, _ = dedicated_model("skip", step_group)
    with pytest.raises(ValueError, match="this model already has an optimizer in the step group"):
        dmuon.Muon(model, ns_backend=FP32_NS, nonfinite="skip", step_group=step_group)
    with pytest.raises(ValueError, match=r"different nonfinite policies \['ignore', 'skip'\]"):
        dedicated_model("ignore", step_group, seed=1)


def test_a_step_group_takes_a_device_mesh_a_process_group_or_none():
    with pytest.raises(TypeError, match=r"pp_mesh must be a DeviceMesh \(mesh\['pp'\]\)"):
        dmuon.StepGroup(pp_mesh=2)


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 3.0, 2.0 - 1e-6, 2.0, 2.0 + 1e-6])
def test_the_overlapped_steps_clip_coefficient_is_torchs_bit_for_bit(max_norm):
    """The overlapped step keeps its speculation only where the clip's coefficient is exactly
    1.0 (dmuon.clip._clip_coefficient): it must be the factor torch's clip really applied."""
    from dmuon.clip import _clip_coefficient

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 5, generator=generator) for _ in range(3)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    total = torch.tensor(2.0)  # norms near max_norm: the coefficient is near 1 on both sides
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    coefficient = _clip_coefficient(max_norm, total)
    for param, grad in zip(params, grads):
        assert torch.equal(param.grad, grad * coefficient)
    assert bool(coefficient == 1.0) == (max_norm >= 2.0 + 1e-6 or max_norm == 3.0)


def test_overlap_stats_needs_overlap_step():
    _, optimizer = dedicated_model()
    with pytest.raises(ValueError, match="overlap_step=True"):
        optimizer.overlap_stats()
