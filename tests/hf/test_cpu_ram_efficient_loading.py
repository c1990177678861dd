"""``cpu_ram_efficient_loading`` in dmuon-hf: the weights come from the first rank alone.

With the FSDP2 plugin's ``cpu_ram_efficient_loading`` only the first rank's weights count: the
other ranks' model may be on the meta device (or hold anything). ``DMuonAccelerator`` and
``DMuonTrainer`` shard it on the meta device and load the first rank's weights with
``dmuon.checkpoint.set_model_state_dict(..., broadcast_from_rank0=True)``: the model equals the
one loaded on every rank, trains the same, and a second rank receives less than the model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.hf import scenarios_cpu_ram_efficient_loading as scenarios
from tests.hf.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("cpu-ram-efficient") / "llama")
    tiny_llama(seed=3).save_pretrained(path)
    return path


def assert_equal(weights: dict, expected: dict) -> None:
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key


@pytest.fixture(scope="module")
def accelerator_runs(pool2, saved_llama) -> dict[bool, list[dict]]:
    return {
        efficient: pool2.run(scenarios.with_accelerator, path=saved_llama, efficient=efficient)
        for efficient in (True, False)
    }


def test_the_other_ranks_model_may_be_on_the_meta_device(accelerator_runs):
    first, second = accelerator_runs[True]
    assert first["meta"] == []
    assert second["meta"] == second["parameters"] and second["parameters"]
    assert all(run["meta"] == [] for run in accelerator_runs[False])


def test_the_accelerator_loads_the_first_ranks_weights_like_a_load_on_every_rank(
    accelerator_runs, saved_llama
):
    efficient, everywhere = accelerator_runs[True], accelerator_runs[False]
    saved = LlamaForCausalLM.from_pretrained(saved_llama).state_dict()
    assert_equal(efficient[0]["loaded"], saved)
    assert_equal(everywhere[0]["loaded"], saved)
    for one, other in zip(efficient, everywhere, strict=True):
        assert torch.equal(one["logits"], other["logits"])
        assert one["losses"] == other["losses"]
    assert_equal(efficient[0]["trained"], everywhere[0]["trained"])


def test_the_second_rank_receives_its_own_matrices_not_the_model(accelerator_runs, saved_llama):
    saved = LlamaForCausalLM.from_pretrained(saved_llama).state_dict()
    whole = sum(value.numel() * value.element_size() for value in saved.values())
    largest = max(value.numel() * value.element_size() for value in saved.values())
    first, second = accelerator_runs[True]
    assert first["received"] == 0
    assert 0 < second["received"] < whole
    assert 0 < second["peak"] <= largest


def test_the_other_ranks_weights_do_not_count(pool2, saved_llama, accelerator_runs):
    other_weights = pool2.run(
        scenarios.with_accelerator, path=saved_llama, efficient=True, others="random"
    )
    assert other_weights[1]["meta"] == []
    everywhere = accelerator_runs[False]
    for one, other in zip(other_weights, everywhere, strict=True):
        assert one["losses"] == other["losses"]
    assert_equal(other_weights[0]["trained"], everywhere[0]["trained"])


def test_the_trainer_takes_cpu_ram_efficient_loading_from_the_fsdp_config(pool2, saved_llama):
    efficient = pool2.run(scenarios.with_trainer, path=saved_llama, efficient=True)
    everywhere = pool2.run(scenarios.with_trainer, path=saved_llama, efficient=False)
    assert efficient[1]["meta"]
    for one, other in zip(efficient, everywhere, strict=True):
        assert one["losses"] == other["losses"]
    assert_equal(efficient[0]["trained"], everywhere[0]["trained"])
