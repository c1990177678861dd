"""DMuonTrainer trains a dmuon + FSDP2 model through transformers.Trainer on 2 gloo ranks.

The reference is a plain single-process model with the reference Muon/AdamW and torch's own
clip_grad_norm_, on the same rows (each step sees the whole dataset, see scenarios_hf).
"""

from __future__ import annotations

import math

import pytest

from tests.hf import scenarios_hf

# fp32 everywhere; what is left is summation order across ranks and shards.
LOSS_RTOL = 1e-4
WEIGHT_RTOL = 1e-4
STEPS = 4


@pytest.fixture(scope="module")
def one_micro_batch_run(pool2) -> list[dict]:
    return pool2.run(
        scenarios_hf.train_with_dmuon_trainer,
        steps=STEPS,
        per_device_batch=2,
        accumulation=1,
        max_grad_norm=0.0,
    )


@pytest.fixture(scope="module")
def clipped_accumulation_run(pool2) -> list[dict]:
    # max_grad_norm below the gradient norm: every step clips, the dedicated gradients (on their
    # owners) included. Two micro-batches per step; the first runs under dmuon.no_sync.
    return pool2.run(
        scenarios_hf.train_with_dmuon_trainer,
        steps=STEPS,
        per_device_batch=1,
        accumulation=2,
        max_grad_norm=0.5,
    )


def assert_matches_reference(result: dict) -> None:
    reference = result["reference"]
    assert result["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=LOSS_RTOL)
    if "eval_loss" in result:
        assert result["eval_loss"] == pytest.approx(reference["eval_loss"], rel=LOSS_RTOL)
    assert result["max_weight_error"] < WEIGHT_RTOL


def test_trainer_leaves_the_sharded_model_unwrapped(one_micro_batch_run):
    for result in one_micro_batch_run:
        assert result["model_wrapped_is_model"], result["model_wrapped_type"]
        assert result["model_wrapped_type"] == "FSDPLlamaForCausalLM"
        assert not result["ddp_anywhere"]


def test_trainer_lowers_the_loss_and_matches_the_single_process_reference(one_micro_batch_run):
    for result in one_micro_batch_run:
        losses = result["losses"]
        assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < 0.9 * losses[0]
        assert_matches_reference(result)
    assert one_micro_batch_run[0]["losses"] == one_micro_batch_run[1]["losses"]


def test_clipping_and_gradient_accumulation_match_the_reference(clipped_accumulation_run):
    for result in clipped_accumulation_run:
        assert min(result["reference"]["grad_norms"]) > 0.5
        assert_matches_reference(result)


def test_accumulation_reduces_once_per_step_like_a_single_micro_batch(
    one_micro_batch_run, clipped_accumulation_run
):
    for single, accumulated in zip(one_micro_batch_run, clipped_accumulation_run):
        assert single["reduces_per_step"] > 0 and single["reduce_scatters_per_step"] > 0
        assert accumulated["reduces_per_step"] == single["reduces_per_step"]
        assert accumulated["reduce_scatters_per_step"] == single["reduce_scatters_per_step"]
