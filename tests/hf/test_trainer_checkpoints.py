"""DMuonTrainer checkpoints on 2 gloo ranks: rotation, exact resume, and a from_pretrained export.

One scenario (scenarios_hf.train_save_and_resume) trains 6 steps with a checkpoint every 2 (at
most 2 kept), exports the model with ``save_model``, then resumes a fresh model and optimizer
from the step-4 checkpoint. Same topology, fp32 Newton-Schulz, same data order and RNG: the
resumed steps must repeat the uninterrupted ones bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.hf import scenarios_hf


@pytest.fixture(scope="module")
def save_and_resume_run(pool2, tmp_path_factory) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("dmuon-hf-checkpoints")
    results = pool2.run(scenarios_hf.train_save_and_resume, output_dir=str(output_dir))
    return [{**result, "output_dir": output_dir} for result in results]


def test_checkpoints_rotate_down_to_the_last_two(save_and_resume_run):
    for result in save_and_resume_run:
        assert result["checkpoints"] == ["checkpoint-4", "checkpoint-6"]


def test_a_checkpoint_holds_the_full_model_the_sharded_state_and_trainer_state(
    save_and_resume_run,
):
    files = save_and_resume_run[0]["last_checkpoint_files"]
    for name in (
        "config.json",
        "model.safetensors",
        "dmuon_state",
        "scheduler.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "trainer_state.json",
        "training_args.bin",
    ):
        assert name in files
    assert "optimizer.pt" not in files


def test_resumed_run_repeats_the_uninterrupted_steps_bit_for_bit(save_and_resume_run):
    resumed_steps = list(range(scenarios_hf.RESUME_STEP + 1, scenarios_hf.CHECKPOINT_STEPS + 1))
    for result in save_and_resume_run:
        for key in ("losses", "grad_norms", "learning_rates"):
            uninterrupted, resumed = result[key], result[f"resumed_{key}"]
            assert sorted(resumed) == list(range(1, scenarios_hf.CHECKPOINT_STEPS + 1))
            assert [resumed[s] for s in resumed_steps] == [uninterrupted[s] for s in resumed_steps]
        # The learning rate decays: a resume that lost the scheduler would step at another one.
        rates = result["learning_rates"]
        assert rates[scenarios_hf.RESUME_STEP + 1] < rates[scenarios_hf.RESUME_STEP]
        # The last step's update is in no loss; the weights after it are in the logits.
        assert torch.equal(result["resumed_logits"], result["logits"])


def test_saved_model_loads_with_from_pretrained_in_one_process_with_identical_logits(
    save_and_resume_run,
):
    result = save_and_resume_run[0]
    assert "model.safetensors" in result["export_files"]
    model = AutoModelForCausalLM.from_pretrained(result["output_dir"] / "export")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=scenarios_hf.probe_tokens()).logits
    assert logits.dtype == torch.float32
    assert torch.equal(logits, result["logits"])


def test_the_exported_full_weights_load_back_into_a_fresh_sharded_model(save_and_resume_run):
    # The path of save_only_model checkpoints and load_best_model_at_end on 2 ranks.
    for result in save_and_resume_run:
        assert torch.equal(result["export_loaded_logits"], result["logits"])
