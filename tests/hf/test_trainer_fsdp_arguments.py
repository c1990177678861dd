"""DMuonTrainer shards a plain model itself from TrainingArguments(fsdp=..., fsdp_config=...), on 2
gloo ranks: dedicated with default_predicate, one FSDP2 unit per decoder layer (the model's
_no_split_modules, as Accelerate's FSDP2 auto-wrap policy), reshard_after_forward and activation
checkpointing from fsdp_config; the run matches the single-process reference (see scenarios_hf).
"""

from __future__ import annotations

import pytest

from tests.hf import scenarios_hf
from tests.hf.test_trainer import assert_matches_reference

STEPS = 3
LLAMA_PROJECTIONS = 7 * 2  # two layers


@pytest.fixture(scope="module")
def default_config_run(pool2) -> list[dict]:
    return pool2.run(scenarios_hf.train_with_fsdp_arguments, steps=STEPS, per_device_batch=2)


@pytest.fixture(scope="module")
def z2_checkpointed_clipped_run(pool2) -> list[dict]:
    # fsdp_config's activation checkpointing and Z2, two micro-batches a step, clipping.
    return pool2.run(
        scenarios_hf.train_with_fsdp_arguments,
        steps=STEPS,
        per_device_batch=1,
        accumulation=2,
        max_grad_norm=0.5,
        fsdp_config={"reshard_after_forward": False, "activation_checkpointing": True},
    )


def test_the_trainer_dedicates_the_default_predicate_and_shards_each_decoder_layer(
    default_config_run,
):
    for result in default_config_run:
        assert len(result["dedicated"]) == LLAMA_PROJECTIONS
        assert result["owner_grid"] == (2, 1)
        assert result["fsdp_units"] == ["", "model.layers.0", "model.layers.1"]
        assert result["reshard_after_forward"] == {True}
        # Accelerate does not shard or wrap the model again (no FSDP in its state).
        assert result["accelerator_distributed_type"] == "DistributedType.MULTI_CPU"


def test_the_sharded_run_matches_the_single_process_reference(default_config_run):
    for result in default_config_run:
        assert result["losses"][-1] < result["losses"][0]
        assert_matches_reference(result)


def test_z2_activation_checkpointing_accumulation_and_clipping_match_the_reference(
    z2_checkpointed_clipped_run,
):
    for result in z2_checkpointed_clipped_run:
        assert result["reshard_after_forward"] == {False}
        assert result["fsdp_units"] == [
            "", "model.layers.0", "model.layers.1"
        ]  # the checkpoint wrappers  # fmt: skip
        assert min(result["reference"]["grad_norms"]) > 0.5
        assert_matches_reference(result)


def test_hsdp_from_parallelism_config_matches_the_reference_on_four_ranks(pool4):
    # ParallelismConfig(dp_replicate_size=2, dp_shard_size=2): dmuon owns over 2 shards and
    # publishes across 2 replicas; Accelerate (which refuses a ParallelismConfig on CPU) never
    # sees it.
    results = pool4.run(
        scenarios_hf.train_with_fsdp_arguments, steps=STEPS, per_device_batch=1, replicas=2
    )
    for result in results:
        assert result["owner_grid"] == (2, 2)
        assert_matches_reference(result)


def test_an_accelerate_launch_fsdp2_config_is_taken_over_like_the_training_arguments(pool2):
    # What `accelerate launch --config_file fsdp2.yaml` puts in the environment, no fsdp argument.
    launcher = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
    }
    results = pool2.run(
        scenarios_hf.train_with_fsdp_arguments,
        steps=STEPS,
        per_device_batch=2,
        launcher_environment=launcher,
    )
    for result in results:
        assert result["fsdp_units"] == ["", "model.layers.0", "model.layers.1"]
        assert result["reshard_after_forward"] == {False}
        assert result["accelerator_distributed_type"] == "DistributedType.MULTI_CPU"
        assert_matches_reference(result)


def test_bf16_computes_in_bf16_on_fp32_masters_and_stays_close_to_the_fp32_reference(pool2):
    results = pool2.run(
        scenarios_hf.train_with_fsdp_arguments, steps=STEPS, per_device_batch=2, bf16=True
    )
    for result in results:
        # Accelerate's FSDP2 policy (param, reduce and output in bf16) on both kinds of weight.
        assert result["dtypes"] == {
            "dedicated_compute": ["torch.bfloat16"],
            "dedicated_reduce": ["torch.bfloat16"],
            "masters": ["torch.float32"],
            "fsdp_compute": ["torch.bfloat16"],
            "fsdp_sharded": ["torch.float32"],
        }
        # bf16 rounding (8 bits of mantissa) against the fp32 reference, over three steps. The
        # weights are not compared: Muon's update on these 32-wide matrices is as large as the
        # weights themselves, and bf16 gradients turn its direction by a few percent.
        assert result["losses"] == pytest.approx(result["reference"]["losses"], rel=2e-2)
        assert result["losses"][-1] < result["losses"][0]
