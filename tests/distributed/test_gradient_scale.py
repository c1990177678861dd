"""The gradient scale follows the engine: gradients summed over the data-parallel ranks.

torchtitan's loss is each rank's summed cross-entropy over the batch's token count, and it calls
``FSDPModule.set_gradient_divide_factor(1.0)`` on every FSDP module so that FSDP2 sums. dmuon
must reduce the dedicated gradients with the same factor: then the trained weights equal the
single-process reference on the full batch, and ``dmuon.clip_grad_norm_`` returns the
reference's total norm and clips identically (with the mean they came out 1/N too small for the
dedicated matrices, and nothing said so). A factor on only some FSDP modules raises instead of
giving the model mixed scales.
"""

from __future__ import annotations

import pytest
import torch

import dmuon
from tests.distributed import scenarios_gradient_scale as scenarios
from tests.distributed.models import TinyDecoder, proj_predicate
from tests.distributed.test_protocol import FP32_TOLERANCE, assert_matches_reference

LAYOUTS = [(2, 1), (4, 1), (4, 2)]
LAYOUT_IDS = ["1d-2", "1d-4", "hsdp-2x2"]


def assert_norms_match_reference(results) -> None:
    for rank, result in enumerate(results):
        assert result["norms"], "no norm was compared"
        for step, (norm, expected) in enumerate(result["norms"]):
            assert norm == pytest.approx(expected, rel=FP32_TOLERANCE), (rank, step)


@pytest.mark.parametrize(("world_size", "replicas"), LAYOUTS, ids=LAYOUT_IDS)
def test_fsdp2_gradient_divide_factor_one_trains_and_clips_like_the_reference(
    gloo_pool, world_size, replicas
):
    results = gloo_pool(world_size).run(
        scenarios.train_summing_gradients, replicas=replicas, clip_max_norm=0.05
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    assert_norms_match_reference(results)
    # The norm is above max_norm at every step, so clipping was exercised.
    assert all(norm > 0.05 for result in results for norm, _ in result["norms"])


@pytest.mark.parametrize(("world_size", "replicas"), [(2, 1), (4, 2)], ids=["1d-2", "hsdp-2x2"])
def test_no_sync_accumulation_with_summed_gradients_equals_the_full_batch(
    gloo_pool, world_size, replicas
):
    results = gloo_pool(world_size).run(
        scenarios.train_summing_gradients,
        replicas=replicas,
        micro_batches=2,
        clip_max_norm=float("inf"),
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    assert_norms_match_reference(results)


def test_dmuon_set_gradient_divide_factor_sets_the_fsdp_modules_too(pool4):
    results = pool4.run(
        scenarios.train_summing_gradients, replicas=2, set_through="dmuon", clip_max_norm=0.05
    )
    assert_matches_reference(results, FP32_TOLERANCE)
    assert_norms_match_reference(results)


def test_ddp_with_a_summing_comm_hook_and_the_dmuon_factor_trains_like_the_reference(pool2):
    results = pool2.run(scenarios.train_ddp_summing_gradients)
    for rank, result in enumerate(results):
        worst = max(result["max_errors"])
        assert worst < FP32_TOLERANCE, f"rank {rank}: max relative error {worst:.3e}"


MIXED = "dmuon: the FSDP modules of this model divide their gradients by different factors ("


def test_a_factor_on_the_root_fsdp_module_alone_is_refused_when_the_optimizer_is_built(pool2):
    for message in pool2.run(scenarios.mixed_divide_factors, case="root_only_before_muon"):
        assert message.startswith(
            MIXED + "1.0 on the root; none (the mean over the data-parallel ranks) on "
            "'layers.0', 'layers.1', 'layers.2')"
        ), message
        assert "FSDPModule.set_gradient_divide_factor does not recurse" in message


def test_a_factor_set_on_some_modules_after_the_optimizer_raises_at_the_next_backward(pool2):
    for message in pool2.run(scenarios.mixed_divide_factors, case="layers_only_after_muon"):
        assert message.startswith(
            MIXED + "none (the mean over the data-parallel ranks) on the root; 1.0 on "
            "'layers.0', 'layers.1', 'layers.2')"
        ), message


def test_fsdp_modules_changed_after_dmuon_set_gradient_divide_factor_are_refused(pool2):
    for message in pool2.run(scenarios.mixed_divide_factors, case="changed_after_dmuon"):
        assert message.startswith(
            "dmuon: dmuon.set_gradient_divide_factor(model, 1.0) was called, but the FSDP "
            "modules of this model now divide their gradients by 2.0"
        ), message


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf"), "1", True])
def test_a_factor_that_is_not_a_positive_number_raises_showing_it(factor):
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    with pytest.raises(ValueError) as caught:
        dmuon.set_gradient_divide_factor(model, factor)
    assert str(caught.value).startswith(
        "dmuon.set_gradient_divide_factor: the gradient divide factor must be a positive number "
        f"or None, got {factor!r}. Pass 1.0 to sum"
    )


def test_in_one_process_the_factor_divides_the_dedicated_gradients():
    torch.manual_seed(0)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate)
    optimizer = dmuon.Muon(model)
    tokens = torch.randint(0, 37, (2, 9))

    def master_grads():
        model(tokens[:, :-1]).sum().backward()
        grads = {p.fqn: p.master.grad.clone() for p in optimizer._dedicated.iter_owned_masters()}
        optimizer.zero_grad()
        return grads

    plain = master_grads()
    dmuon.set_gradient_divide_factor(model, 4.0)
    quartered = master_grads()
    for name, grad in plain.items():
        torch.testing.assert_close(quartered[name], grad / 4, rtol=0, atol=0)
