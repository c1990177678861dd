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


def assert_matches_reference(result: dict) -> None:
    reference = result["reference"]
    assert result["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=LOSS_RTOL)
    assert result["eval_loss"] == pytest.approx(reference["eval_loss"], rel=LOSS_RTOL)
    assert result["max_weight_error"] < WEIGHT_RTOL


def test_trainer_trains_the_sharded_model_as_is_and_matches_the_reference(pool2):
    results = pool2.run(
        scenarios_hf.train_with_dmuon_trainer,
        steps=6,
        per_device_batch=2,
        accumulation=1,
        max_grad_norm=0.0,
    )
    for result in results:
        assert result["model_wrapped_is_model"], result["model_wrapped_type"]
        assert result["model_wrapped_type"] == "FSDPLlamaForCausalLM"
        assert not result["ddp_anywhere"]
        losses = result["losses"]
        assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < 0.9 * losses[0]
        assert_matches_reference(result)
    assert results[0]["losses"] == results[1]["losses"]


def test_clipping_and_gradient_accumulation_match_the_reference(pool2):
    # max_grad_norm well below the gradient norm: every step clips, the dedicated gradients
    # (on their owners) included. Two micro-batches per step run the first under dmuon.no_sync.
    results = pool2.run(
        scenarios_hf.train_with_dmuon_trainer,
        steps=4,
        per_device_batch=1,
        accumulation=2,
        max_grad_norm=0.5,
    )
    for result in results:
        assert min(result["reference"]["grad_norms"]) > 0.5
        assert_matches_reference(result)
