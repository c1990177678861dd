"""Torch's habits on a dmuon model, on gloo: ``torch.nn.utils.clip_grad_norm_`` (and torch's
other clipping functions) over ``model.parameters()`` raises on every rank naming
``dmuon.clip_grad_norm_``, a torch optimizer over them naming ``dmuon.Muon``, before any
collective and before changing anything, so training goes on in step with
``dmuon.clip_grad_norm_`` and matches the single-process reference; a model without dmuon keeps
torch's clipping. (In one process: tests/core/test_torch_habits.py.)"""

import pytest

from tests.distributed import scenarios_torch_habits as scenarios
from tests.distributed.test_gradient_scale import assert_norms_match_reference
from tests.distributed.test_protocol import FP32_TOLERANCE, assert_matches_reference

REFUSAL_START = "{name} read the gradient of a dedicated parameter, which dmuon keeps "
CLIP_FIX = "Clip with dmuon.clip_grad_norm_(model, optimizer, max_norm)"
OPTIMIZER_FIX = "Train a model dmuon.dedicate_params prepared with dmuon.Muon(model, ...)"


def assert_refused_on_every_rank_at_every_step(results, name: str, fix: str = CLIP_FIX) -> None:
    for rank, result in enumerate(results):
        assert result["messages"], "no step was run"
        for step, message in enumerate(result["messages"]):
            assert message is not None, f"rank {rank} step {step}: {name} did not raise"
            assert message.startswith(REFUSAL_START.format(name=name)), (rank, step, message)
            assert fix in message, (rank, step, message)


@pytest.mark.parametrize("name", sorted(scenarios.TORCH_CLIPPING))
def test_torchs_clipping_raises_on_every_rank_and_dmuons_clip_then_trains_like_the_reference(
    pool2, name
):
    results = pool2.run(scenarios.torch_clipping_then_dmuons, function=name)
    assert_refused_on_every_rank_at_every_step(results, f"torch.nn.utils.{name}")
    assert_norms_match_reference(results)
    assert_matches_reference(results, FP32_TOLERANCE)
    # The norm is above max_norm at every step, so clipping was exercised.
    assert all(norm > 0.05 for result in results for norm, _ in result["norms"])


@pytest.mark.parametrize(("world_size", "replicas"), [(4, 1), (4, 2)], ids=["1d-4", "hsdp-2x2"])
def test_torchs_clip_grad_norm_raises_on_every_rank_of_four_and_of_hsdp(
    gloo_pool, world_size, replicas
):
    results = gloo_pool(world_size).run(
        scenarios.torch_clipping_then_dmuons, function="clip_grad_norm_", replicas=replicas
    )
    assert_refused_on_every_rank_at_every_step(results, "torch.nn.utils.clip_grad_norm_")
    assert_norms_match_reference(results)
    assert_matches_reference(results, FP32_TOLERANCE)


def test_a_torch_optimizer_over_a_dmuon_models_parameters_raises_on_every_rank(pool2):
    results = pool2.run(scenarios.torch_clipping_then_dmuons, function="AdamW")
    assert_refused_on_every_rank_at_every_step(results, "torch.optim.AdamW", OPTIMIZER_FIX)
    assert_norms_match_reference(results)
    assert_matches_reference(results, FP32_TOLERANCE)


def test_torchs_clip_grad_norm_of_a_model_without_dmuon_is_torchs(pool2):
    results = pool2.run(scenarios.torch_clipping_of_a_plain_fsdp2_model)
    assert_norms_match_reference(results)
    assert all(norm > 0.05 for result in results for norm, _ in result["norms"])
    for rank, result in enumerate(results):
        assert result["max_error"] < FP32_TOLERANCE, (rank, result["max_error"])


def test_torchs_clip_grad_value_over_the_optimizers_parameters_clips_every_gradient(pool2):
    # The fix the refusal names for clipping by value: owned masters and FSDP2's shards alike.
    results = pool2.run(scenarios.torch_clip_grad_value_over_the_optimizers_parameters)
    assert sum(result["masters"] for result in results) > 0
    for rank, result in enumerate(results):
        assert result["before"] > 1e-3, (rank, result)  # the clip had something to clip
        assert result["after"] == pytest.approx(1e-3, rel=1e-6), (rank, result)
