"""A process launched as one of 2 gloo ranks whose TrainingArguments / Accelerator see a world
of 1 (no use_cpu=True / cpu=True on CPU) is refused at construction, naming the fix, instead of
failing at the first save with a wrong diagnosis, at transformers' fsdp check, or training every
rank alone on every batch (see [Note: an unseen world] in dmuon_hf.launch).
"""

from __future__ import annotations

from tests.hf import scenarios_unseen_world


def _assert_names_the_mismatch_and_the_fix(message: str, seer: str, fix: str) -> None:
    assert "this process is one of 2 (torch.distributed / WORLD_SIZE)" in message
    assert f"{seer} sees a world size of 1" in message
    assert f"on CPU, transformers and Accelerate run distributed only when asked: pass {fix}" in (
        message
    )


def test_a_hand_sharded_trainer_without_use_cpu_is_refused_at_construction_naming_use_cpu(pool2):
    for result in pool2.run(scenarios_unseen_world.hand_sharded_trainer_without_use_cpu):
        assert result["seen_world_size"] == 1
        assert result["message"].startswith("DMuonTrainer: ")
        _assert_names_the_mismatch_and_the_fix(
            result["message"], "TrainingArguments", "TrainingArguments(use_cpu=True, ...)"
        )


def test_an_fsdp_arguments_trainer_without_use_cpu_gets_dmuons_message_not_transformers(pool2):
    for result in pool2.run(scenarios_unseen_world.fsdp_arguments_trainer_without_use_cpu):
        assert "Using fsdp only works in distributed training" not in result["message"]
        _assert_names_the_mismatch_and_the_fix(
            result["message"], "TrainingArguments", "TrainingArguments(use_cpu=True, ...)"
        )


def test_an_accelerator_without_cpu_is_refused_instead_of_training_each_rank_alone(pool2):
    for result in pool2.run(scenarios_unseen_world.accelerator_without_cpu):
        assert result["message"].startswith("DMuonAccelerator: ")
        _assert_names_the_mismatch_and_the_fix(
            result["message"], "the Accelerator", "DMuonAccelerator(cpu=True, ...)"
        )


def test_an_accelerator_with_cpu_sees_both_ranks_and_is_accepted(pool2):
    for result in pool2.run(scenarios_unseen_world.accelerator_with_cpu):
        assert result["num_processes"] == 2
